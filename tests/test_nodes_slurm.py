"""SLURM across two nodes on one machine: a slurmd in each node's network namespace under its
own hostname, the controller on the host (``two_node_slurm`` in conftest.py, built on
slurm/local_slurm.sh and benchmarks/netns.py). ``lowcomm-train cluster=slurm_local_2node``
submits a ``--nodes=2`` job through submitit: 2 ranks per node rendezvous at the first node's
hostname, train, are preempted with USR2, requeued under the same job id and resume to end bit
for bit where an uninterrupted job ends. Under ``cluster.fault_tolerance=torchft`` each node's
replica group is a job of its own, requeued alone when its node goes down, and heals on return."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from runs import (
    SMALL_SYNTHETIC,
    TINY,
    preempted_run_ends_like_an_uninterrupted_one,
    slurm_job_id,
    slurm_logs,
    train_losses,
)

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

STEPS = 30
# long enough that the surviving group still trains when the other is back: both compute 10x
# slower (sleeping, lowcomm.train.slowdown), ~0.15 s a step here (40 s in all) against ~20 s
# to requeue and start
FT_STEPS = 260


def test_a_two_node_diloco_job_is_preempted_requeued_and_ends_bit_identical(two_node_slurm, tmp_path):
    """DiLoCo's workers differ between synchronisations (H=7, preempted mid-period): the
    preemption checkpoint must hold every rank's own state, on both nodes, for the requeued job
    to end exactly where an uninterrupted one does. (The one SLURM preemption test of a method
    with per-rank state: test_sweeps' preempts AdamW-DDP on one node.)"""
    nodes, _conf = two_node_slurm
    diloco = [*TINY, *SMALL_SYNTHETIC, "cluster=slurm_local_2node", f"train.max_steps={STEPS}",
              "train.checkpoint_every=0", "optimizer=diloco", "optimizer.lr=0.003", "optimizer.sync_every=7"]
    run_dir = preempted_run_ends_like_an_uninterrupted_one(diloco, tmp_path, steps=STEPS, ranks=4)
    job_id = slurm_job_id(run_dir)
    # every task started twice under the same job id (requeued, not resubmitted), ranks 0-1 on
    # the first node and 2-3 on the second
    for task, node in ((0, 0), (1, 0), (2, 1), (3, 1)):
        log = (run_dir / "slurm" / f"{job_id}_{task}_log.out").read_text()
        started = re.findall(r"Starting with JobEnvironment\(job_id=(\d+), hostname=([\w-]+), local_rank=(\d)\(2\), "
                             r"node=(\d)\(2\), global_rank=(\d)\(4\)\)", log)
        assert started == [(job_id, nodes[node].hostname, str(task % 2), str(node), str(task))] * 2, log[-3000:]


def _job_field(job_id: str, field: str) -> str:
    """One squeue field (``%T`` the state, ``%N`` the nodes) of one job or array element."""
    return subprocess.run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", f"--format={field}"],
                          capture_output=True, text=True, check=False).stdout.strip()


def _resumed(hostname: str) -> bool:
    subprocess.run(["scontrol", "update", f"nodename={hostname}", "state=resume"], capture_output=True, check=False)
    shown = subprocess.run(["sinfo", "--noheader", "--nodes", hostname, "--format=%T"], capture_output=True,
                           text=True, check=False).stdout
    return bool(shown.strip()) and "down" not in shown.lower()


def _until(condition, what: str, run_dir: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f} s:\n{slurm_logs(run_dir)}", pytrace=False)
        time.sleep(0.2)


def _events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [record for record in records if record.get("event") == kind]


def test_replica_groups_are_jobs_of_their_own_and_a_downed_nodes_group_is_requeued_alone_and_heals(
        two_node_slurm, tmp_path):
    """cluster.fault_tolerance=torchft under SLURM: the two groups are the elements of one job
    array (a node each) and their lighthouse a job of its own. The node of the group the
    lighthouse does not share is taken down (SLURM kills its job there and requeues it, as on a
    node failure); the other group never stops, and the requeued group resumes, heals from it
    at an exchange and both end on the same model."""
    from lowcomm.cli.train import run_config
    from lowcomm.config.compose import compose
    from lowcomm.train.replicas import replica_run_dir

    nodes, _conf = two_node_slurm
    run_dir = run_config(compose([
        *TINY, *SMALL_SYNTHETIC, "cluster=slurm_local_2node", "cluster.tasks_per_node=1", "cluster.ranks_per_group=1",
        "cluster.fault_tolerance=torchft", "optimizer=diloco", "optimizer.sync_every=5", "compression=none",
        "cluster.slow_ranks=[0,1]", "cluster.slowdown=10", f"train.max_steps={FT_STEPS}", "train.checkpoint_every=5",
        "train.eval_every=0", f"run_root={tmp_path}"]))
    record = json.loads(next(reversed((run_dir / "slurm" / "submissions.jsonl").read_text().splitlines())))
    groups, lighthouse = record["replica_group_jobs"], record["lighthouse_job"]
    assert groups == [f"{record['job_id']}_{group}" for group in (0, 1)]
    group_dirs = [replica_run_dir(run_dir, group) for group in (0, 1)]
    try:
        _until(lambda: (run_dir / "torchft.json").is_file(), "the lighthouse job recorded no address", run_dir)
        _until(lambda: all(_job_field(job, "%T") == "RUNNING" for job in (*groups, lighthouse)),
               "the groups and the lighthouse did not all run", run_dir)
        where = {job: _job_field(job, "%N") for job in (*groups, lighthouse)}
        hostnames = {node.hostname for node in nodes}
        assert where[groups[0]] != where[groups[1]] and set(where.values()) <= hostnames, where  # a node each
        assert json.loads((run_dir / "torchft.json").read_text())["lighthouse"].startswith(
            f"http://{where[lighthouse]}:")
        lost = next(group for group in (0, 1) if where[groups[group]] != where[lighthouse])
        survivor = 1 - lost
        _until(lambda: len(train_losses(group_dirs[lost])) >= 12 if (group_dirs[lost] / "metrics.jsonl").is_file()
               else False, "the group to lose did not train", run_dir)
        subprocess.run(["scontrol", "update", f"nodename={where[groups[lost]]}", "state=down", "reason=lowcomm-test"],
                       check=True)
        _until(lambda: _job_field(groups[lost], "%T") != "RUNNING", "the downed node's group kept running", run_dir)
        down_at = train_losses(group_dirs[survivor])[-1][0]
        # back once SLURM lets it be (not while the killed job is still completing there), or by
        # itself (ReturnToService=2: its slurmd registers again)
        _until(lambda: _resumed(where[groups[lost]]), "the downed node did not come back", run_dir, 60)
        _until(lambda: all((path / "summary.json").is_file() for path in group_dirs), "the groups did not finish",
               run_dir, timeout_s=240)
        _until(lambda: _job_field(lighthouse, "%T") == "COMPLETED", "the lighthouse job did not end", run_dir, 60)
        assert not (run_dir / "torchft.json").exists()  # its record went with it
    finally:
        subprocess.run(["scancel", record["job_id"], lighthouse], check=False)
        for node in nodes:
            subprocess.run(["scontrol", "update", f"nodename={node.hostname}", "state=resume"], check=False,
                           capture_output=True)
    logs = [(run_dir / "slurm" / f"{groups[group]}_0_log.out").read_text() for group in (0, 1)]
    assert logs[survivor].count("Starting with JobEnvironment") == 1, logs[survivor]  # never stopped
    assert logs[lost].count("Starting with JobEnvironment") == 2, logs[lost]  # requeued under its id
    survivor_steps = [step for step, _ in train_losses(group_dirs[survivor])]
    assert survivor_steps == list(range(1, FT_STEPS + 1))  # every step once: never stopped, never resumed
    heals = _events(group_dirs[lost], "heal")
    assert len(heals) == 1 and heals[0]["bytes"] > 0 and heals[0]["step"] > down_at, heals
    # the survivor's quorum shrank to itself while the other group was down, and grew at its heal
    membership = _events(group_dirs[survivor], "membership")
    assert [(event["groups"], event["was"]) for event in membership] == [(1, 2), (2, 1)], membership
    assert membership[0]["step"] < membership[1]["step"] == heals[0]["step"]  # trained alone in between
    summaries = [json.loads((path / "summary.json").read_text()) for path in group_dirs]
    assert summaries[lost]["heal_rx_MB"] > 0 and summaries[survivor]["heal_tx_MB"] > 0
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]  # one model at the last outer step
