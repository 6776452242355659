"""SIGTERM is Ctrl-C, and a stop never waits forever nor says there is nothing to resume when
there is: the local launcher with 2 gloo workers on the tiny model, signals sent as a terminal,
``kill``, ``timeout`` or a supervisor sends them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowcomm.launch.local import TERM_GRACE_S, interrupt_grace_s
from lowcomm.train.checkpoint import list_checkpoints
from lowcomm.train.metrics import read_metrics
from runs import TINY, tiny_run

pytestmark = pytest.mark.slow


def _command(run_root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lowcomm.cli.train", *TINY, "data.train_tokens=65536", "data.val_tokens=4096",
            f"run_root={run_root}", "cluster.workers=2", "train.max_steps=400", "train.checkpoint_every=0",
            "cluster.collective_timeout_s=10", *extra]


def _start(tmp_path: Path, *extra: str, **popen) -> tuple[subprocess.Popen, Path]:
    """The launcher, once its run has logged a step; returns it and the run's metrics file."""
    proc = subprocess.Popen(_command(tmp_path, *extra), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)
    deadline = time.monotonic() + 240
    metrics = None
    while metrics is None or not read_metrics(metrics):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        found = list((tmp_path / "default").glob("*/metrics.jsonl")) if (tmp_path / "default").exists() else []
        metrics = found[0] if found else None
        time.sleep(0.05)
    return proc, metrics


def _workers(config: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"lowcomm.train.worker {config}"], capture_output=True, text=True)
    return sorted(int(pid) for pid in out.stdout.split())


def test_sigterm_to_the_launcher_checkpoints_at_the_next_step_and_exits_143(tmp_path):
    proc, metrics = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)  # the launcher alone, as kill, timeout and docker stop do
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "Traceback" not in out + err
    checkpoints = list_checkpoints(metrics.parent / "checkpoints")
    assert len(checkpoints) == 1
    final = [line for line in err.splitlines() if line.startswith("lowcomm-train:")]
    assert final == [f"lowcomm-train: interrupted (SIGTERM): stopped with a checkpoint at {checkpoints[0]}; "
                     "run the same command to resume"]
    assert not (metrics.parent / ".lock").exists() or not _workers(metrics.parent / "config.yaml")


def test_workers_stopped_by_a_signal_the_launcher_ignored_do_not_end_as_a_success(tmp_path):
    """SIGINT reached the workers only (the launcher ignores it, as under nohup): they checkpoint
    and the launcher reports the interruption, not a finished run."""
    proc, metrics = _start(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    for pid in _workers(metrics.parent / "config.yaml"):
        os.kill(pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert not (metrics.parent / "summary.json").exists()
    assert list_checkpoints(metrics.parent / "checkpoints")
    assert "interrupted: stopped with a checkpoint at" in err


def test_a_second_ctrl_c_with_a_stuck_rank_stops_at_once_and_names_the_checkpoint_there_is(tmp_path):
    proc, metrics = _start(tmp_path, "train.checkpoint_every=2")
    while not list_checkpoints(metrics.parent / "checkpoints"):
        time.sleep(0.05)
    stuck = _workers(metrics.parent / "config.yaml")[-1]
    os.kill(stuck, signal.SIGSTOP)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(2)
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        subprocess.run(["kill", "-CONT", str(stuck)], capture_output=True)  # never leave it stopped
    assert time.monotonic() - started < 15
    assert proc.returncode == 130, out + err
    assert "nothing to resume" not in err
    latest = list_checkpoints(metrics.parent / "checkpoints")[0]
    assert f"the latest checkpoint is {latest}; run the same command to resume from it" in err
    assert not _workers(metrics.parent / "config.yaml")


def test_the_wait_for_a_step_boundary_is_bounded(tmp_path):
    run = tiny_run(tmp_path, "cluster.collective_timeout_s=45")
    assert interrupt_grace_s(run, signal.SIGTERM) == TERM_GRACE_S < 30  # SLURM's default KillWait
    assert interrupt_grace_s(run, signal.SIGINT) == 45 + 30  # a stuck rank: the others give up within 45 s
