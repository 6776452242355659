"""Every failure of a local run ends with one line that says what happened, and a failed or
interrupted run never exits 0: a killed worker is named with its signal (the other rank's lost
peer, a consequence, left out), a resume whose metrics record is gone or malformed is refused
before anything starts, a read-only run root is one line, a port taken before the workers bind
it costs nothing, and an interrupted ``lowcomm-sweep run`` exits 130 with one line."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lowcomm.launch import local
from lowcomm.rundir import RunDir, list_checkpoints, read_metrics
from runs import SMALL_SYNTHETIC, TINY, as_in_a_terminal, micro_sweep_overrides, tiny_run, worker_pids

pytestmark = pytest.mark.slow


def _train(run_root: Path, *extra: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lowcomm.cli.train", *TINY, *SMALL_SYNTHETIC, f"run_root={run_root}",
                             "cluster.workers=2", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def _lowcomm_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("lowcomm-train:")]


def test_a_killed_worker_is_named_with_its_signal_in_one_line(tmp_path):
    run = tiny_run(tmp_path, "train.checkpoint_every=3", max_steps=400)
    proc = _train(tmp_path, "train.max_steps=400", "train.checkpoint_every=3")
    deadline = time.monotonic() + 240
    while not list_checkpoints(RunDir(run.run_dir).checkpoints) or len(worker_pids(run.run_dir)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(worker_pids(run.run_dir)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)

    assert proc.returncode == 1, out + err
    step = int(list_checkpoints(RunDir(run.run_dir).checkpoints)[0].name.split("_")[1])
    assert _lowcomm_lines(err) == [
        f"lowcomm-train: worker rank 1 was killed by signal 9 (SIGKILL); the last checkpoint is step {step} "
        f"({list_checkpoints(RunDir(run.run_dir).checkpoints)[0]}); rerun the same command to resume"]
    # rank 0 lost its peer because of it: a consequence, not a second report
    assert "lost rank 1" not in out + err and "Traceback" not in out + err


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A tiny run stopped after its checkpoint at step 2 (step 4's and the summary removed)."""
    root = tmp_path_factory.mktemp("stopped")
    run = tiny_run(root, "train.checkpoint_every=2", max_steps=4)
    local.launch_local(run)
    shutil.rmtree(RunDir(run.run_dir).checkpoints / "step_000000004")
    RunDir(run.run_dir).summary.unlink()
    return run


def _resume(run) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowcomm.cli.train", *TINY, *SMALL_SYNTHETIC,
                           f"run_root={run.run_root}", "cluster.workers=2", "train.max_steps=4",
                           "train.checkpoint_every=2"], capture_output=True, text=True, timeout=300)


def test_a_resume_without_its_metrics_record_is_refused_naming_the_file(stopped_run):
    """Refused, not warned about: the resumed run's curves and tables would start at step 2 with
    nothing to say steps were lost, and the old file could no longer be put back as it was."""
    metrics = RunDir(stopped_run.run_dir).metrics
    kept = metrics.read_bytes()
    metrics.unlink()
    try:
        done = _resume(stopped_run)
    finally:
        metrics.write_bytes(kept)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"lowcomm-train: {metrics} is missing, but the run has checkpoints (the newest at step 2): resuming would "
        "leave the metrics of steps 1-2 out of its curves and tables. Put the file back; or, to resume without "
        f"them, create it empty (touch {metrics}); or remove {stopped_run.run_dir} to train the run again"]
    assert not (RunDir(stopped_run.run_dir).checkpoints / "step_000000004").exists()  # nothing trained


def test_a_bad_metrics_line_is_named_before_any_worker_starts(stopped_run):
    metrics = RunDir(stopped_run.run_dir).metrics
    kept = metrics.read_bytes()
    lines = kept.decode().splitlines(keepends=True)
    metrics.write_text(lines[0] + "{not json\n" + "".join(lines[2:]))
    try:
        done = _resume(stopped_run)
    finally:
        metrics.write_bytes(kept)
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"lowcomm-train: {metrics}:2 is not valid JSON")
    assert done.stderr.rstrip().endswith("fix or delete that line, then run the same command again")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to mount a read-only tmpfs")
def test_a_read_only_run_root_is_one_line(tmp_path):
    root = tmp_path / f"ro-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(root)], check=True)
    try:
        proc = _train(root, "train.max_steps=2")
        out, err = proc.communicate(timeout=120)
    finally:
        subprocess.run(["umount", str(root)], check=True)
    assert proc.returncode == 1, out + err
    assert err.splitlines() == [f"lowcomm-train: Read-only file system: {root / 'default'}"]


def test_a_port_taken_between_its_choice_and_the_bind_costs_nothing(tmp_path, monkeypatch):
    """The launcher binds the workers' rendezvous store itself, on a port the kernel gives it:
    there is no window between choosing a port and binding it (before, a port chosen free and
    taken before rank 0 bound it failed the run with EADDRINUSE). Here the old way's choice is a
    port another process holds."""
    taken = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(local, "free_port", lambda: taken.getsockname()[1], raising=False)
    run = tiny_run(tmp_path, "train.checkpoint_every=0", max_steps=2)
    try:
        local.launch_local(run)
    finally:
        taken.close()
    assert [record["step"] for record in read_metrics(RunDir(run.run_dir).metrics)] == [1, 2]


def test_an_interrupted_sweep_run_exits_130_with_one_line(tmp_path):
    sweep = tmp_path / "one.yaml"
    sweep.write_text("base: [experiment=quickstart, train.max_steps=400, train.checkpoint_every=0, train.log_every=1]\n"
                     "points: [[optimizer=adamw_ddp, \"label='AdamW-DDP'\"]]\n")
    proc = subprocess.Popen([sys.executable, "-m", "lowcomm.cli.sweep", "run", str(sweep), "--out", str(tmp_path / "out"),
                             *micro_sweep_overrides(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=as_in_a_terminal)
    deadline = time.monotonic() + 240
    while not any(read_metrics(path) for path in (tmp_path / "runs").glob("*/*/metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=120)

    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err
    checkpoint = next((tmp_path / "runs").glob("*/*/checkpoints/step_*"))
    assert [line for line in err.splitlines() if line.startswith("lowcomm-sweep:")] == [
        f"lowcomm-sweep: interrupted: stopped with a checkpoint at {checkpoint}; run the same command to resume"]
