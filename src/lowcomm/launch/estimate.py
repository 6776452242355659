"""What a run will cost before it is launched: its GPU-hours (:func:`compute_estimate`, from
6 x parameters x tokens) and the size and write time of one checkpoint
(:func:`checkpoint_estimate`, beside the preemption lead time). Both build the model on the
meta device, so nothing is allocated; ``lowcomm-sweep submit --dry-run`` prints them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from lowcomm.comm import Communicator
from lowcomm.config import RunConfig
from lowcomm.hardware import FS_BANDWIDTH, H100_BF16_PEAK_FLOPS, TYPICAL_MFU
from lowcomm.models import build_model, count_parameters

DEFAULT_PEAK_FLOPS = H100_BF16_PEAK_FLOPS
DEFAULT_MFU = TYPICAL_MFU


@dataclass(frozen=True)
class Estimate:
    parameters: int
    tokens: int
    flops: float  # 6 x parameters x tokens (forward + backward of a dense transformer)
    gpus: int
    gpu_hours: float | None  # None for a CPU job
    wall_hours: float | None  # gpu_hours / gpus


_parameter_counts: dict[str, int] = {}


def parameter_count(run: RunConfig) -> int:
    """The model's parameter count, from shapes on the meta device (nothing allocated)."""
    key = json.dumps(asdict(run.model), sort_keys=True)
    if key not in _parameter_counts:
        _parameter_counts[key] = count_parameters(build_model(run.model, "meta"))
    return _parameter_counts[key]


def compute_estimate(run: RunConfig, *, mfu: float = DEFAULT_MFU, peak_flops: float = DEFAULT_PEAK_FLOPS) -> Estimate:
    """GPU-hours of ``run`` from 6 x parameters x tokens at ``mfu`` of ``peak_flops`` per GPU.

    Counts the training tokens only (train.max_steps x global batch x sequence length); evaluation
    and checkpointing are extra. A job without GPUs (cluster.gpus_per_node = 0, or the local
    launcher) gets no GPU estimate.
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if peak_flops <= 0:
        raise ValueError(f"peak FLOP/s per GPU must be positive, got {peak_flops}")
    parameters = parameter_count(run)
    tokens = run.train.max_steps * run.train.global_batch_size * run.train.seq_len
    flops = 6.0 * parameters * tokens
    cluster = run.cluster
    gpus = cluster.nodes * cluster.gpus_per_node if cluster.launcher == "slurm" else 0
    if not gpus:
        return Estimate(parameters, tokens, flops, 0, None, None)
    gpu_hours = flops / (mfu * peak_flops) / 3600
    return Estimate(parameters, tokens, flops, gpus, gpu_hours, gpu_hours / gpus)


DEFAULT_FS_BANDWIDTH = FS_BANDWIDTH


@dataclass(frozen=True)
class CheckpointEstimate:
    """One checkpoint of a run: bytes written once (model, replicated optimizer state) and by
    every rank (its own optimizer state), and the time to write them all at ``bandwidth``."""

    replicated_bytes: float
    per_rank_bytes: float
    world_size: int
    bandwidth: float  # bytes/s
    lead_time_s: float | None  # the preemption signal's lead (SLURM), None locally
    # how long the other ranks wait at the checkpoint's barrier before they give up
    collective_timeout_s: float | None = None

    @property
    def total_bytes(self) -> float:
        return self.replicated_bytes + self.world_size * self.per_rank_bytes

    @property
    def write_s(self) -> float:
        return self.total_bytes / self.bandwidth

    @property
    def fits(self) -> bool:
        return self.lead_time_s is None or self.write_s <= self.lead_time_s

    @property
    def outlasts_timeout(self) -> bool:
        """Writing it takes longer than a collective may wait: every periodic checkpoint would
        stop the run as if a rank were lost."""
        return self.collective_timeout_s is not None and self.write_s > self.collective_timeout_s

    def describe(self) -> str:
        text = (f"{self.total_bytes / 1e9:,.2f} GB in all: {self.replicated_bytes / 1e9:,.2f} GB once + "
                f"{self.per_rank_bytes / 1e9:,.2f} GB per rank x {self.world_size}; "
                f"{self.write_s:,.0f} s at {self.bandwidth / 1e9:g} GB/s")
        if self.lead_time_s is not None:
            text += f" (preemption lead time {self.lead_time_s:g} s)"
        if not self.fits:
            text += ("; WARNING: it does not fit: a preempted job is killed before its checkpoint is "
                     "written (raise cluster.signal_delay_s, or checkpoint more often to lose less)")
        if self.outlasts_timeout:
            text += (f"; WARNING: longer than cluster.collective_timeout_s ({self.collective_timeout_s:g} s): the "
                     "ranks waiting at its barrier would give up (raise the timeout)")
        return text


def checkpoint_estimate(run: RunConfig, *, bandwidth: float = DEFAULT_FS_BANDWIDTH) -> CheckpointEstimate:
    """The checkpoint size of ``run`` from the model's shapes and its strategy's state."""
    if bandwidth <= 0:
        raise ValueError(f"filesystem bandwidth must be positive, got {bandwidth}")
    cluster = run.cluster
    strategy = run.strategy_class(run.optimizer, run.compression, Communicator())
    replicated, per_rank = strategy.checkpoint_bytes(build_model(run.model, "meta"), cluster.local_world_size)
    lead = float(cluster.signal_delay_s) if cluster.launcher == "slurm" else None
    return CheckpointEstimate(replicated, per_rank, run.world_size, bandwidth, lead,
                              float(cluster.collective_timeout_s))
