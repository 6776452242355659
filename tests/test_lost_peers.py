"""A node that disappears, or a rank that stops: collectives wait ``cluster.collective_timeout_s``
(set on every process group lowcomm creates), then the surviving ranks stop with one line naming
what they lost and the checkpoint a rerun resumes from (``lowcomm.train.peers``); under SLURM
the job is requeued and resumes by itself.

- the key: validated before anything starts, stated by every profile, 1800 s (torch's default,
  what such runs had) for a run directory written before it;
- the probe that tells a live rank from a gone, a stopped and an unreachable one, on sockets;
- 2 nodes x 2 ranks under torchrun (network namespaces, root): node 1's link goes down mid-run,
  node 0's ranks stop within the timeout naming node 1 and ranks 2, 3; the same command
  afterwards resumes from the last checkpoint and finishes;
- a SLURM job (the local one-node cluster) whose rank 1 is stopped (SIGSTOP) is requeued by
  rank 0 and finishes from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lowcomm.cli.train import run_config
from lowcomm.config import ConfigError, load_run_config, slurm_profile, validate
from lowcomm.config.compose import compose
from lowcomm.launch.local import prepare_run_dir
from lowcomm.paths import config_dir
from lowcomm.rundir import RunDir, list_checkpoints
from lowcomm.train.peers import ANSWERS, GONE, SILENT, UNREACHABLE, Beacon, Diagnosis, Peer, probe
from netns_helpers import need_iproute2, torchrun_on_node
from runs import SMALL_SYNTHETIC, TINY, tiny_run

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


# ------------------------------------------------------------------------------------ the key
def test_every_profile_states_its_collective_timeout_and_the_launchers_differ():
    profiles = {path.stem: OmegaConf.load(path) for path in sorted((config_dir() / "cluster").glob("*.yaml"))}
    assert all("collective_timeout_s" in profile for profile in profiles.values()), sorted(profiles)
    # a laptop notices a stuck worker in minutes; a 64-GPU job waits out a 1B checkpoint (~5 min at 1 GB/s)
    assert profiles["local"].collective_timeout_s <= 120
    assert profiles["slurm_64gpu"].collective_timeout_s >= 600


@pytest.mark.parametrize(("value", "message"), [
    ("0", "cluster.collective_timeout_s must be a whole number of seconds >= 1"),
    ("-5", "cluster.collective_timeout_s must be a whole number of seconds >= 1"),
    ("ten", "cluster.collective_timeout_s: Value 'ten'"),
])
def test_a_bad_collective_timeout_is_refused_naming_the_key(tmp_path, value, message):
    for cluster in ("local", "slurm_debug"):
        with pytest.raises(ConfigError, match=message):
            tiny_run(tmp_path, f"cluster={cluster}", f"cluster.collective_timeout_s={value}")


def test_a_short_job_takes_the_default_timeout():
    """A 5-minute debug job that does not set the key: the time limit ends it before the 900 s
    timeout would, which is no error (the job is requeued on its time-out either way)."""
    assert slurm_profile({"timeout_min": 5}).collective_timeout_s == 900


def test_a_run_directory_written_before_the_key_loads_with_torchs_default(tmp_path):
    run = tiny_run(tmp_path)
    saved = OmegaConf.create(run.raw)
    del saved.cluster["collective_timeout_s"]
    path = tmp_path / "config.yaml"
    OmegaConf.save(saved, path)

    upgraded = validate(load_run_config(path))

    assert upgraded.cluster.collective_timeout_s == 1800
    assert upgraded.run_name == run.run_name  # the cluster section is not part of the name


def test_the_dry_run_warns_when_a_checkpoint_outlasts_the_collective_timeout():
    from lowcomm.launch.estimate import checkpoint_estimate

    # DeMo at 1B on 64 GPUs: each rank's momentum, 306 GB per checkpoint; the others wait at its barrier
    run = validate(compose(["experiment=paper_table1", "model=olmo_1b", "optimizer=demo", "data=memmap",
                            "data.paths=[/nowhere/train.bin]", "data.val_paths=[/nowhere/val.bin]"]),
                   check_data_files=False)
    assert run.cluster.name == "slurm_64gpu"
    # the ranks write at once: rank 0 writes the model and its momentum, 9.4 GB
    at_profile_rate = checkpoint_estimate(run)
    assert not at_profile_rate.outlasts_timeout and "collective_timeout_s" not in at_profile_rate.describe()
    slow = checkpoint_estimate(run, rank_bandwidth=10e6)
    assert slow.outlasts_timeout
    assert "WARNING: longer than cluster.collective_timeout_s (900 s)" in slow.describe()


# ---------------------------------------------------------------------------------- the probe
def test_the_probe_tells_a_live_rank_from_a_gone_a_stopped_and_an_unreachable_one():
    beacon = Beacon()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there: refused, as for a killed process
    stopped = socket.create_server(("127.0.0.1", 0))  # listens, never answers: a stopped process
    # a full accept queue drops every further SYN: no answer at all, as from an unreachable host
    silent_host = socket.create_server(("127.0.0.1", 0), backlog=0)
    queued = socket.create_connection(silent_host.getsockname())
    try:
        assert probe("127.0.0.1", beacon.port) == ANSWERS
        assert probe("127.0.0.1", closed_port) == GONE
        assert probe("127.0.0.1", stopped.getsockname()[1], timeout_s=0.3) == SILENT
        assert probe("127.0.0.1", silent_host.getsockname()[1], timeout_s=0.3) == UNREACHABLE
    finally:
        for sock in (stopped, queued, silent_host):
            sock.close()
        beacon.close()


def _diagnosis(states: dict[int, str], *, rank: int = 0, departed=(), timed_out: bool = True) -> Diagnosis:
    peers = tuple(Peer(r, f"node{r // 2}", "", 0) for r in range(4))
    return Diagnosis(rank, peers, states, frozenset(departed), timed_out, 15)


def test_the_line_names_a_lost_node_or_the_ranks_and_why():
    node = _diagnosis({1: ANSWERS, 2: UNREACHABLE, 3: UNREACHABLE})
    assert node.summary() == "lost node node1 (ranks 2, 3): no answer within 15 s (cluster.collective_timeout_s)"
    assert node.lost == [2, 3] and node.reports and node.leads
    assert not _diagnosis({0: ANSWERS, 2: UNREACHABLE, 3: UNREACHABLE}, rank=1).reports

    mixed = _diagnosis({0: ANSWERS, 1: SILENT, 3: GONE}, rank=2)
    assert mixed.summary() == ("lost rank 1 on node0: stopped or hung, no answer within 15 s "
                               "(cluster.collective_timeout_s); and rank 3 on node1: its process is gone")
    assert mixed.reports and not mixed.leads  # rank 0 answered: it leads
    # a survivor that left first (it said farewell) is not lost
    assert _diagnosis({1: GONE, 2: GONE, 3: ANSWERS}, departed={1}).lost == [2]


# ------------------------------------------------------------------ a node drops off the network
DROP_TIMEOUT_S = 10  # the collective timeout of the node tests: short, but above start-up's skew
# What the survivors may take beyond the timeout: the step in flight, the probe of the lost node's
# beacons (2 s), the farewells and torchrun's own exit.
SLACK_S = 8


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.slow
def test_a_node_that_drops_off_the_network_stops_the_run_with_one_line_and_the_same_command_resumes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    from netns import node_network

    need_iproute2()
    steps = 24
    run = tiny_run(tmp_path, "train.checkpoint_every=3", f"cluster.collective_timeout_s={DROP_TIMEOUT_S}",
                   workers=4, max_steps=steps)
    config_path = prepare_run_dir(run)
    with node_network(2, prefix="lcdrop") as nodes:
        procs = [torchrun_on_node(nodes, index, config_path) for index in range(len(nodes))]
        try:
            deadline = time.monotonic() + 180
            while _logged_steps(run.run_dir) < 7:  # a checkpoint at step 6 and a step beyond it
                assert all(proc.poll() is None for proc in procs), [proc.communicate()[0][-3000:] for proc in procs]
                assert time.monotonic() < deadline, "the run did not start"
                time.sleep(0.05)
            subprocess.run(["ip", "-n", nodes[1].namespace, "link", "set", "eth0", "down"], check=True)
            down = time.monotonic()
            out0 = procs[0].communicate(timeout=DROP_TIMEOUT_S + 60)[0]
            stopped_after = time.monotonic() - down
            out1 = procs[1].communicate(timeout=60)[0]  # the cut-off node gives up as well
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()  # torchrun stops its workers
                    proc.wait(timeout=60)
        print(f"node 0 stopped {stopped_after:.1f} s after its link went down; node 1 said:\n"
              + "\n".join(line for line in out1.splitlines() if line.startswith("[lowcomm] lost")))
        # lowcomm-torchrun ends with its first worker's status: node 0's ranks lost their peers (75)
        assert procs[0].returncode == 75 and procs[1].returncode != 0, (out0[-3000:], out1[-3000:])
        assert stopped_after < DROP_TIMEOUT_S + SLACK_S, out0[-3000:]
        last = int(list_checkpoints(RunDir(run.run_dir).checkpoints)[0].name.split("_")[1])
        assert 6 <= last < steps
        lost = [line for line in out0.splitlines() if line.startswith("[lowcomm] lost")]
        # the collective's timeout names the wait; on a loaded machine the failure may come first as
        # a refused probe instead (both say what happened: the node cannot be reached)
        assert lost in ([f"[lowcomm] lost node {nodes[1].hostname} (ranks 2, 3): {why}; the last checkpoint is step "
                         f"{last}; rerun the same command to resume"]
                        for why in (f"no answer within {DROP_TIMEOUT_S} s (cluster.collective_timeout_s)",
                                    "unreachable")), out0[-3000:]
        assert "Traceback" not in out0  # no rank's traceback, nor torchrun's
        assert re.fullmatch(r"lowcomm-torchrun: rank [01] ended with status 75, the first of this node's to end; "
                            r"its line is above", out0.rstrip().splitlines()[-1]), out0[-3000:]

        subprocess.run(["ip", "-n", nodes[1].namespace, "link", "set", "eth0", "up"], check=True)
        procs = [torchrun_on_node(nodes, index, config_path) for index in range(len(nodes))]
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [out[-3000:] for out in outputs]
    assert f"resuming from step_{last:09d}" in outputs[0]
    summary = json.loads(RunDir(run.run_dir).summary.read_text())
    assert summary["steps"] == steps


# ------------------------------------------------------------------------- a rank stops in SLURM
def _task_pid(job_id: str, task: int) -> int | None:
    """The process of task ``task`` of SLURM job ``job_id`` (submitit's task runner)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"SLURM_JOB_ID={job_id}".encode() in environ and f"SLURM_PROCID={task}".encode() in environ
                and b"submitit.core._submit" in cmdline):
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.slurm
def test_a_slurm_job_whose_rank_stops_is_requeued_by_the_survivor_and_resumes(local_slurm, tmp_path):  # noqa: ARG001
    """Issue 27's stuck worker under SLURM, where a node cannot be lost: rank 1 is stopped, rank 0
    gives up after the collective timeout, names it, requeues the job (one of slurm_debug's
    max_requeues) and the requeued job finishes from the last periodic checkpoint."""
    steps = 30
    run_dir = run_config(compose([*TINY, *SMALL_SYNTHETIC, "cluster=slurm_debug", f"train.max_steps={steps}",
                                  "train.checkpoint_every=3", f"cluster.collective_timeout_s={DROP_TIMEOUT_S}",
                                  f"run_root={tmp_path}"]))
    slurm_dir = RunDir(run_dir).slurm_dir
    job_id = json.loads((slurm_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]
    deadline = time.monotonic() + 120
    while _logged_steps(run_dir) < 7 or (pid := _task_pid(job_id, 1)) is None:
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)

    deadline = time.monotonic() + 180
    while not RunDir(run_dir).summary.is_file():
        state = subprocess.run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"],
                               capture_output=True, text=True).stdout.strip()
        logs = "\n".join(path.read_text()[-3000:] for path in sorted(slurm_dir.glob("*_log.*")))
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), f"job {job_id} ended {state}:\n{logs}"
        assert time.monotonic() < deadline, f"the job did not finish (state {state}):\n{logs}"
        time.sleep(0.5)

    task0 = (slurm_dir / f"{job_id}_0_log.out").read_text()
    assert task0.count(f"Starting with JobEnvironment(job_id={job_id},") == 2, "not requeued under its id"
    lost = [line for line in task0.splitlines() if line.startswith("[lowcomm] lost")]
    assert len(lost) == 1, task0[-3000:]
    last = int(lost[0].split("the last checkpoint is step ")[1].split(";")[0])
    assert lost[0] == (f"[lowcomm] lost rank 1 on {socket.gethostname()}: stopped or hung, no answer within "
                       f"{DROP_TIMEOUT_S} s (cluster.collective_timeout_s); the last checkpoint is step {last}; "
                       f"requeueing job {job_id}, which resumes from it (0 more requeues allowed, "
                       "cluster.max_requeues)")
    assert f"resuming from step_{last:09d}" in task0
    assert json.loads(RunDir(run_dir).summary.read_text())["steps"] == steps


def test_only_a_collectives_failure_is_diagnosed():
    from lowcomm.train.peers import is_collective_failure

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
                        "for recv operation to complete")
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise RuntimeError("DDP: the bucket's all-reduce failed") from inner
    except RuntimeError as wrapped:
        assert is_collective_failure(wrapped)
    assert not is_collective_failure(ValueError("no usable checkpoint"))
