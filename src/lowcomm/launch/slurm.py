"""SLURM through submitit: cluster profiles, submission of training runs, rank discovery, preemption.

On the submitting machine:

- :func:`slurm_profile` validates a cluster profile (the SLURM fields of
  ``configs/cluster/*.yaml``), :func:`submitit_parameters` turns it into the keyword arguments
  of ``submitit.AutoExecutor.update_parameters`` and :func:`make_executor` builds the executor;
- :func:`submit_training` sends one validated run to SLURM as one job (``lowcomm-train
  cluster=slurm_64gpu ...`` goes through :func:`submit_run`; ``lowcomm-sweep`` submits a sweep,
  one job per point): it materialises the data and writes the run's ``config.yaml`` first, so
  the ranks never race to build them, and skips a run that is finished (``summary.json``) or
  already queued (a job named after the run, or the job id recorded in the run directory);
- :func:`run_state` says where a run stands (done / running / pending / failed / not submitted).

Inside every task of the job, :class:`TrainingJob` runs one lowcomm worker:
:func:`setup_distributed_from_slurm` exports the ``env://`` variables torch.distributed reads
(rank and world from SLURM; NCCL on GPUs, gloo otherwise, chosen by the training loop).

Why a thin launcher of our own rather than Hydra multirun with hydra-submitit-launcher: that
launcher runs the ``@hydra.main`` task function in every SLURM task, so every rank re-composes
the config and writes its own ``.hydra/`` output (racing on a shared filesystem), while lowcomm
composes and validates once, in the submitting process, before anything is submitted. Its
sweeps are one job array built from the command line, so a job cannot carry its run's name,
finished or queued runs cannot be skipped on resubmission, and an invalid point is only found
on the cluster. Its ``checkpoint()`` requeues from a signal handler on rank 0, which cannot
write a checkpoint all ranks take part in. Here a sweep is a file (``sweeps/``), each job is
named after its deterministic run name, and preemption is handled as below.

Preemption (and the time limit): SLURM sends ``signal`` (``--signal=USR2@<signal_delay_s>``,
without ``B:``, so every task gets it) ``signal_delay_s`` seconds before it stops the job.
submitit's own handler would checkpoint the callable and ``scontrol requeue`` the job right
there, on rank 0 only, while training goes on: everything since the last periodic checkpoint
would be lost, and a checkpoint cannot be written from a signal handler (all ranks write it
together). So :class:`TrainingJob` replaces that handler with one that only sets a flag
(:class:`PreemptionFlag`); the training loop reads it at every step boundary, the ranks agree
through one all-reduce, write a checkpoint together and return. Only then does rank 0 call the
submitit handler it displaced, which counts a time-out against ``max_requeues`` (preemptions
are requeued without limit), pickles the same callable (``checkpoint()``), requeues the job
(same job id) and exits; the other ranks exit without a result. The requeued job starts from
scratch and the training loop resumes from that checkpoint.
"""

from __future__ import annotations

import dataclasses
import datetime
import getpass
import json
import logging
import os
import shutil
import signal
import subprocess
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import submitit
from submitit.core.utils import FailedJobError

from lowcomm.config import ConfigError
from lowcomm.train.metrics import METRICS, read_metrics

if TYPE_CHECKING:
    from lowcomm.config import RunConfig

# Where partition, account and qos come from when the profile leaves them unset (None): these
# differ per user and per cluster, so they do not belong in a versioned config file.
ENVIRONMENT_DEFAULTS = {
    "partition": "LOWCOMM_SLURM_PARTITION",
    "account": "LOWCOMM_SLURM_ACCOUNT",
    "qos": "LOWCOMM_SLURM_QOS",
}

# submitit handles SIGTERM and SIGCONT itself (it ignores the TERM that precedes a preemption
# kill); KILL and STOP cannot be caught at all.
_UNUSABLE_SIGNALS = {"TERM", "CONT", "KILL", "STOP"}


@dataclasses.dataclass(frozen=True)
class SlurmProfile:
    """The SLURM resources of one training run; every field is a key of a cluster profile.

    ``tasks_per_node`` is the number of ranks per node (one per GPU when there are GPUs), not a
    number of sweep points. ``mem_gb`` None asks for the partition's default memory and 0 for
    all the memory of each node (SLURM's ``--mem=0``);
    ``partition``/``account``/``qos`` None mean "from $LOWCOMM_SLURM_PARTITION / _ACCOUNT /
    _QOS, else the cluster's default". ``signal`` (``USR2``; ``SIG`` prefix optional) is sent
    ``signal_delay_s`` seconds before a preemption or time-out kill. ``setup`` lines run in the
    batch script before ``srun`` (module loads, exports); ``additional_parameters`` are extra
    ``#SBATCH`` options (``{"exclusive": True, "constraint": "h100"}``).
    """

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float | None = None
    timeout_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    signal: str = "USR2"
    signal_delay_s: int = 120
    max_requeues: int = 3
    setup: tuple[str, ...] = ()
    additional_parameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("nodes", "tasks_per_node", "cpus_per_task", "timeout_min"):
            _require_int(key, getattr(self, key), minimum=1)
        for key in ("gpus_per_node", "signal_delay_s", "max_requeues"):
            _require_int(key, getattr(self, key), minimum=0)
        if self.mem_gb is not None and (
            isinstance(self.mem_gb, bool) or not isinstance(self.mem_gb, int | float) or self.mem_gb < 0
        ):
            raise ValueError(f"cluster.mem_gb must be a number >= 0 or null, got {self.mem_gb!r}")
        for key in ("partition", "account", "qos"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"cluster.{key} must be a non-empty string or null, got {value!r}")
        if self.gpus_per_node and self.tasks_per_node != self.gpus_per_node:
            # setup_distributed_from_slurm gives each rank exactly one GPU.
            raise ValueError(
                f"cluster.tasks_per_node ({self.tasks_per_node}) must equal cluster.gpus_per_node "
                f"({self.gpus_per_node}): lowcomm runs one rank per GPU"
            )
        if self.signal_delay_s >= self.timeout_min * 60:
            raise ValueError(
                f"cluster.signal_delay_s ({self.signal_delay_s}) must be shorter than the time limit "
                f"(cluster.timeout_min = {self.timeout_min} min)"
            )
        signal_name = self.signal.removeprefix("SIG") if isinstance(self.signal, str) else ""
        if not hasattr(signal, f"SIG{signal_name}") or signal_name in _UNUSABLE_SIGNALS:
            raise ValueError(f"cluster.signal must name a catchable signal such as USR2, got {self.signal!r}")
        object.__setattr__(self, "signal", signal_name)
        if (
            not isinstance(self.setup, Sequence)
            or isinstance(self.setup, str)
            or not all(isinstance(line, str) for line in self.setup)
        ):
            raise ValueError(f"cluster.setup must be a list of shell lines, got {self.setup!r}")
        object.__setattr__(self, "setup", tuple(self.setup))
        if not isinstance(self.additional_parameters, Mapping):
            raise ValueError(
                f"cluster.additional_parameters must map sbatch options to values, got {self.additional_parameters!r}"
            )
        if "signal" in self.additional_parameters:
            raise ValueError(
                "set cluster.signal and cluster.signal_delay_s, not additional_parameters.signal"
            )
        object.__setattr__(self, "additional_parameters", dict(self.additional_parameters))

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def _require_int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"cluster.{key} must be an integer >= {minimum}, got {value!r}")


def slurm_profile(cluster: Any) -> SlurmProfile:
    """The validated :class:`SlurmProfile` of a cluster config section.

    ``cluster`` is a SlurmProfile, a mapping (dict, Hydra DictConfig) or an object with
    attributes (``lowcomm.config.ClusterSpec``). Only the SlurmProfile fields are read; missing
    ones take their defaults. Other keys (``name``, ``launcher``, ``workers``, ...) belong to the
    rest of the launcher and are ignored here: the cluster config schema rejects unknown keys.
    """
    if isinstance(cluster, SlurmProfile):
        return cluster
    values = {}
    for field in dataclasses.fields(SlurmProfile):
        if isinstance(cluster, Mapping):
            if field.name in cluster:
                values[field.name] = cluster[field.name]
        elif hasattr(cluster, field.name):
            values[field.name] = getattr(cluster, field.name)
    # Hydra hands over ListConfig / DictConfig; make them plain containers.
    if isinstance(values.get("setup"), Sequence) and not isinstance(values["setup"], str):
        values["setup"] = tuple(values["setup"])
    if isinstance(values.get("additional_parameters"), Mapping):
        values["additional_parameters"] = dict(values["additional_parameters"])
    return SlurmProfile(**values)


def submitit_parameters(
    profile: Any,
    *,
    job_name: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``submitit.AutoExecutor.update_parameters`` describing ``profile``
    (anything :func:`slurm_profile` accepts).

    ``max_requeues`` is not among them: submitit takes it when the executor is built
    (``AutoExecutor(folder, slurm_max_num_timeout=...)``); :func:`make_executor` does both.
    ``environ`` (default ``os.environ``) supplies partition/account/qos the profile leaves unset.
    """
    profile = slurm_profile(profile)
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
) -> submitit.AutoExecutor:
    """A submitit executor writing its job files and logs under ``folder``, set up for ``profile``.

    ``cluster="local"`` runs the same job as local processes (submitit's LocalExecutor), useful
    to exercise a launcher without SLURM; the ``slurm_*`` parameters are then ignored.
    """
    profile = slurm_profile(profile)
    executor = submitit.AutoExecutor(
        folder=folder, cluster=cluster, slurm_max_num_timeout=profile.max_requeues
    )
    parameters = submitit_parameters(profile, job_name=job_name, environ=environ)
    if cluster != "slurm":
        parameters = {key: value for key, value in parameters.items() if not key.startswith("slurm_")}
    executor.update_parameters(**parameters)
    return executor


def setup_distributed_from_slurm() -> tuple[int, int, int, int]:
    """Inside a submitit task: export the ``env://`` variables and give this rank its GPU.

    Returns ``(rank, world_size, local_rank, local_world_size)``, the numbers that
    ``lowcomm.launch.env.DistEnv.from_environ()`` reads back afterwards.

    Sets MASTER_ADDR (the job's first node), MASTER_PORT (derived from the job id, or
    $MASTER_PORT when the job's environment sets it), RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE, replacing any values inherited from the submitting shell. Then narrows
    CUDA_VISIBLE_DEVICES to this rank's GPU, so every rank uses ``cuda:0``: call it before
    anything initialises CUDA, then ``torch.distributed.init_process_group(init_method="env://")``.

    Raises RuntimeError outside a submitit job.
    """
    torch_env = submitit.helpers.TorchDistributedEnvironment()
    allocated_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    torch_env.export(set_cuda_visible_devices=False, overwrite=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpu_for_local_rank(
        allocated_gpus, torch_env.local_rank, torch_env.local_world_size
    )
    return torch_env.rank, torch_env.world_size, torch_env.local_rank, torch_env.local_world_size


def _gpu_for_local_rank(allocated_gpus: str | None, local_rank: int, local_world_size: int) -> str:
    """The CUDA_VISIBLE_DEVICES value that leaves exactly this rank's GPU visible.

    SLURM lists the job's GPUs on the node in CUDA_VISIBLE_DEVICES (e.g. ``4,5,6,7`` when the job
    holds half a node without device cgroups), so rank r takes the r-th entry; submitit's own
    ``str(local_rank)`` would pick a GPU outside the allocation there. Without a list (a cluster
    that does not manage GPUs as GRES, or a CPU job) node-wide numbering is the only guess.
    """
    if allocated_gpus is None:
        return str(local_rank)
    gpus = [gpu for gpu in allocated_gpus.split(",") if gpu]
    if len(gpus) <= 1:
        # No GPU, or SLURM already bound this task to one (--gpus-per-task=1, --gpu-bind).
        return allocated_gpus
    if len(gpus) != local_world_size:
        raise RuntimeError(
            f"CUDA_VISIBLE_DEVICES={allocated_gpus} lists {len(gpus)} GPUs for {local_world_size} "
            "ranks on this node; lowcomm runs one rank per GPU (gpus_per_node == tasks_per_node)"
        )
    return gpus[local_rank]


# ------------------------------------------------------------------------------------------------
# Inside the job: one training worker per SLURM task


class PreemptionFlag:
    """Set by the preemption signal, read by the training loop at step boundaries (``should_stop``).

    The handler only sets the flag: saving, collectives and requeueing all happen later, in the
    task's normal flow. :meth:`install` puts it in place of the handler submitit installed for
    the same signal and keeps that one for :meth:`hand_over`.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.requested = False
        self._displaced: Callable[[int, Any], Any] | int | None = None

    @classmethod
    def install(cls, signal_name: str | None = None) -> PreemptionFlag:
        """Handle ``signal_name`` (default: submitit's, ``$SUBMITIT_PREEMPT_SIGNAL`` else USR2)."""
        name = (signal_name or os.environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2").removeprefix("SIG")
        flag = cls(getattr(signal, f"SIG{name}"))
        flag._displaced = signal.signal(flag.signum, flag._on_signal)
        return flag

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        self.requested = True

    def __call__(self) -> bool:
        return self.requested

    def hand_over(self) -> NoReturn:
        """After the preemption checkpoint: let submitit requeue the job, then leave.

        On global rank 0 the displaced submitit handler pickles the callable for the requeued
        job, runs ``scontrol requeue`` and exits (or raises when it may not requeue, e.g. too
        many time-outs: the task then ends with that error). On the other ranks it does nothing,
        and the task exits with status 0 and no result, so that neither a result file nor a
        failed task (``srun --kill-on-bad-exit``) can end the job before rank 0 has requeued it.
        """
        if callable(self._displaced):
            self._displaced(self.signum, None)
        raise SystemExit(0)


class TrainingJob(submitit.helpers.Checkpointable):
    """What every task of a lowcomm SLURM job runs: one rank of the run in ``config_path``.

    Checkpointable: submitit resubmits the same callable (the config path is all its state) when
    it requeues the job; the training loop finds its own checkpoints in the run directory.
    Returns the run's summary (the same dict as ``summary.json``) from every rank.
    """

    def __init__(self, config_path: str) -> None:
        self.config_path = config_path

    def __call__(self) -> dict[str, Any]:
        # First, so that a signal arriving during start-up is not lost; submitit's handler,
        # installed before this call, is kept for after the checkpoint.
        stop = PreemptionFlag.install()
        rank, _, _, _ = setup_distributed_from_slurm()

        from omegaconf import OmegaConf

        from lowcomm.config import validate
        from lowcomm.launch.env import DistEnv
        from lowcomm.train.loop import train

        if rank != 0:
            warnings.filterwarnings("ignore")
        # lowcomm's loggers only: submitit's logger writes to the same task log by itself.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        lowcomm_log = logging.getLogger("lowcomm")
        lowcomm_log.addHandler(handler)
        lowcomm_log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        run = validate(OmegaConf.load(self.config_path))
        result = train(run, DistEnv.from_environ(), should_stop=stop)
        if result.preempted:
            print(f"[lowcomm] rank {rank}: checkpoint at step {result.final_step} written; "
                  "leaving the job to be requeued", flush=True)
            stop.hand_over()
        return result.summary


# ------------------------------------------------------------------------------------------------
# The queue and the state of a run

SLURM_DIR = "slurm"  # <run_dir>/slurm/: submitit's job files and logs, and our submission record
SUBMISSIONS = "submissions.jsonl"

# squeue states of a job that is, or will be, running (everything else is final).
PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD"})
RUNNING_STATES = frozenset(
    {"CONFIGURING", "RUNNING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
)


class SlurmUnavailable(RuntimeError):
    """squeue or sbatch cannot be run here (no SLURM client, or the controller does not answer)."""


@dataclasses.dataclass(frozen=True)
class QueuedJob:
    job_id: str
    name: str
    state: str  # squeue's long form: PENDING, RUNNING, COMPLETED, CANCELLED, ...

    @property
    def active(self) -> bool:
        return self.state in PENDING_STATES or self.state in RUNNING_STATES


@dataclasses.dataclass(frozen=True)
class Queue:
    """One squeue listing of the user's jobs, recent finished ones included (MinJobAge)."""

    jobs: tuple[QueuedJob, ...]

    @classmethod
    def read(cls, user: str | None = None) -> Queue:
        if shutil.which("squeue") is None:
            raise SlurmUnavailable("squeue is not installed here: is this a SLURM login node?")
        listed = subprocess.run(
            ["squeue", "--noheader", "--states=all", f"--user={user or getpass.getuser()}",
             "--format=%i|%T|%j"],
            capture_output=True, text=True, timeout=60,
        )
        if listed.returncode != 0:
            raise SlurmUnavailable(f"squeue failed: {listed.stderr.strip()}")
        jobs = []
        for line in listed.stdout.splitlines():
            if line.strip():
                job_id, state, name = line.strip().split("|", 2)
                jobs.append(QueuedJob(job_id=job_id, name=name, state=state))
        return cls(tuple(jobs))

    def find(self, job_id: str | None = None, name: str | None = None) -> QueuedJob | None:
        """The job with this id or name: an active one first (the newest), else the job with
        this id in a final state, else None."""
        matching = [job for job in self.jobs if job.job_id == job_id or (name is not None and job.name == name)]
        active = [job for job in matching if job.active]
        if active:
            return active[-1]
        recorded = [job for job in matching if job.job_id == job_id]
        return recorded[-1] if recorded else None


@dataclasses.dataclass(frozen=True)
class RunState:
    """Where a run stands. ``status``: done | running | pending | failed | not submitted."""

    status: str
    job_id: str | None = None
    detail: str = ""  # e.g. the final queue state of a failed job
    last_step: int | None = None
    last_loss: float | None = None

    @property
    def active(self) -> bool:
        return self.status in ("running", "pending")


def last_submission(run_dir: Path) -> dict[str, Any] | None:
    """The newest record of ``<run_dir>/slurm/submissions.jsonl``, or None."""
    path = Path(run_dir) / SLURM_DIR / SUBMISSIONS
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def last_logged(run_dir: Path) -> tuple[int | None, float | None]:
    """Step and training loss of the last ``train/loss`` record in ``metrics.jsonl``."""
    for record in reversed(read_metrics(Path(run_dir) / METRICS)):
        if "train/loss" in record:
            return int(record["step"]), float(record["train/loss"])
    return None, None


def run_state(run_dir: Path, run_name: str, queue: Queue | None) -> RunState:
    """The state of the run in ``run_dir``; ``queue`` None when the queue cannot be read."""
    run_dir = Path(run_dir)
    step, loss = last_logged(run_dir)
    record = last_submission(run_dir)
    recorded_id = record["job_id"] if record else None
    if (run_dir / "summary.json").is_file():
        return RunState("done", recorded_id, last_step=step, last_loss=loss)
    job = queue.find(job_id=recorded_id, name=run_name) if queue is not None else None
    if job is not None and job.active:
        status = "pending" if job.state in PENDING_STATES else "running"
        return RunState(status, job.job_id, job.state, step, loss)
    if record is None:
        return RunState("not submitted", last_step=step, last_loss=loss)
    if queue is None:
        detail = "queue unknown"
    elif job is not None:
        detail = job.state
    else:
        detail = "no longer in the queue"
    return RunState("failed", recorded_id, detail, step, loss)


# ------------------------------------------------------------------------------------------------
# Submission


@dataclasses.dataclass(frozen=True)
class Submission:
    """What :func:`submit_training` did with a run: ``submitted`` it, or left it (``skipped``)."""

    run_dir: Path
    action: str  # submitted | skipped
    state: RunState  # the run's state before (skipped: why)
    job_id: str | None
    log_dir: Path

    def describe(self) -> str:
        if self.action == "submitted":
            resumed = (f", resumes from its latest checkpoint (last logged step {self.state.last_step})"
                       if self.state.last_step else "")
            return (f"submitted job {self.job_id}{resumed}; logs: "
                    f"{self.log_dir}/{self.job_id}_<task>_log.{{out,err}}")
        job = f" (job {self.state.job_id})" if self.state.job_id else ""
        return f"skipped: {self.state.status}{job}"


def check_profile(run: RunConfig) -> None:
    """Raise ConfigError when ``run``'s cluster is not a valid SLURM profile."""
    if run.cluster.launcher != "slurm":
        raise ConfigError([f"cluster.launcher={run.cluster.launcher!r}: submitting needs a SLURM profile "
                           "(cluster=slurm_debug, cluster=slurm_64gpu or one of your own)"])
    try:
        slurm_profile(run.cluster)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from exc


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
    from lowcomm.data import materialize
    from lowcomm.launch.local import write_run_config

    check_profile(run)
    run = _with_absolute_run_root(run)
    log_dir = run.run_dir / SLURM_DIR
    state = run_state(run.run_dir, run.run_name, queue if queue is not None else Queue.read())
    if state.status == "done" or state.active:
        return Submission(run.run_dir, "skipped", state, state.job_id, log_dir)
    materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    config_path = write_run_config(run)
    executor = make_executor(log_dir, run.cluster, job_name=run.run_name, environ=environ)
    try:
        job = executor.submit(TrainingJob(str(config_path)))
    except (FailedJobError, OSError) as exc:
        raise SlurmUnavailable(f"sbatch failed for {run.run_name}: {exc}") from exc
    record = {
        "job_id": job.job_id,
        "submitted_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "job_name": run.run_name,
        "nodes": run.cluster.nodes,
        "tasks_per_node": run.cluster.tasks_per_node,
        "gpus_per_node": run.cluster.gpus_per_node,
        "last_logged_step": state.last_step,
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / SUBMISSIONS).open("a") as handle:
        handle.write(json.dumps(record) + "\n")
    return Submission(run.run_dir, "submitted", state, job.job_id, log_dir)


def submit_run(run: RunConfig) -> Path:
    """``lowcomm-train`` with a SLURM cluster profile: submit ``run``, say where it went, return
    its run directory (without waiting for the job)."""
    submission = submit_training(run)
    print(f"[lowcomm] {run.run_name}: {submission.describe()}", flush=True)
    if submission.action == "submitted":
        print(f"[lowcomm] watch it: squeue --name={run.run_name}  (metrics: {submission.run_dir}/metrics.jsonl)",
              flush=True)
    return submission.run_dir
