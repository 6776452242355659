"""lowcomm.launch.slurm: cluster profile -> submitit executor, and rank discovery inside a task.

The first tests need no SLURM (profile validation and translation); the ``slurm`` ones submit to
the local cluster and check what the tasks actually saw, including a preemption and requeue.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from lowcomm.comm.spawn import spawn_workers
from lowcomm.config import ClusterSpec
from lowcomm.data import materialize
from lowcomm.distenv import gpu_for_local_rank, job_port
from lowcomm.launch.slurm import (
    PreemptionFlag,
    make_executor,
    setup_distributed_from_slurm,
    slurm_profile,
    submitit_parameters,
)
from lowcomm.launch.slurm_probe import RequeueProbe, distributed_env_probe
from runs import tiny_run

PROFILE_64_GPUS = {
    "nodes": 8,
    "tasks_per_node": 8,
    "gpus_per_node": 8,
    "cpus_per_task": 12,
    "mem_gb": 480,
    "timeout_min": 1440,
    "partition": "gpu",
    "account": "lowcomm",
    "qos": None,
    "signal": "SIGUSR2",
    "signal_delay_s": 180,
    "max_requeues": 5,
    "setup": ["module load cuda/12.4"],
    "additional_parameters": {"exclusive": True},
}

# Two CPU tasks on the local cluster's single node, partition left to the environment.
LOCAL_PROFILE = {"nodes": 1, "tasks_per_node": 2, "cpus_per_task": 1, "timeout_min": 5, "partition": None}


def test_profile_becomes_update_parameters():
    environ = {"LOWCOMM_SLURM_QOS": "high", "LOWCOMM_SLURM_PARTITION": "not-this-one"}

    parameters = submitit_parameters(PROFILE_64_GPUS, job_name="demo_1b", environ=environ)

    assert parameters == {
        "nodes": 8,
        "tasks_per_node": 8,
        "gpus_per_node": 8,
        "cpus_per_task": 12,
        "mem_gb": 480,
        "timeout_min": 1440,
        "name": "demo_1b",
        "slurm_partition": "gpu",  # the profile wins over the environment
        "slurm_account": "lowcomm",
        "slurm_qos": "high",  # unset in the profile: from the environment
        "slurm_signal_delay_s": 180,
        "slurm_additional_parameters": {"exclusive": True, "signal": "USR2@180"},
        "slurm_setup": ["export SUBMITIT_PREEMPT_SIGNAL=USR2", "module load cuda/12.4"],
    }


def test_unset_resources_are_left_to_the_cluster():
    parameters = submitit_parameters({"partition": None, "mem_gb": None, "gpus_per_node": 0}, environ={})

    for key in ("slurm_partition", "slurm_account", "slurm_qos", "mem_gb", "gpus_per_node", "name"):
        assert key not in parameters


def test_executor_carries_the_profile(tmp_path):
    executor = make_executor(tmp_path, PROFILE_64_GPUS, job_name="demo_1b", environ={})

    # SlurmExecutor's own names, i.e. what becomes the #SBATCH lines.
    sbatch = executor.parameters
    assert sbatch["nodes"] == 8
    assert sbatch["ntasks_per_node"] == 8
    assert sbatch["gpus_per_node"] == 8
    assert sbatch["cpus_per_task"] == 12
    assert sbatch["mem"] == "480GB"
    assert sbatch["time"] == 1440
    assert sbatch["partition"] == "gpu"
    assert sbatch["account"] == "lowcomm"
    assert "qos" not in sbatch
    assert sbatch["job_name"] == "demo_1b"
    assert sbatch["additional_parameters"] == {"exclusive": True, "signal": "USR2@180"}
    # Taken by the constructor, not by update_parameters; no public accessor.
    assert executor._executor.max_num_timeout == 5


def test_profile_accepts_hydra_containers():
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create(PROFILE_64_GPUS)

    assert slurm_profile(config) == slurm_profile(PROFILE_64_GPUS)
    assert slurm_profile(config).setup == ("module load cuda/12.4",)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"nodes": 0}, "cluster.nodes"),
        ({"tasks_per_node": 2.0}, "cluster.tasks_per_node"),
        ({"cpus_per_task": True}, "cluster.cpus_per_task"),
        ({"tasks_per_node": 4}, "must equal cluster.gpus_per_node"),
        ({"signal_delay_s": 1440 * 60}, "shorter than the time limit"),
        ({"signal": "TERM"}, "catchable signal"),
        ({"signal": "USR3"}, "catchable signal"),
        ({"mem_gb": -1}, "cluster.mem_gb"),
        ({"partition": ""}, "cluster.partition"),
        ({"setup": "module load cuda"}, "cluster.setup"),
        ({"additional_parameters": {"signal": "USR1@60"}}, "not additional_parameters.signal"),
    ],
)
def test_invalid_profiles_are_rejected_by_key(override, message):
    with pytest.raises(ValueError, match=message):
        slurm_profile({**PROFILE_64_GPUS, **override})


def test_cluster_spec_is_read_for_its_slurm_fields():
    cluster = ClusterSpec(launcher="slurm", nodes=2, tasks_per_node=4, gpus_per_node=4, mem_gb=0)

    profile = slurm_profile(cluster)

    assert (profile.nodes, profile.tasks_per_node, profile.gpus_per_node) == (2, 4, 4)
    # 0 is SLURM's "all the memory of the node", passed on as such.
    assert submitit_parameters(cluster, environ={})["mem_gb"] == 0


def test_a_torchft_runs_groups_are_one_node_jobs_of_an_array_requeued_apart_and_its_lighthouse_one_cpu(tmp_path):
    from lowcomm.config import validate
    from lowcomm.config.compose import compose
    from lowcomm.launch.slurm import batch_script, lighthouse_shape, replica_group_shape
    from runs import TINY

    run = validate(compose([*TINY, f"run_root={tmp_path}", "optimizer=diloco", "cluster=slurm_local_2node",
                            "cluster.fault_tolerance=torchft", "cluster.ranks_per_group=2",
                            "+cluster.additional_parameters.constraint=fast"]))
    script = batch_script(run).splitlines()
    # one element per node's group, each the node's 2 ranks; SLURM requeues an element whose node
    # fails, and starts the elements once the lighthouse job has
    for line in ("#SBATCH --array=0-1%2", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --requeue",
                 "#SBATCH --constraint=fast", "#SBATCH --dependency='after:<lighthouse job>'",
                 "#SBATCH --kill-on-invalid-dep=yes"):
        assert line in script, line
    group = submitit_parameters(run.cluster, environ={}, shape=replica_group_shape(run.cluster, "7"))
    assert (group["nodes"], group["tasks_per_node"], group["timeout_min"]) == (1, 2, 30)
    assert group["slurm_additional_parameters"]["dependency"] == "after:7"
    lighthouse = submitit_parameters(run.cluster, environ={"LOWCOMM_SLURM_PARTITION": "cpu"},
                                     shape=lighthouse_shape(run.cluster))
    # one CPU task, none of the profile's extra options (which may ask for GPUs), for as long as a
    # group's job may be requeued for: 30 min x (1 + max_requeues=1)
    assert (lighthouse["nodes"], lighthouse["tasks_per_node"], lighthouse["cpus_per_task"]) == (1, 1, 1)
    assert "gpus_per_node" not in lighthouse and lighthouse["mem_gb"] == 2 and lighthouse["timeout_min"] == 60
    assert lighthouse["slurm_additional_parameters"] == {"signal": "USR2@60"}
    assert lighthouse["slurm_partition"] == "cpu"
    # the run's own checks hold for the run (2 nodes), not for the one-node shapes
    with pytest.raises(ValueError, match=r"cluster.min_replicas \(3\) is more than the run's replica groups \(2"):
        validate(compose([*TINY, f"run_root={tmp_path}", "optimizer=diloco", "cluster=slurm_local_2node",
                          "cluster.fault_tolerance=torchft", "cluster.ranks_per_group=2", "cluster.min_replicas=3"]))


def test_a_job_arrays_id_finds_its_elements_in_the_queue_before_a_job_of_the_runs_name():
    from lowcomm.launch.slurm import Queue, QueuedJob

    pending = Queue((QueuedJob("41_[0-1%2]", "ft-run", "PENDING"), QueuedJob("40", "ft-run", "RUNNING"),
                     QueuedJob("410", "other", "RUNNING")))
    # the array's pending elements, not its lighthouse job (40, the run's name too), running
    assert pending.find(job_id="41", name="ft-run").job_id == "41_[0-1%2]"
    assert pending.find(job_id="4") is None  # 41's elements are not 4's, nor is 410
    ended = Queue((QueuedJob("41_0", "ft-run", "FAILED"), QueuedJob("41_1", "ft-run", "FAILED"),
                   QueuedJob("40", "ft-run", "RUNNING")))
    assert ended.find(job_id="41", name="ft-run", besides="40").state == "FAILED"  # not "running" as job 40
    assert ended.find(job_id="39", name="ft-run").job_id == "40"  # another submission of the run: by its name


def test_world_size():
    assert slurm_profile({**PROFILE_64_GPUS, "setup": ()}).world_size == 64


@pytest.mark.parametrize(
    ("allocated", "local_rank", "local_world_size", "expected"),
    [
        (None, 3, 8, "3"),  # GPUs not managed by SLURM: node-wide numbering
        ("4,5,6,7", 2, 4, "6"),  # half a node without device cgroups
        ("0,1,2,3,4,5,6,7", 7, 8, "7"),
        ("5", 0, 1, "5"),  # already bound to one GPU
        ("", 1, 2, ""),  # no GPU at all
    ],
)
def test_each_rank_sees_its_own_gpu(allocated, local_rank, local_world_size, expected):
    assert gpu_for_local_rank(allocated, local_rank, local_world_size) == expected


def test_gpu_list_that_does_not_match_the_ranks_is_an_error():
    with pytest.raises(RuntimeError, match="one rank per GPU"):
        gpu_for_local_rank("0,1,2,3", 0, 2)


def test_setup_outside_a_job_raises():
    with pytest.raises(RuntimeError):
        setup_distributed_from_slurm()


@pytest.mark.slow
def test_setup_distributed_inside_local_submitit_tasks(tmp_path, monkeypatch):
    # submitit's local executor: the same task-side code path, no SLURM needed.
    monkeypatch.setenv("RANK", "99")
    executor = make_executor(tmp_path, LOCAL_PROFILE, cluster="local")

    results = executor.submit(distributed_env_probe).results()

    assert [seen["returned"] for seen in results] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert [seen["environ"]["RANK"] for seen in results] == ["0", "1"]
    # The local executor hides GPUs when none are requested; an empty list stays empty.
    assert [seen["cuda_visible_devices"] for seen in results] == ["", ""]


@pytest.mark.slow
@pytest.mark.slurm
def test_setup_distributed_inside_slurm_tasks(slurm_results, tmp_path, monkeypatch):
    # sbatch hands the submitting environment to the job: stale torchrun variables must be
    # replaced, and a GPU list (what SLURM sets for a GPU job) must be split between the ranks.
    monkeypatch.setenv("LOWCOMM_SLURM_PARTITION", "debug")
    monkeypatch.setenv("RANK", "99")
    monkeypatch.setenv("WORLD_SIZE", "99")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    executor = make_executor(tmp_path / "%j", LOCAL_PROFILE, job_name="env_probe")

    job = executor.submit(distributed_env_probe)
    results = slurm_results(job)

    assert "#SBATCH --partition=debug" in job.paths.submission_file.read_text()
    for task_id, seen in enumerate(results):
        assert seen["slurm_procid"] == seen["slurm_localid"] == str(task_id)
        assert seen["returned"] == (task_id, 2, task_id, 2)  # rank, world, local rank, local world
        environ = seen["environ"]
        assert environ["RANK"] == str(task_id)
        assert environ["WORLD_SIZE"] == "2"
        assert environ["LOCAL_RANK"] == str(task_id)
        assert environ["LOCAL_WORLD_SIZE"] == "2"
        assert environ["MASTER_ADDR"] == socket.gethostname().split(".")[0]
        assert seen["cuda_visible_devices"] == ["4", "5"][task_id]
    assert results[0]["environ"]["MASTER_PORT"] == results[1]["environ"]["MASTER_PORT"] == str(job_port(job.job_id))


def test_a_jobs_rendezvous_port_is_its_own_and_below_the_ephemeral_ports():
    ports = [job_port(str(job_id)) for job_id in (38089000, 38089001, 55175001, 1)]
    assert len(set(ports)) == 4 and all(20000 <= port < 32768 for port in ports)
    assert job_port("38089000") == job_port("38089000")  # every task of a job derives the same


def _wait_for_files(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            pytest.fail(f"the job did not start within {timeout_s}s: missing {paths}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.slurm
def test_preempted_job_is_requeued_under_the_profile_signal(slurm_results, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    # USR1 rather than submitit's default USR2: the sbatch --signal and the handler must agree.
    profile = {**LOCAL_PROFILE, "partition": "debug", "signal": "USR1", "signal_delay_s": 30}
    job = make_executor(tmp_path / "%j", profile).submit(RequeueProbe(str(markers)))
    # Every task has installed submitit's handler once it runs the probe.
    _wait_for_files([markers / "started_0_0", markers / "started_0_1"], timeout_s=120)

    # What SLURM does signal_delay_s before a preemption kill (`--signal` without `B:`).
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True)
    results = slurm_results(job, timeout_s=150)

    assert [result["procid"] for result in results] == [0, 1]
    for result in results:
        assert result["job_id"] == job.job_id  # requeued, not resubmitted
        assert result["restart_count"] == 1
        assert result["preempt_signal"] == "USR1"


# ---------------------------------------------------------------- preemption inside the training loop


class _SignalOnRank:
    """``should_stop`` for a test: on ``rank`` it sends itself the preemption signal at its
    ``at``-th call (a step boundary), then reads the PreemptionFlag like a SLURM task does."""

    def __init__(self, flag: PreemptionFlag, rank: int, signalled_rank: int, at: int):
        self.flag, self.rank, self.signalled_rank, self.at, self.calls = flag, rank, signalled_rank, at, 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.rank == self.signalled_rank and self.calls == self.at:
            os.kill(os.getpid(), signal.SIGUSR2)
        return self.flag()


def _fit_with_signals(rank: int, world_size: int, cases: list) -> list[tuple[bool, int, bool]]:
    """Each (run, signal_at) trained in turn by this rank: (preempted, final step, flag seen here)."""
    from lowcomm.distenv import DistEnv
    from lowcomm.train.loop import Trainer

    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    outcomes = []
    for run, signal_at in cases:
        flag = PreemptionFlag.install("USR2")
        should_stop = _SignalOnRank(flag, rank, signalled_rank=1, at=signal_at)
        result = Trainer(run, env, should_stop=should_stop).fit()
        outcomes.append((result.preempted, result.final_step, flag()))
    return outcomes


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_that_step_boundary_with_a_checkpoint(tmp_path):
    # Two runs in the same two workers (spawning them dominates the time): signalled at step 3
    # of 8, and at the last step of 4.
    mid_run = tiny_run(tmp_path / "mid", "train.checkpoint_every=0", workers=2, max_steps=8)
    last_step = tiny_run(tmp_path / "last", "train.checkpoint_every=0", workers=2, max_steps=4)
    for run in (mid_run, last_step):
        materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)

    per_rank = spawn_workers(_fit_with_signals, 2, [(mid_run, 3), (last_step, 4)])

    (mid_0, last_0), (mid_1, last_1) = per_rank
    # rank 0 never saw the signal, yet stops with rank 1 after the third step and both checkpoint
    assert (mid_0, mid_1) == ((True, 3, False), (True, 3, True))
    assert [path.name for path in (mid_run.run_dir / "checkpoints").iterdir()] == ["step_000000003"]
    assert not (mid_run.run_dir / "summary.json").exists()  # unfinished: the requeued job completes it
    # at the last step there is nothing left to stop: the run finishes and writes its summary
    assert (last_0[:2], last_1[:2]) == ((False, 4), (False, 4))
    assert (last_step.run_dir / "summary.json").is_file()
