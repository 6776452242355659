"""SLURM across two nodes on one machine: a slurmd in each node's network namespace under its
own hostname, the controller on the host (``two_node_slurm`` in conftest.py, built on
slurm/local_slurm.sh and benchmarks/netns.py). ``lowcomm-train cluster=slurm_local_2node``
submits a ``--nodes=2`` job through submitit: 2 ranks per node rendezvous at the first node's
hostname, train, are preempted with USR2, requeued under the same job id and resume to end bit
for bit where an uninterrupted job ends."""

from __future__ import annotations

import re

import pytest

from runs import SMALL_SYNTHETIC, TINY, preempted_run_ends_like_an_uninterrupted_one, slurm_job_id

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

STEPS = 30


def test_a_two_node_diloco_job_is_preempted_requeued_and_ends_bit_identical(two_node_slurm, tmp_path):
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
