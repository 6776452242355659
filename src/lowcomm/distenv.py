"""The distributed environment of one process: rank and world discovery, in one place.

torchrun and lowcomm's local launcher export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; inside a SLURM task,
:func:`setup_distributed_from_slurm` derives and exports the same variables from SLURM's.
Everything else in lowcomm (the launchers, the training loop, strategies that need the node
layout) reads them through this module, never from ``os.environ`` directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        missing = [key for key in _REQUIRED if key not in os.environ]
        if missing:
            raise RuntimeError(f"distributed environment incomplete: {', '.join(missing)} not set")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank, local_world = local_layout(rank, world)
        return cls(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world)

    @staticmethod
    def present() -> bool:
        return all(key in os.environ for key in _REQUIRED)


def rendezvous_address() -> tuple[str, int] | None:
    """``(MASTER_ADDR, MASTER_PORT)``, the host every rank met at; None outside a process group's
    environment."""
    if "MASTER_ADDR" not in os.environ:
        return None
    return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "0"))


def local_layout(rank: int, world_size: int) -> tuple[int, int]:
    """``(local rank, ranks on this node)``; a process started without them (one node, or a
    test that sets only RANK and WORLD_SIZE) is taken to be alone on its node with all ranks."""
    return (int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def setup_distributed_from_slurm() -> tuple[int, int, int, int]:
    """Inside a submitit task: export the ``env://`` variables and give this rank its GPU.

    Returns ``(rank, world_size, local_rank, local_world_size)``, the numbers that
    :meth:`DistEnv.from_environ` reads back afterwards.

    Sets MASTER_ADDR (the job's first node), MASTER_PORT (:func:`job_port` of the job id, or
    $MASTER_PORT when the job's environment sets it), RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE, replacing any values inherited from the submitting shell. Then narrows
    CUDA_VISIBLE_DEVICES to this rank's GPU, so every rank uses ``cuda:0``: call it before
    anything initialises CUDA, then ``torch.distributed.init_process_group(init_method="env://")``.

    Raises RuntimeError outside a submitit job.
    """
    import submitit  # only inside a SLURM task: importing it costs a second elsewhere

    if "SLURM_JOB_ID" in os.environ:  # (submitit's own pick, from 20000-60000, may be a port in use)
        os.environ.setdefault("MASTER_PORT", str(job_port(os.environ["SLURM_JOB_ID"])))
    torch_env = submitit.helpers.TorchDistributedEnvironment()
    allocated_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    torch_env.export(set_cuda_visible_devices=False, overwrite=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu_for_local_rank(
        allocated_gpus, torch_env.local_rank, torch_env.local_world_size
    )
    return torch_env.rank, torch_env.world_size, torch_env.local_rank, torch_env.local_world_size


# A job's rendezvous port: below Linux's ephemeral ports (32768 and up by default), where any
# process's outgoing connection may hold the one a job picked there
JOB_PORTS = range(20000, 32768)


def job_port(job_id: str) -> int:
    """The rendezvous port of SLURM job ``job_id`` (every task of the job derives the same one;
    a job array's elements have job ids of their own)."""
    return JOB_PORTS.start + int(job_id) % len(JOB_PORTS)


def gpu_for_local_rank(allocated_gpus: str | None, local_rank: int, local_world_size: int) -> str:
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
