"""Under torchrun (one node here; several are the same code on each), a run keeps the promises the
local launcher keeps: rank 0 holds the run directory's lock, so a second launch of the same config
by any launcher is refused naming the first, and SIGTERM, which torchrun passes to its workers,
is a checkpoint at the next step boundary, each rank leaving with 143 and rank 0 saying so in one
line (issue 45: the lock was the local launcher's alone; lowcomm-train under torchrun had no stop
handler, so steps since the last checkpoint were lost)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm.rundir import RunDir, list_checkpoints
from lowcomm.runlock import RunDirLock
from lowcomm.train.metrics import read_metrics
from runs import TINY, first_metrics, tiny_run

pytestmark = pytest.mark.slow


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def _overrides(run_root: Path, *extra: str) -> list[str]:
    return [*TINY, "data.train_tokens=65536", "data.val_tokens=4096", f"run_root={run_root}", "cluster.workers=2",
            "train.max_steps=400", "train.checkpoint_every=0", "wandb.mode=disabled", *extra]


def test_a_second_launch_under_torchrun_is_refused_naming_the_holder(tmp_path):
    """lowcomm-train under torchrun (``-m lowcomm.train.worker CONFIG`` goes through the same
    lowcomm.train.worker.run_rank). Rank 1, waiting for rank 0 at the rendezvous, leaves on
    torchrun's SIGTERM within lowcomm.train.stop.TERM_BOUNDARY_S."""
    overrides = _overrides(tmp_path, "train.max_steps=4")
    run = tiny_run(tmp_path, *overrides[len(TINY):])
    with RunDirLock(run.run_dir):  # the first launch, by any launcher
        done = subprocess.run(_torchrun("-m", "lowcomm.cli.train", *overrides), capture_output=True, text=True,
                              timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("lowcomm-train:")]
    assert len(lines) == 1 and lines[0].startswith(
        f"lowcomm-train: {run.run_dir} is in use by pid {os.getpid()} on "), done.stderr
    assert not RunDir(run.run_dir).metrics.exists() and not RunDir(run.run_dir).config.exists()  # nothing done


def test_sigterm_under_torchrun_checkpoints_at_the_next_step_and_the_rerun_resumes(tmp_path):
    command = _torchrun("-m", "lowcomm.cli.train", *_overrides(tmp_path, "train.max_steps=60"))
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = first_metrics(proc, tmp_path / "default")
    proc.send_signal(signal.SIGTERM)  # torchrun alone, as kill, systemd or a scheduler does
    out, _ = proc.communicate(timeout=120)

    checkpoints = list_checkpoints(metrics.parent / "checkpoints")
    assert len(checkpoints) == 1, out
    stopped_at = int(checkpoints[0].name.split("_")[1])
    assert 0 < stopped_at < 60
    lines = [line for line in out.splitlines() if line.startswith("[lowcomm] interrupted")]
    assert lines == [f"[lowcomm] interrupted (SIGTERM): stopped at step {stopped_at} with a checkpoint in "
                     f"{metrics.parent}; run the same command to resume"], out
    assert not (metrics.parent / "summary.json").exists()  # stopped, not finished
    assert not (metrics.parent / ".lock").exists()  # rank 0 let go of the run directory as it left

    resumed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from step_{stopped_at:09d}" in resumed.stdout + resumed.stderr
    steps = [record["step"] for record in read_metrics(metrics)]
    assert steps == sorted(set(steps)) and steps[-1] == 60
