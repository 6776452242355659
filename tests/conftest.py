"""Shared fixtures.

Trained runs: ``trained_run(*overrides, workers=2, max_steps=6)`` (a session fixture) gives the
finished run of the tiny model with those overrides (``runs.tiny_run``'s settings), training it
the first time any test of the session asks for it and handing the same run directory to every
later one, on either pytest worker. A test that only reads a run asks for it here; one that
changes a run trains its own (``runs.train_in_workers``); only tests about processes themselves
(signals, lost peers, SLURM, nodes) launch theirs for real.

SLURM: ``local_slurm`` starts a private single-node cluster (slurm/local_slurm.sh) for the test
session, ``two_node_slurm`` one of two nodes (network namespaces) for a module, and ``slurm_results`` waits for a submitit job on it with a deadline. Tests that use them
are marked ``@pytest.mark.slurm``. Without root, or where slurm-wlm cannot be installed, they are
skipped, unless LOWCOMM_REQUIRE_SLURM=1 (CI on a machine that must run them), where they fail.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO_ROOT / "slurm" / "local_slurm.sh"
# local_slurm.sh's exit status for "SLURM cannot be had on this machine".
SLURM_UNAVAILABLE_STATUS = 4
# Final states in which a job will never write its results.
SLURM_FAILED_STATES = {
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def _slurm_unavailable(reason: str) -> None:
    if os.environ.get("LOWCOMM_REQUIRE_SLURM") == "1":
        pytest.fail(
            f"LOWCOMM_REQUIRE_SLURM=1 but the local SLURM cluster is unavailable: {reason}", pytrace=False
        )
    pytest.skip(f"local SLURM cluster unavailable: {reason}")


def _free_ports(count: int) -> list[int]:
    # All sockets stay bound until every port is chosen, so the ports are distinct.
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@contextlib.contextmanager
def _slurm_cluster(**extra_env: str) -> Iterator[str]:
    """A private SLURM cluster (slurm/local_slurm.sh, ``extra_env`` its knobs) with its own state
    directory and ports, so that clusters side by side (and one started by hand in
    /tmp/lowcomm-slurm) neither share nor stop each other's daemons; SLURM_CONF points at it in
    os.environ while it runs (sbatch, squeue and the jobs' srun read it). Yields SLURM_CONF."""
    if os.geteuid() != 0:
        _slurm_unavailable("not running as root (slurm/local_slurm.sh starts slurmctld, slurmd and munged)")
    # Short and world-searchable: the munge user must reach its socket below it, and a UNIX socket
    # path is limited to ~108 bytes.
    state_dir = Path(tempfile.mkdtemp(prefix="lowcomm-slurm-", dir="/tmp"))
    state_dir.chmod(0o755)
    ctld_port, slurmd_port = _free_ports(2)
    env = {
        **os.environ,
        "LOWCOMM_SLURM_CTLD_PORT": str(ctld_port),
        "LOWCOMM_SLURM_SLURMD_PORT": str(slurmd_port),
        # job ids of their own (a thousand per port), so that the rendezvous ports submitit derives
        # from them differ from those of a cluster beside it (the suite runs on two pytest workers)
        "LOWCOMM_SLURM_FIRST_JOB_ID": str(ctld_port * 1000),
        **extra_env,
    }
    started = subprocess.run(
        [str(LOCAL_SLURM), "start", str(state_dir)], env=env, capture_output=True, text=True, timeout=900
    )
    if started.returncode != 0:
        subprocess.run([str(LOCAL_SLURM), "stop", str(state_dir)], env=env, capture_output=True, timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)
        if started.returncode == SLURM_UNAVAILABLE_STATUS:
            _slurm_unavailable(started.stderr.strip().splitlines()[-1])
        pytest.fail(
            f"slurm/local_slurm.sh start failed ({started.returncode}):\n{started.stderr}", pytrace=False
        )
    slurm_conf = str(state_dir / "slurm.conf")
    previous_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = slurm_conf
    try:
        yield slurm_conf
    finally:
        subprocess.run([str(LOCAL_SLURM), "stop", str(state_dir)], env=env, capture_output=True, timeout=120)
        if previous_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous_conf
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[str]:
    """A running single-node SLURM cluster for this session; yields its SLURM_CONF path."""
    with _slurm_cluster() as slurm_conf:
        yield slurm_conf


@pytest.fixture(scope="module")
def two_node_slurm() -> Iterator[tuple[list, str]]:
    """Two nodes on this machine (benchmarks/netns.py ``node_network``, the host joined to their
    network as the login node), a slurmd in each and the controller on the host, for a module's
    tests; yields ``(nodes, SLURM_CONF)``. The cluster stops and the namespaces go at the end."""
    if os.geteuid() != 0:
        _slurm_unavailable("not running as root (network namespaces and SLURM's daemons)")
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from netns import login_address, node_network

    with node_network(2, prefix="lcsl", login=True) as nodes, _slurm_cluster(
        LOWCOMM_SLURM_NODES=" ".join(f"{n.hostname}={n.address}={n.namespace}" for n in nodes),
        LOWCOMM_SLURM_CTLD_ADDR=login_address(nodes),
    ) as slurm_conf:
        yield nodes, slurm_conf


def _squeue_state(job_id: str) -> str:
    # Without accounting sacct cannot answer; squeue keeps finished jobs for MinJobAge seconds.
    listed = subprocess.run(
        ["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"],
        capture_output=True,
        text=True,
    )
    return listed.stdout.strip().splitlines()[0] if listed.stdout.strip() else "UNKNOWN"


def _job_logs(job: Any) -> str:
    logs = []
    for task_id in range(job.num_tasks):
        task = job.task(task_id)
        logs.append(
            f"--- task {task_id} stdout:\n{task.stdout()}\n--- task {task_id} stderr:\n{task.stderr()}"
        )
    return "\n".join(logs)


@pytest.fixture
def slurm_results(local_slurm: str) -> Callable[..., list[Any]]:  # noqa: ARG001 - needs the cluster up
    """``slurm_results(job, timeout_s=120)``: every task's return value, in task order.

    submitit alone would wait forever on a job that died without results (it cannot ask sacct
    here); this fails the test with the job's logs instead, as soon as a task raised, the job
    ended in a failed state or the deadline passed (then the job is cancelled).
    """

    def wait(job: Any, timeout_s: float = 120.0) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            tasks = [job.task(i) for i in range(job.num_tasks)]
            finished = [task for task in tasks if task.paths.result_pickle.exists()]
            for task in finished:
                error = task.exception()
                if error is not None:
                    pytest.fail(f"SLURM job {job.job_id} task {task.task_id} raised:\n{error}", pytrace=False)
            if len(finished) == len(tasks):
                return job.results()
            state = _squeue_state(job.job_id)
            if state in SLURM_FAILED_STATES:
                pytest.fail(f"SLURM job {job.job_id} ended {state}:\n{_job_logs(job)}", pytrace=False)
            time.sleep(0.5)
        job.cancel(check=False)
        pytest.fail(
            f"SLURM job {job.job_id} did not finish within {timeout_s}s (last state {state}):\n{_job_logs(job)}",
            pytrace=False,
        )

    return wait


# ------------------------------------------------------------------ trained runs, shared
class TrainedRuns:
    """The session's store of trained runs, keyed by everything the run's config resolves to
    but where it is stored, in a directory both pytest workers see (a file lock per key: the
    first to ask trains, the other waits and reads). Runs are trained in forked ranks
    (``runs.train_in_workers``); a run whose training failed is not kept, and the next test to
    ask trains it again (and fails the same way, with its own traceback)."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def __call__(self, *overrides: str, workers: int = 2, max_steps: int = 6):
        from runs import tiny_run, train_in_workers

        placeholder = tiny_run(self.root / "key", *overrides, workers=workers, max_steps=max_steps)
        resolved = {key: value for key, value in placeholder.raw.items() if key != "run_root"}
        key = hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]
        run = tiny_run(self.root / key, *overrides, workers=workers, max_steps=max_steps)
        with (self.root / f"{key}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (run.run_dir / "summary.json").is_file():
                shutil.rmtree(self.root / key, ignore_errors=True)  # a failed attempt's leftovers
                try:
                    train_in_workers(run)
                except BaseException:
                    shutil.rmtree(self.root / key, ignore_errors=True)
                    raise
        return run


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRuns:
    """``trained_run(*overrides, workers=2, max_steps=6)``: the finished RunConfig (its
    ``run_dir`` complete) of the tiny model with those overrides, trained once per session.
    Read it, never change it: a run's checkpoints record where its data lie, so a copy elsewhere
    would not resume; a test that changes a run trains its own (``runs.train_in_workers``)."""
    base = tmp_path_factory.getbasetemp()
    # pytest-xdist gives each worker a basetemp of its own below one the workers share
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return TrainedRuns(shared / "trained-runs")


# ------------------------------------------------------------------ the order files start in
# `make test` hands whole files to its two pytest workers (--dist loadfile) in collection order,
# the next file to whichever worker is free. A long file started last leaves one worker alone at
# the end, so the files that take a minute or more (real processes, SLURM, network namespaces,
# the documentation's commands) start first, longest first as last measured; the rest follow in
# their usual order. Only the order changes: a file missing here, or a stale entry, costs
# balance, never a test.
LONGEST_FIRST = (
    "test_readme.py", "test_sweeps.py", "test_wan.py", "test_train.py", "test_lost_peers.py",
    "test_table1_tiny.py", "test_nodes.py", "test_resume.py", "test_block_topk.py", "test_stop_signals.py",
    "test_nodes_slurm.py", "test_registry.py", "test_exit_lines.py", "test_launch_slurm.py", "test_senders.py",
    "test_replica_groups.py", "test_stragglers.py", "test_churn.py", "test_torchrun.py", "test_streaming_diloco.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file, as written


@pytest.fixture
def forked_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch_local``, as the sweep driver and the quickstart call it, trains in forked ranks
    (``runs.train_in_workers``): the drivers, the runs they train and the reports they write are
    real; only each rank's interpreter start-up is left out. A run that diverges ends as the
    launcher ends it (``WorkerFailure`` with the worker's EXIT_DIVERGED); a finished one goes to
    the real launcher, which says so. For tests of the drivers, not of the launcher."""
    from lowcomm.cli import quickstart
    from lowcomm.launch import local
    from lowcomm.rundir import RunDir
    from lowcomm.train.loop import EXIT_DIVERGED
    from runs import train_in_workers

    launcher = local.launch_local

    def launch(run: Any, **kwargs: Any) -> Path:
        if RunDir(run.run_dir).read_summary() is not None:
            return launcher(run, **kwargs)
        train_in_workers(run)
        if RunDir(run.run_dir).read_summary().get("diverged"):
            raise local.WorkerFailure(0, EXIT_DIVERGED, run_dir=run.run_dir)
        return run.run_dir

    monkeypatch.setattr(local, "launch_local", launch)
    monkeypatch.setattr(quickstart, "launch_local", launch)
