"""Under torchrun, on one node and on two (network namespaces), a run keeps the promises the local
launcher keeps: rank 0 holds the run directory's lock, so a second launch of the same config by
any launcher is refused naming the first; SIGTERM, to torchrun or to any one worker, is a
checkpoint at the next step boundary, each rank leaving with 143 and rank 0 saying so in one line;
and ``lowcomm-torchrun`` (torchrun, the same arguments) ends with that status and one line of its
own, not torch's traceback and status 1 (issue 45: the lock was the local launcher's alone;
lowcomm-train under torchrun had no stop handler, so steps since the last checkpoint were lost,
and torchrun ended every stop in a ``SignalException`` traceback)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm.rundir import RunDir, list_checkpoints
from lowcomm.runlock import RunDirLock
from lowcomm.train.metrics import read_metrics
from netns_helpers import need_iproute2, netns_unavailable, torchrun_on_node
from runs import TINY, first_metrics, tiny_run

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

pytestmark = pytest.mark.slow


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "lowcomm.cli.torchrun", "--standalone", "--nproc-per-node", "2", *args]


def _last_line(out: str) -> str:
    return out.rstrip().splitlines()[-1]


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
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("lowcomm-train:")]
    assert len(lines) == 1 and lines[0].startswith(
        f"lowcomm-train: {run.run_dir} is in use by pid {os.getpid()} on "), done.stderr
    assert _last_line(done.stderr) == ("lowcomm-torchrun: rank 0 ended with status 1, the first of this node's to "
                                       "end; its line is above"), done.stderr
    assert "Traceback" not in done.stderr
    assert not RunDir(run.run_dir).metrics.exists() and not RunDir(run.run_dir).config.exists()  # nothing done


def test_sigterm_under_torchrun_checkpoints_at_the_next_step_and_the_rerun_resumes(tmp_path):
    command = _torchrun("-m", "lowcomm.cli.train", *_overrides(tmp_path, "train.max_steps=60"))
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = first_metrics(proc, tmp_path / "default")
    proc.send_signal(signal.SIGTERM)  # torchrun alone, as kill, systemd or a scheduler does
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert _last_line(out) == "lowcomm-torchrun: stopped by SIGTERM; the workers' lines above say where each stopped"
    assert "Traceback" not in out and "SignalException" not in out

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


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_sigterm_to_one_worker_under_torchrun_is_a_sigterm_for_every_rank(tmp_path):
    """SIGTERM to one worker (a stray kill, a node agent) stops both ranks at one boundary with
    one checkpoint, each leaving 143, as under the local launcher; torchrun ends 143 naming it."""
    command = _torchrun("-m", "lowcomm.cli.train", *_overrides(tmp_path, "train.max_steps=60"))
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = first_metrics(proc, tmp_path / "default")
    workers = _children(proc.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGTERM)  # one worker alone: the OOM reaper's neighbour, a stray kill
    out, _ = proc.communicate(timeout=120)

    assert proc.returncode == 143, out[-3000:]  # not 130 (Ctrl-C), not torchrun's 1
    stopped_at = int(list_checkpoints(metrics.parent / "checkpoints")[0].name.split("_")[1])
    assert [line for line in out.splitlines() if line.startswith("[lowcomm] interrupted")] == [
        f"[lowcomm] interrupted (SIGTERM): stopped at step {stopped_at} with a checkpoint in {metrics.parent}; "
        "run the same command to resume"], out
    assert re.fullmatch(r"lowcomm-torchrun: rank [01] ended with status 143 \(SIGTERM\), the first of this "
                        r"node's to end; its line is above", _last_line(out)), out[-3000:]
    assert "Traceback" not in out


def test_on_two_nodes_the_lock_holds_and_sigterm_to_one_node_stops_both_at_one_checkpoint(tmp_path):
    """2 nodes x 2 ranks (network namespaces, a hostname each): while they train, a local launch of
    the same config is refused naming rank 0 on node 0; SIGTERM to node 1's torchrun alone (a
    drained node) stops all four ranks at one boundary with one checkpoint, each node's
    lowcomm-torchrun ending 143; the same commands then resume and finish."""
    if os.geteuid() != 0:
        netns_unavailable("not root (ip netns add needs CAP_SYS_ADMIN)")
    need_iproute2()
    from netns import node_network

    from lowcomm.launch.local import launch_local, prepare_run_dir
    from lowcomm.runlock import RunDirLocked

    steps = 80
    run = tiny_run(tmp_path, "train.checkpoint_every=0", "wandb.mode=disabled", workers=4, max_steps=steps)
    config_path = prepare_run_dir(run)
    with node_network(2, prefix="lctrun") as nodes:
        procs = [torchrun_on_node(nodes, index, config_path, port=29761) for index in range(2)]
        try:
            metrics = first_metrics(procs[0], run.run_dir.parent)
            with pytest.raises(RunDirLocked, match=rf"{re.escape(str(run.run_dir))} is in use by pid \d+ on "
                                                   rf"{nodes[0].hostname}\b"):
                launch_local(run)  # a second launch, by the other launcher
            procs[1].send_signal(signal.SIGTERM)
            outputs = [proc.communicate(timeout=120)[0] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        assert [proc.returncode for proc in procs] == [143, 143], [out[-3000:] for out in outputs]
        checkpoints = list_checkpoints(RunDir(run.run_dir).checkpoints)
        assert len(checkpoints) == 1, [out[-3000:] for out in outputs]  # one, written by all four ranks together
        stopped_at = int(checkpoints[0].name.split("_")[1])
        assert 0 < stopped_at < steps
        assert [line for line in outputs[0].splitlines() if line.startswith("[lowcomm] interrupted")] == [
            f"[lowcomm] interrupted (SIGTERM): stopped at step {stopped_at} with a checkpoint in {run.run_dir}; "
            "run the same command to resume"], outputs[0][-3000:]
        assert _last_line(outputs[1]) == ("lowcomm-torchrun: stopped by SIGTERM; the workers' lines above say where each "
                                          "stopped"), outputs[1][-3000:]
        assert re.fullmatch(r"lowcomm-torchrun: rank [01] ended with status 143 \(SIGTERM\), .*",
                            _last_line(outputs[0])), outputs[0][-3000:]
        assert not any("Traceback" in out for out in outputs)
        assert not (run.run_dir / ".lock").exists()

        procs = [torchrun_on_node(nodes, index, config_path, port=29761) for index in range(2)]
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [out[-3000:] for out in outputs]
    assert f"resuming from step_{stopped_at:09d}" in outputs[0]
    steps_logged = [record["step"] for record in read_metrics(metrics)]
    assert steps_logged == sorted(set(steps_logged)) and steps_logged[-1] == steps


@pytest.mark.parametrize(("exitcode", "line", "status"), [
    (143, "rank 1 ended with status 143 (SIGTERM), the first of this node's to end; its line is above", 143),
    (75, "rank 1 ended with status 75, the first of this node's to end; its line is above", 75),
    (-9, "rank 1 was killed by SIGKILL (status 137), the first of this node's to end; it left no line", 137),
    (-11, "rank 1 was killed by SIGSEGV (status 139), the first of this node's to end; it left no line", 139),
])
def test_a_failed_workers_line_and_status(exitcode, line, status):
    """torch reports a worker killed by signal N as exit code -N: the shell's status is 128 + N,
    and such a worker said nothing (the OOM killer, a segfault)."""
    from lowcomm.cli.torchrun import failure_line

    assert failure_line(1, exitcode) == (f"lowcomm-torchrun: {line}", status)
