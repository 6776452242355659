"""SLURM through submitit: a cluster profile becomes an executor; a task finds its rank.

Two halves, one on each side of ``sbatch``:

- on the submitting machine, :func:`slurm_profile` validates a cluster profile (the SLURM fields
  of ``configs/cluster/*.yaml``), :func:`submitit_parameters` turns it into the keyword
  arguments of ``submitit.AutoExecutor.update_parameters`` and :func:`make_executor` builds the
  executor with them;
- inside every task of the job, :func:`setup_distributed_from_slurm` exports the ``env://``
  variables torch.distributed reads and returns this task's place in the world.

Preemption follows submitit's protocol: SLURM sends ``signal`` ``signal_delay_s`` seconds before
it kills the job; global rank 0 catches it, calls the submitted callable's ``checkpoint()`` and
requeues the job (same job id). A requeued job starts from scratch, so the training loop must
resume from its own latest checkpoint. submitit requeues preempted jobs without limit; only
timeouts count against ``max_requeues``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import submitit

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
