"""A run whose loss diverges stops at that step with one line, writes no checkpoint from the
diverged state, keeps the last finite one, records the divergence in a strict-JSON summary and
exits nonzero; a rerun says so; reports and the sweep tuner rank it worst. Real runs: 2 gloo
workers on the tiny model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from lowcomm.report.runs import load_run
from lowcomm.train.loop import EXIT_DIVERGED
from runs import TINY, tiny_run, train_in_workers

pytestmark = pytest.mark.slow


def _train(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lowcomm.cli.train", *TINY, "cluster.workers=2", "train.max_steps=30",
               f"run_root={tmp_path}", *overrides]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def _run_dir(tmp_path):
    return next(tmp_path.glob("*/*/config.yaml")).parent


def test_a_non_finite_loss_stops_the_run_with_one_line_and_keeps_the_last_finite_checkpoint(tmp_path):
    done = _train(tmp_path, "optimizer=adamw_ddp", "optimizer.lr=1000", "train.warmup_steps=0",
                  "train.checkpoint_every=1", "train.keep_checkpoints=2", "train.divergence_factor=null")
    assert done.returncode == EXIT_DIVERGED, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if "diverged at step" in line]
    assert len(lines) == 1 and "the training loss is not finite (lr " in lines[0], done.stdout[-3000:]
    run_dir = _run_dir(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=pytest.fail)  # strict JSON
    step = summary["diverged"]["step"]
    assert 1 < step < 30 and summary["final_val_loss"] is None
    assert f"diverged at step {step}:" in lines[0] and f"(lr {summary['diverged']['lr']:.3g})" in lines[0]
    # no checkpoint of the diverged step or after it; the newest kept is the one the line names
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").glob("step_*"))
    assert checkpoints and int(checkpoints[-1].split("_")[1]) < step
    assert summary["diverged"]["last_checkpoint"] == checkpoints[-1] and checkpoints[-1] in lines[0]
    import torch

    model = torch.load(run_dir / "checkpoints" / checkpoints[-1] / "model.pt")
    assert all(torch.isfinite(tensor).all() for tensor in model.values())
    # reports rank it worst: no final loss
    record = load_run(run_dir)
    assert record.diverged["step"] == step and record.final_val_loss is None

    again = _train(tmp_path, "optimizer=adamw_ddp", "optimizer.lr=1000", "train.warmup_steps=0",
                   "train.checkpoint_every=1", "train.keep_checkpoints=2", "train.divergence_factor=null")
    assert again.returncode == EXIT_DIVERGED
    assert f"diverged at step {step}" in again.stdout and "nothing to do" not in again.stdout


def test_a_loss_above_the_bound_stops_the_run(tmp_path):
    """DeMo at a huge lr does not reach NaN on the tiny model (the loss climbs to thousands); the
    bound, a multiple of a uniform guess's loss, stops it."""
    done = _train(tmp_path, "optimizer=demo", "optimizer.lr=1000", "train.warmup_steps=0",
                  "train.checkpoint_every=0")
    assert done.returncode == EXIT_DIVERGED, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if "diverged at step" in line)
    bound = 2 * math.log(257)  # the tiny model's vocabulary
    assert f"is above {bound:.4g} (train.divergence_factor 2 x ln(vocabulary size))" in line
    assert "no earlier checkpoint" in line


def test_the_bound_is_checked_before_anything_runs(tmp_path):
    done = _train(tmp_path, "train.divergence_factor=0.5")
    assert done.returncode == 2 and "train.divergence_factor must be a number > 1" in done.stderr


def test_reports_rank_a_diverged_run_worst_and_say_so(tmp_path):
    """A table and the loss-vs-MB points over a diverged run beside a finished one."""
    from lowcomm.report.pareto import loss_mb_points
    from lowcomm.report.seeds import Group
    from lowcomm.report.table1 import build_table1

    train_in_workers(tiny_run(tmp_path / "ok", "optimizer=adamw_ddp", max_steps=3))
    train_in_workers(tiny_run(tmp_path / "bad", "optimizer=adamw_ddp", "optimizer.lr=1000", "train.warmup_steps=0",
                              "train.divergence_factor=null", max_steps=30))
    ok, bad = load_run(_run_dir(tmp_path / "ok")), load_run(_run_dir(tmp_path / "bad"))
    points, skipped = loss_mb_points([ok, bad])
    assert [p.run for p in points] == [ok] and "diverged at step" in skipped[0][1]
    assert Group("bad", [bad]).mean == math.inf > Group("ok", [ok]).mean
    notes = build_table1([ok, bad]).notes
    assert any("diverged at step" in note and "ranked worst" in note for note in notes)


def test_a_lagged_agreement_names_the_same_diverged_step_as_an_agreement_read_at_once(tmp_path):
    """Eager DiLoCo at H=4 reads each boundary's agreement 4 boundaries late
    (Strategy.report_lag); with a checkpoint at every step it reads each at once. The same run
    diverges at the same step either way, logs nothing from it on, and keeps no checkpoint of it."""
    found = {}
    for every in (0, 1):
        train_in_workers(tiny_run(tmp_path / f"every{every}", "optimizer=eager_diloco", "optimizer.sync_every=4",
                                  "optimizer.lr=1000", "train.warmup_steps=0", "train.log_every=1",
                                  f"train.checkpoint_every={every}", "train.divergence_factor=null", max_steps=30))
        run_dir = _run_dir(tmp_path / f"every{every}")
        step = json.loads((run_dir / "summary.json").read_text())["diverged"]["step"]
        logged = [r["step"] for r in load_run(run_dir).metrics]
        assert logged == list(range(1, step)), (every, step, logged)
        checkpoints = [int(path.name.split("_")[1]) for path in (run_dir / "checkpoints").glob("step_*")]
        assert all(c < step for c in checkpoints)
        found[every] = step
    assert found[0] == found[1] and 1 < found[0] < 30
