"""Helpers for tests that launch real tiny runs (imported by test modules, not a test itself)."""

from __future__ import annotations

from pathlib import Path

from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep

# Small enough for 2 cores: a handful of steps of the tiny model on a small synthetic corpus.
TINY = [
    "wandb.mode=disabled",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "train.eval_instances=16",
    "train.log_every=1",
]
SMALL_SYNTHETIC = ["data.train_tokens=65536", "data.val_tokens=4096"]


def tiny_run(run_root: Path, *overrides: str, workers: int = 2, max_steps: int = 6):
    """A validated RunConfig of the tiny model on ``workers`` local processes."""
    synthetic = not any(o.startswith("data=") and o != "data=synthetic" for o in overrides)
    cfg = compose([*TINY, *(SMALL_SYNTHETIC if synthetic else []), f"run_root={run_root}", f"cluster.workers={workers}", f"train.max_steps={max_steps}",
                   *overrides])
    return validate(cfg)


def quickstart_points() -> dict[str, list[str]]:
    """The quickstart's runs, ``"optimizer=<name>|label=..."`` -> their overrides (without the
    sweep's base): the quickstart covers every registered optimizer (test_resume checks), so a
    test parametrised over these covers them all."""
    sweep = load_sweep("quickstart")
    return {next(o for o in job if o.startswith("optimizer=")) + "|" + job[-1]: job[len(sweep.base):]
            for job in sweep.jobs}


def point_id(point: str) -> str:
    return point.split("|")[1].split("=", 1)[1]


def micro_sweep_overrides(run_root: Path) -> list[str]:
    """Overrides that shrink a quickstart-based sweep to seconds per run (2 workers, 4 sequences
    of 64 tokens per step, a 32k-token corpus), for end-to-end tests of the sweep drivers."""
    return [f"run_root={run_root}", "wandb.mode=disabled", "cluster.workers=2", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.seq_len=64", "train.eval_instances=8", "data.train_tokens=32768",
            "data.val_tokens=2048"]
