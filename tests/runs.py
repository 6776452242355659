"""Helpers for tests that launch real tiny runs (imported by test modules, not a test itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep
from lowcomm.train.checkpoint import list_checkpoints
from lowcomm.train.metrics import read_metrics

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


def _train_cmd(run_root: Path, *extra: str) -> list[str]:
    """``lowcomm-train`` of the tiny model: 14 steps, a checkpoint every 5, evaluation every 7."""
    return [sys.executable, "-m", "lowcomm.cli.train", *TINY, *SMALL_SYNTHETIC, f"run_root={run_root}",
            "cluster.workers=2", "train.max_steps=14", "train.checkpoint_every=5", "train.keep_checkpoints=3",
            "train.eval_every=7", *extra]


def kill_resume_and_compare(tmp_path: Path, *overrides: str, kill_after: str = "step_000000005") -> None:
    """Run to the end; run again, SIGKILL the workers once ``kill_after`` is written, resume,
    and require the final parameters and the whole loss / byte sequence to be identical."""
    reference_root, killed_root = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(_train_cmd(reference_root, *overrides), check=True, cwd=tmp_path, timeout=300, capture_output=True)
    ref_dir = next((reference_root / "default").iterdir())
    proc = subprocess.Popen(_train_cmd(killed_root, *overrides), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    run_dir = killed_root / "default" / ref_dir.name
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / kill_after).exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before the checkpoint"
        time.sleep(0.01)
    out = subprocess.run(["pgrep", "-f", f"lowcomm.train.worker {run_dir / 'config.yaml'}"], capture_output=True,
                         text=True)
    for pid in [int(p) for p in out.stdout.split()]:
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    interrupted_at = max(int(p.name.split("_")[1]) for p in list_checkpoints(run_dir / "checkpoints"))
    assert interrupted_at < 14
    resumed = subprocess.run(_train_cmd(killed_root, *overrides), cwd=tmp_path, timeout=300, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step_{interrupted_at:09d}" in resumed.stdout
    final = "checkpoints/step_000000014"
    for name in ["model.pt"] + [p.name for p in (ref_dir / final).glob("optim_rank*")]:
        ref_state = torch.load(ref_dir / final / name, weights_only=False)
        resumed_state = torch.load(run_dir / final / name, weights_only=False)
        assert _same(ref_state, resumed_state), f"{name} differs after the resume"
    ref_metrics, resumed_metrics = read_metrics(ref_dir / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    for key in ("train/loss", "val/loss", "comm/payload_bytes", "comm/cum_payload_MB"):
        assert [r.get(key) for r in resumed_metrics] == [r.get(key) for r in ref_metrics], key


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a if k != "rng")
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
