"""SIGTERM is Ctrl-C, and a stop never waits forever nor says there is nothing to resume when
there is: the local launcher with 2 gloo workers on the tiny model, signals sent as a terminal,
``kill``, ``timeout`` or a supervisor sends them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowcomm.launch.local import TERM_GRACE_S, interrupt_grace_s
from lowcomm.train.checkpoint import list_checkpoints
from lowcomm.train.metrics import read_metrics
from runs import TINY, as_in_a_terminal, first_metrics, tiny_run

pytestmark = pytest.mark.slow


def _command(run_root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lowcomm.cli.train", *TINY, "data.train_tokens=65536", "data.val_tokens=4096",
            f"run_root={run_root}", "cluster.workers=2", "train.max_steps=400", "train.checkpoint_every=0",
            "cluster.collective_timeout_s=10", *extra]


def _start(tmp_path: Path, *extra: str, **popen) -> tuple[subprocess.Popen, Path]:
    """The launcher, once its run has logged a step; returns it and the run's metrics file.
    Ctrl-C reaches it as in a terminal unless ``popen`` says otherwise."""
    popen.setdefault("preexec_fn", as_in_a_terminal)
    proc = subprocess.Popen(_command(tmp_path, *extra), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)
    return proc, first_metrics(proc, tmp_path / "default")


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


@pytest.mark.parametrize("which", [0, -1], ids=["first", "last"])
def test_sigterm_to_one_worker_is_a_sigterm_for_every_rank_and_the_launcher(tmp_path, which):
    """kill of one rank (an OOM killer's warning, an operator): the ranks agree on the stop and on
    its signal at the same boundary, so the one that was not sent it leaves as SIGTERM too (it
    left as Ctrl-C, 130, and where it left first the launcher said so; issue 45)."""
    proc, metrics = _start(tmp_path)
    os.kill(_workers(metrics.parent / "config.yaml")[which], signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    checkpoints = list_checkpoints(metrics.parent / "checkpoints")
    assert len(checkpoints) == 1 and not (metrics.parent / "summary.json").exists()
    assert _final_line(err) == (f"lowcomm-train: interrupted (SIGTERM): stopped with a checkpoint at {checkpoints[0]}; "
                                "run the same command to resume")


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
    assert _final_line(err) == (f"lowcomm-train: interrupted: stopped at once by a second Ctrl-C, before the step "
                                f"boundary; the last checkpoint is step {_step(latest)} ({latest}); rerun the same "
                                "command to resume")
    assert not _workers(metrics.parent / "config.yaml")


def _final_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("lowcomm-train:")]
    assert len(lines) == 1, err
    return lines[0]


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[1])


def test_ctrl_c_with_a_stuck_rank_ends_within_the_collective_timeout_naming_the_rank(tmp_path):
    """The first Ctrl-C waits for a step boundary that a stopped rank never lets come: the other
    rank gives up within the collective timeout, and the launcher stops at once with its line
    (not after the whole grace, collective timeout + 30 s)."""
    proc, metrics = _start(tmp_path, "train.checkpoint_every=2", "cluster.collective_timeout_s=5")
    while not list_checkpoints(metrics.parent / "checkpoints"):
        time.sleep(0.05)
    stuck = _workers(metrics.parent / "config.yaml")[-1]
    os.kill(stuck, signal.SIGSTOP)
    try:
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        subprocess.run(["kill", "-CONT", str(stuck)], capture_output=True)  # never leave it stopped
    took = time.monotonic() - started
    assert proc.returncode == 130, out + err
    assert took < 5 + 10, f"{took:.1f} s"
    latest = list_checkpoints(metrics.parent / "checkpoints")[0]
    assert _final_line(err) == (f"lowcomm-train: interrupted: lost rank 1 on {socket.gethostname()}: stopped or hung, "
                                "no answer within 5 s (cluster.collective_timeout_s); the last checkpoint is step "
                                f"{_step(latest)} ({latest}); rerun the same command to resume")
    assert "Traceback" not in out + err and not _workers(metrics.parent / "config.yaml")


_NEVER_AT_A_BOUNDARY = """
import os, signal, sys, time
from lowcomm.train.stop import StopDeadline, StopFlag
flag = StopFlag.install(signal.SIGTERM)
def expire(signum, began):
    print(f"left on {signal.Signals(signum).name}" + ("" if began else " before the first step"), flush=True)
    os._exit(128 + signum)
if sys.argv[1] == "early":  # the signal comes while the rank sets up, before the deadline's watch starts
    os.kill(os.getpid(), signal.SIGTERM)
StopDeadline(flag, signal.SIGTERM, 1.0, expire).start()
if sys.argv[1] not in ("setup", "early"):
    flag.begin()  # the training loop has started
if sys.argv[1] != "early":  # (its watch is already leaving)
    print("ready", flush=True)
if sys.argv[1] in ("blocked", "setup", "early"):  # waits forever, as a rank in a collective whose peer is stopped
    os.read(os.pipe()[0], 1)
elif sys.argv[1] == "read":  # the flag is read at every boundary, but the ranks act on it later
    while True:
        flag()
        time.sleep(0.1)
else:  # the boundary that acts on it comes after half a second; the checkpoint follows
    time.sleep(0.5)
    assert flag()
    flag.honour()
    time.sleep(2)
    print("checkpoint written", flush=True)
"""


@pytest.mark.parametrize("case", ["blocked", "read", "boundary", "setup", "early"])
def test_after_sigterm_a_rank_whose_step_boundary_does_not_come_leaves_saying_so(case):
    """lowcomm.train.stop.StopDeadline, with a bound of 1 s: a process that never reaches the
    step boundary where it acts on the request leaves with the signal's status once the bound
    passes (its watch wakes on the signal itself, through set_wakeup_fd, whatever the main thread
    is blocked in), also where it reads the request at every boundary but its ranks agree on it
    later (a lagged agreement, lowcomm.train.boundary); a boundary reached in time disarms it,
    and the checkpoint that follows may take longer. Before the training loop has begun
    (``setup``: a rendezvous waiting for a peer that has gone, a restore) there is nothing to
    checkpoint, and it leaves at once, saying so, also where the signal came before the watch
    started (``early``)."""
    child = subprocess.Popen([sys.executable, "-c", _NEVER_AT_A_BOUNDARY, case], stdout=subprocess.PIPE, text=True)
    if case == "early":
        out, _ = child.communicate(timeout=30)
        assert (child.returncode, out.strip()) == (143, "left on SIGTERM before the first step")
        return
    assert child.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    if case in ("blocked", "read"):
        assert (child.returncode, out.strip()) == (143, "left on SIGTERM")
        assert time.monotonic() - sent < 5
    elif case == "setup":
        assert (child.returncode, out.strip()) == (143, "left on SIGTERM before the first step")
        assert time.monotonic() - sent < 0.9  # at once, not after the bound (1 s)
    else:
        assert (child.returncode, out.strip()) == (0, "checkpoint written")


def test_the_sigterm_bound_fits_slurms_default_killwait():
    from lowcomm.train.stop import TERM_BOUNDARY_S

    assert TERM_BOUNDARY_S < TERM_GRACE_S < 30


def test_the_wait_for_a_step_boundary_is_bounded(tmp_path):
    run = tiny_run(tmp_path, "cluster.collective_timeout_s=45")
    assert interrupt_grace_s(run, signal.SIGTERM) == TERM_GRACE_S < 30  # SLURM's default KillWait
    assert interrupt_grace_s(run, signal.SIGINT) == 45 + 30  # a stuck rank: the others give up within 45 s


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(read_metrics(path)) if path.is_file() else 0


@pytest.mark.slurm
def test_sigterm_in_a_slurm_job_checkpoints_at_the_next_step(local_slurm, tmp_path):  # noqa: ARG001
    """scancel (SLURM's SIGCONT and SIGTERM to every task, SIGKILL after KillWait: 5 s on the
    local cluster): the ranks checkpoint at the next step boundary and leave without requeueing,
    where submitit alone logged "Bypassing signal SIGTERM" and the job was killed with nothing
    saved since its last periodic checkpoint (none here)."""
    from lowcomm.cli.train import run_config
    from lowcomm.config.compose import compose
    from lowcomm.rundir import RunDir

    run_dir = run_config(compose([*TINY, "data.train_tokens=65536", "data.val_tokens=4096", "cluster=slurm_debug",
                                  "train.max_steps=4000", "train.checkpoint_every=0", f"run_root={tmp_path}"]))
    slurm_dir = RunDir(run_dir).slurm_dir
    job_id = json.loads((slurm_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]
    deadline = time.monotonic() + 120
    while _logged_steps(run_dir) < 5:
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.1)
    subprocess.run(["scancel", job_id], check=True)
    deadline = time.monotonic() + 60
    while subprocess.run(["squeue", "--noheader", f"--jobs={job_id}"], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.2)

    logs = {task: (slurm_dir / f"{job_id}_{task}_log.out").read_text() for task in (0, 1)}
    checkpoints = list_checkpoints(RunDir(run_dir).checkpoints)
    assert len(checkpoints) == 1, logs
    step = _step(checkpoints[0])
    assert 5 <= step <= _logged_steps(run_dir) < 4000
    for task, log in logs.items():
        assert (f"[lowcomm] rank {task}: SIGTERM: checkpoint at step {step} written; the job is ending (cancelled, "
                "out of time or preempted); the run resumes from it when SLURM requeues the job or the run is "
                "submitted again") in log, log[-3000:]
    assert not RunDir(run_dir).summary.exists()


@pytest.mark.parametrize("command, prog", [("sweep", "lowcomm-sweep"), ("quickstart", "quickstart")])
def test_sigterm_between_runs_stops_a_multi_run_command_with_its_line(command, prog, monkeypatch, capsys):
    """Between two runs (or while planning) no launcher holds SIGTERM: before, its default action
    ended the sweep at once with nothing said. The signal here is real, sent to this process."""
    import lowcomm.cli.quickstart as quickstart
    import lowcomm.cli.sweep as sweep

    def planning(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not interrupt")

    if command == "sweep":
        monkeypatch.setattr(sweep, "_list", planning)
        code = sweep.main(["list"])
    else:
        monkeypatch.setattr(quickstart, "load_sweep", planning)
        code = quickstart.main([])

    assert code == 143
    assert capsys.readouterr().err.splitlines() == [
        f"{prog}: interrupted (SIGTERM); finished runs are kept, run the same command to go on"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


def test_a_command_that_ignores_sigterm_keeps_ignoring_it():
    from lowcomm.launch.signals import sigterm_as_interrupt

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nohup, a script's background job
    try:
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # ignored: nothing is raised
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
