"""Submitting training runs to SLURM through submitit (on the submitting machine)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError

from lowcomm.comm.ft import FT_RECORD
from lowcomm.config import ClusterSpec, ConfigError, RunConfig, slurm_profile
from lowcomm.launch.estimate import plan_job
from lowcomm.launch.local import prepare_run_dir
from lowcomm.launch.slurm.job import LighthouseJob, TrainingJob
from lowcomm.launch.slurm.queue import Queue, RunState, SlurmUnavailable, run_state
from lowcomm.rundir import SUBMISSIONS_FILE, RunDir

# Where partition, account and qos come from when the profile leaves them unset (None): these
# differ per user and per cluster, so they do not belong in a versioned config file.
ENVIRONMENT_DEFAULTS = {
    "partition": "LOWCOMM_SLURM_PARTITION",
    "account": "LOWCOMM_SLURM_ACCOUNT",
    "qos": "LOWCOMM_SLURM_QOS",
}


def submitit_parameters(
    profile: Any,
    *,
    job_name: str | None = None,
    environ: Mapping[str, str] | None = None,
    shape: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``submitit.AutoExecutor.update_parameters`` describing ``profile``
    (anything :func:`slurm_profile` accepts).

    ``max_requeues`` is not among them: submitit takes it when the executor is built
    (``AutoExecutor(folder, slurm_max_num_timeout=...)``); :func:`make_executor` does both.
    ``environ`` (default ``os.environ``) supplies partition/account/qos the profile leaves unset.
    ``shape``: profile fields this job has otherwise than the run (a replica group's job, the
    lighthouse's: :func:`replica_group_shape`), set once the run's profile is checked.
    """
    profile = dataclasses.replace(slurm_profile(profile), **(shape or {}))
    environ = os.environ if environ is None else environ
    parameters: dict[str, Any] = {
        "nodes": profile.nodes,
        "tasks_per_node": profile.tasks_per_node,
        "cpus_per_task": profile.cpus_per_task,
        "timeout_min": profile.timeout_min,
        "slurm_signal_delay_s": profile.signal_delay_s,
        # submitit writes `--signal=<its signal>@<delay>` and the task's handler listens for
        # $SUBMITIT_PREEMPT_SIGNAL (USR2 by default); set both so they always agree.
        "slurm_additional_parameters": {
            **profile.additional_parameters,
            "signal": f"{profile.signal}@{profile.signal_delay_s}",
        },
        "slurm_setup": [f"export SUBMITIT_PREEMPT_SIGNAL={profile.signal}", *profile.setup],
    }
    if profile.gpus_per_node:
        parameters["gpus_per_node"] = profile.gpus_per_node
    if profile.mem_gb is not None:
        parameters["mem_gb"] = profile.mem_gb
    if job_name is not None:
        parameters["name"] = job_name
    for key, variable in ENVIRONMENT_DEFAULTS.items():
        value = getattr(profile, key) or environ.get(variable) or None
        if value is not None:
            parameters[f"slurm_{key}"] = value
    return parameters


def make_executor(
    folder: str | Path,
    profile: Any,
    *,
    job_name: str | None = None,
    environ: Mapping[str, str] | None = None,
    cluster: str = "slurm",
    shape: Mapping[str, Any] | None = None,
) -> submitit.AutoExecutor:
    """A submitit executor writing its job files and logs under ``folder``, set up for ``profile``.

    ``cluster="local"`` runs the same job as local processes (submitit's LocalExecutor), useful
    to exercise a launcher without SLURM; the ``slurm_*`` parameters are then ignored.
    """
    profile = slurm_profile(profile)
    executor = submitit.AutoExecutor(
        folder=folder, cluster=cluster, slurm_max_num_timeout=profile.max_requeues
    )
    parameters = submitit_parameters(profile, job_name=job_name, environ=environ, shape=shape)
    if cluster != "slurm":
        parameters = {key: value for key, value in parameters.items() if not key.startswith("slurm_")}
    executor.update_parameters(**parameters)
    return executor


class _ScriptRenderer(submitit.SlurmExecutor):
    """submitit's SLURM executor, used only to render a job's batch file: it needs no ``srun`` on
    this machine (a laptop shows what a login node would submit) and never submits."""

    @classmethod
    def affinity(cls) -> int:
        return 1


def batch_script(run: RunConfig, *, environ: Mapping[str, str] | None = None) -> str:
    """The batch file ``sbatch`` would get for ``run`` from :func:`submit_training` (its
    ``#SBATCH`` lines, the setup and the ``srun`` line that starts every task), rendered by
    submitit's own code from the parameters :func:`make_executor` gives it. Writes nothing."""
    check_profile(run)
    run = _with_absolute_run_root(run)
    groups = run.cluster.fault_tolerance == "torchft"
    # (the lighthouse's job id is known once it is submitted)
    parameters = submitit_parameters(run.cluster, job_name=run.run_name, environ=environ,
                                     shape=replica_group_shape(run.cluster, "<lighthouse job>") if groups else None)
    executor = _ScriptRenderer(RunDir(run.run_dir).slurm_dir, max_num_timeout=run.cluster.max_requeues)
    # what AutoExecutor does with them: the generic names in SLURM's words (timeout_min -> time,
    # mem_gb -> mem, ...), the slurm_ ones as they are
    generic = {key: value for key, value in parameters.items() if not key.startswith("slurm_")}
    specific = {key.removeprefix("slurm_"): value for key, value in parameters.items() if key.startswith("slurm_")}
    executor.update_parameters(**executor._convert_parameters(generic), **specific)  # noqa: SLF001
    if groups:  # what executor.batch() adds: one element per replica group
        executor.parameters["map_count"] = run.cluster.replica_groups
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")  # noqa: SLF001


def replica_group_shape(cluster: ClusterSpec, lighthouse_job: str) -> dict[str, Any]:
    """Under ``cluster.fault_tolerance=torchft``, the job of one replica group: one node of the
    run's, requeued by SLURM when that node fails (``--requeue``), apart from the other groups,
    started once the lighthouse job has (``--dependency=after:``; cancelled if it never can)."""
    return {"nodes": 1, "additional_parameters": {
        "requeue": True, "dependency": f"after:{lighthouse_job}", "kill_on_invalid_dep": "yes",
        **cluster.additional_parameters}}


# The lighthouse job's memory: a Python process and torchft's server (a partition's default may be
# a whole node's where memory is a consumable resource)
LIGHTHOUSE_MEM_GB = 2


def lighthouse_shape(cluster: ClusterSpec) -> dict[str, Any]:
    """The lighthouse job of a run whose replica groups are jobs: one task, one CPU, no GPU (nor
    the profile's additional options, which may ask for them), in the run's partition, account
    and qos, for ``timeout_min`` x (1 + ``max_requeues``): as long as the groups' time-out
    requeues take, if none of them waits in the queue (a preemption's or a lost node's requeue
    may outlast it)."""
    return {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1, "gpus_per_node": 0, "mem_gb": LIGHTHOUSE_MEM_GB,
            "timeout_min": cluster.timeout_min * (1 + cluster.max_requeues), "additional_parameters": {}}


def srun_line(script: str) -> str:
    """The line of a batch script that starts the tasks."""
    return next(line for line in script.splitlines() if line.startswith("srun "))


@dataclasses.dataclass(frozen=True)
class Submission:
    """What :func:`submit_training` did with a run: ``submitted`` it, or left it (``skipped``)."""

    run_dir: Path
    action: str  # submitted | skipped
    state: RunState  # the run's state before (skipped: why)
    job_id: str | None  # under cluster.fault_tolerance=torchft: the replica groups' job array
    log_dir: Path
    lighthouse_job: str | None = None  # their lighthouse's job

    def describe(self) -> str:
        if self.action == "submitted":
            resumed = (f", resumes from its latest checkpoint (last logged step {self.state.last_step})"
                       if self.state.last_step else "")
            if self.lighthouse_job is not None:
                return (f"submitted job array {self.job_id} (a replica group each) and its lighthouse job "
                        f"{self.lighthouse_job}{resumed}; logs: {self.log_dir}/{self.job_id}_<group>_<task>_log."
                        f"{{out,err}}")
            return (f"submitted job {self.job_id}{resumed}; logs: "
                    f"{self.log_dir}/{self.job_id}_<task>_log.{{out,err}}")
        job = f" (job {self.state.job_id})" if self.state.job_id else ""
        return f"skipped: {self.state.status}{job}"


def check_profile(run: RunConfig) -> None:
    """Raise ConfigError when ``run``'s cluster is not a valid SLURM profile."""
    if run.cluster.launcher != "slurm":
        raise ConfigError([f"cluster.launcher={run.cluster.launcher!r}: submitting needs a SLURM profile "
                           "(cluster=slurm_debug, cluster=slurm_64gpu or one of your own)"])
    slurm_profile(run.cluster)  # raises ConfigError naming every bad key


def _with_absolute_run_root(run: RunConfig) -> RunConfig:
    # The job reads config.yaml wherever it starts; run_root is not part of the run name.
    run_root = str(Path(run.run_root).resolve())
    return dataclasses.replace(run, run_root=run_root, raw={**run.raw, "run_root": run_root})


def submit_training(
    run: RunConfig, *, queue: Queue | None = None, environ: Mapping[str, str] | None = None
) -> Submission:
    """Submit ``run`` (validated) as one SLURM job unless it is done or already queued.

    Before submitting: materialise the data (the synthetic corpus is generated here, once) and
    write ``<run_dir>/config.yaml``, which every task reads. The job is named after the run
    (so ``squeue --name`` finds it); submitit's files and the task logs go to
    ``<run_dir>/slurm/``, where the job id is also recorded. A run with checkpoints resumes.
    ``queue`` (default: read now) is the listing used to find an already queued job.
    """
    check_profile(run)
    run = _with_absolute_run_root(run)
    log_dir = RunDir(run.run_dir).slurm_dir
    state = run_state(run.run_dir, run.run_name, queue if queue is not None else Queue.read())
    if state.status == "done" or state.active:
        return Submission(run.run_dir, "skipped", state, state.job_id, log_dir)
    config_path = prepare_run_dir(run)
    try:
        if run.cluster.fault_tolerance == "torchft":
            job_id, jobs = _submit_replica_groups(run, config_path, log_dir, environ)
        else:
            executor = make_executor(log_dir, run.cluster, job_name=run.run_name, environ=environ)
            job_id, jobs = executor.submit(TrainingJob(str(config_path))).job_id, {}
    except (FailedJobError, OSError) as exc:
        raise SlurmUnavailable(f"sbatch failed for {run.run_name}: {exc}") from exc
    record = {
        "job_id": job_id,
        **jobs,
        "submitted_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "job_name": run.run_name,
        "nodes": run.cluster.nodes,
        "tasks_per_node": run.cluster.tasks_per_node,
        "gpus_per_node": run.cluster.gpus_per_node,
        "last_logged_step": state.last_step,
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / SUBMISSIONS_FILE).open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    return Submission(run.run_dir, "submitted", state, job_id, log_dir, jobs.get("lighthouse_job"))


def _submit_replica_groups(run: RunConfig, config_path: Path, log_dir: Path,
                           environ: Mapping[str, str] | None) -> tuple[str, dict[str, Any]]:
    """``cluster.fault_tolerance=torchft``: the run's lighthouse as a job of its own, then its
    replica groups as one job array (a node each, requeued apart), which starts once the
    lighthouse has. Returns (the array's id, what the submission record adds). The old record
    of a lighthouse goes first: the groups wait for the new one. Where the array cannot be
    submitted, the lighthouse is cancelled."""
    (Path(run.run_dir) / FT_RECORD).unlink(missing_ok=True)
    lighthouse = make_executor(log_dir, run.cluster, job_name=run.run_name, environ=environ,
                               shape=lighthouse_shape(run.cluster))
    beacon = lighthouse.submit(LighthouseJob(str(config_path), run.run_name)).job_id
    try:
        groups = make_executor(log_dir, run.cluster, job_name=run.run_name, environ=environ,
                               shape=replica_group_shape(run.cluster, beacon))
        with groups.batch():
            elements = [groups.submit(TrainingJob(str(config_path), replica_group=group))
                        for group in range(run.cluster.replica_groups)]
    except BaseException:
        subprocess.run(["scancel", beacon], capture_output=True, check=False, timeout=60)
        raise
    array = elements[0].job_id.split("_", 1)[0]
    return array, {"replica_group_jobs": [element.job_id for element in elements], "lighthouse_job": beacon}


def submit_run(run: RunConfig) -> Path:
    """``lowcomm-train`` with a SLURM cluster profile: submit ``run`` asking for the time its size
    needs (:func:`~lowcomm.launch.estimate.plan_job`), say where it went and what it asked for,
    return its run directory (without waiting for the job)."""
    plan = plan_job(run)
    submission = submit_training(plan.run)
    print(f"[lowcomm] {run.run_name}: {submission.describe()}", flush=True)
    if submission.action == "submitted":
        print(f"[lowcomm] time limit {plan.describe_time()}", flush=True)
        print(f"[lowcomm] watch it: squeue --name={run.run_name}  (metrics: {RunDir(submission.run_dir).metrics})",
              flush=True)
    return submission.run_dir
