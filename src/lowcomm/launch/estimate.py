"""What a run will cost before it is launched: its GPU-hours (:func:`compute_estimate`, from
6 x parameters x tokens), the size and write time of one checkpoint (:func:`checkpoint_estimate`,
beside the preemption lead time), and the job as a whole (:func:`plan_job`: the time limit it
asks SLURM for, its checkpoints' time and its scratch space). They build the model on the meta
device, so nothing is allocated; ``lowcomm-sweep submit --dry-run`` prints them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass

from lowcomm.comm import Communicator
from lowcomm.config import RunConfig, TrainSpec
from lowcomm.hardware import H100_BF16_PEAK_FLOPS, TYPICAL_MFU
from lowcomm.models import build_model, count_parameters
from lowcomm.units import slurm_time

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


@dataclass(frozen=True)
class CheckpointEstimate:
    """One checkpoint of a run: bytes written once, by rank 0 (the model, the optimizer state every
    rank holds alike), and by every rank (its own optimizer state, ``optim_rank<r>.pt``). The ranks
    write their files at the same time (:class:`lowcomm.train.checkpoint.CheckpointManager`), each at
    ``rank_bandwidth``: the write takes as long as rank 0, which writes the most."""

    replicated_bytes: float
    per_rank_bytes: float  # the most a rank writes: between two outer boundaries (a preemption's)
    world_size: int
    rank_bandwidth: float  # bytes/s one rank writes at, all writing at once (cluster.rank_write_MBps)
    lead_time_s: float | None  # the preemption signal's lead (SLURM), None locally
    # how long the other ranks wait at the checkpoint's barrier before they give up
    collective_timeout_s: float | None = None
    # per rank, a checkpoint's at an outer boundary, which leaves the workers' own parameters out
    # (None: the method has no such boundary), and whether every periodic one falls on one
    # (train.checkpoint_every a multiple of the sync period)
    boundary_per_rank_bytes: float | None = None
    periodic_on_boundary: bool = False
    periodic_checkpoints: bool = True  # train.checkpoint_every > 0 (else only the final one)
    final_on_boundary: bool = False  # train.max_steps ends on an outer boundary
    # who writes the replicated state: rank 0, or under cluster.fault_tolerance=torchft each
    # replica group's rank 0 (groups that fail apart checkpoint apart)
    replicated_copies: int = 1

    @property
    def replicated_total_bytes(self) -> float:
        return self.replicated_copies * self.replicated_bytes

    @property
    def total_bytes(self) -> float:
        """The largest checkpoint: one written between two outer boundaries (a preemption may
        write it at any step)."""
        return self.replicated_total_bytes + self.world_size * self.per_rank_bytes

    def _per_rank(self, on_boundary: bool) -> float:
        """Per rank, a checkpoint's at an outer boundary (where the method has one) or between two."""
        return self.boundary_per_rank_bytes if on_boundary and self.boundary_per_rank_bytes is not None \
            else self.per_rank_bytes

    def _rank0_write_s(self, per_rank: float) -> float:
        """A checkpoint's write: rank 0's, the replicated state and its own, the most of any rank."""
        return (self.replicated_bytes + per_rank) / self.rank_bandwidth

    @property
    def periodic_per_rank_bytes(self) -> float:
        """Per rank, each periodic checkpoint's."""
        return self._per_rank(self.periodic_on_boundary)

    @property
    def periodic_total_bytes(self) -> float:
        """Each periodic checkpoint (every ``train.checkpoint_every`` steps)."""
        return self.replicated_total_bytes + self.world_size * self.periodic_per_rank_bytes

    @property
    def slowest_rank_bytes(self) -> float:
        """Rank 0's share: the replicated state and its own."""
        return self.replicated_bytes + self.per_rank_bytes

    @property
    def write_s(self) -> float:
        """The largest checkpoint's write (what the preemption lead time must cover)."""
        return self._rank0_write_s(self.per_rank_bytes)

    @property
    def periodic_write_s(self) -> float:
        return self._rank0_write_s(self.periodic_per_rank_bytes)

    @property
    def final_write_s(self) -> float:
        """The final checkpoint's (at ``train.max_steps``): at an outer boundary only where the
        steps end on one."""
        return self._rank0_write_s(self._per_rank(self.final_on_boundary))

    def run_write_s(self, count: int) -> float:
        """``count`` checkpoints' writes: the periodic ones and the final one."""
        return (count - 1) * self.periodic_write_s + self.final_write_s if count else 0.0

    def describe_writes(self, count: int) -> str:
        """``7 x 59 s``, or ``6 x 59 s + 71 s`` where the final one is larger."""
        if count < 2 or round(self.final_write_s) == round(self.periodic_write_s):
            return f"{count} x {self.periodic_write_s:,.0f} s"
        return f"{count - 1} x {self.periodic_write_s:,.0f} s + {self.final_write_s:,.0f} s"

    @property
    def filesystem_rate(self) -> float:
        """Bytes/s the filesystem takes from all ranks together while they write at their rate."""
        return self.total_bytes / self.write_s

    @property
    def fits(self) -> bool:
        return self.lead_time_s is None or self.write_s <= self.lead_time_s

    @property
    def outlasts_timeout(self) -> bool:
        """Writing it takes longer than a collective may wait: every periodic checkpoint would
        stop the run as if a rank were lost."""
        return self.collective_timeout_s is not None and self.write_s > self.collective_timeout_s

    def describe(self) -> str:
        text = ""
        boundary = self.boundary_per_rank_bytes
        once, writer = ("once", "rank 0") if self.replicated_copies == 1 else \
            (f"per replica group x {self.replicated_copies}", "each group's rank 0")
        if boundary is not None and self.periodic_on_boundary:
            text = (f"{self.periodic_total_bytes / 1e9:,.2f} GB each periodic one, at an outer boundary "
                    f"({self.replicated_bytes / 1e9:,.2f} GB {once} + {boundary / 1e9:,.2f} GB per rank x "
                    f"{self.world_size}, no worker's own parameters), {self.periodic_write_s:,.0f} s; "
                    "between two boundaries (a preemption's): ")
        text += (f"{self.total_bytes / 1e9:,.2f} GB in all: {self.replicated_bytes / 1e9:,.2f} GB {once} ({writer}) + "
                 f"{self.per_rank_bytes / 1e9:,.2f} GB per rank x {self.world_size}; {self.write_s:,.0f} s: the "
                 f"ranks write at once at {self.rank_bandwidth / 1e6:,.0f} MB/s each (cluster.rank_write_MBps), "
                 f"rank 0 the most ({self.slowest_rank_bytes / 1e9:,.2f} GB), "
                 f"{self.filesystem_rate / 1e9:,.1f} GB/s into the filesystem")
        if self.lead_time_s is not None:
            text += f" (preemption lead time {self.lead_time_s:g} s)"
        if boundary is not None and not self.periodic_on_boundary and self.periodic_checkpoints:
            at_boundary = self.replicated_total_bytes + self.world_size * boundary
            text += (f"; at outer boundaries each would be {at_boundary / 1e9:,.2f} GB (no worker's own parameters): "
                     "make train.checkpoint_every a multiple of optimizer.sync_every")
        if not self.fits:
            text += ("; WARNING: it does not fit: a preempted job is killed before its checkpoint is "
                     "written (raise cluster.signal_delay_s)")
        if self.outlasts_timeout:
            text += (f"; WARNING: longer than cluster.collective_timeout_s ({self.collective_timeout_s:g} s): the "
                     "ranks waiting at its barrier would give up (raise the timeout)")
        return text


def checkpoint_estimate(run: RunConfig, *, rank_bandwidth: float | None = None) -> CheckpointEstimate:
    """The checkpoint size of ``run`` from the model's shapes and its strategy's state, written at
    ``rank_bandwidth`` bytes/s per rank (default: the profile's ``cluster.rank_write_MBps``)."""
    cluster = run.cluster
    rank_bandwidth = cluster.rank_write_MBps * 1e6 if rank_bandwidth is None else rank_bandwidth
    if rank_bandwidth <= 0:
        raise ValueError(f"a rank's write bandwidth must be positive, got {rank_bandwidth}")
    strategy = run.strategy_class(run.optimizer, run.compression, Communicator())
    model = build_model(run.model, "meta")
    replicated, per_rank = strategy.checkpoint_bytes(model, cluster.local_world_size)
    boundary = None
    if strategy.boundary_saved_bytes(model) > 0:
        boundary = strategy.checkpoint_bytes(model, cluster.local_world_size, at_boundary=True)[1]
    every = run.train.checkpoint_every
    lead = float(cluster.signal_delay_s) if cluster.launcher == "slurm" else None
    return CheckpointEstimate(replicated, per_rank, run.world_size, rank_bandwidth, lead,
                              float(cluster.collective_timeout_s), boundary,
                              periodic_on_boundary=bool(every) and strategy.outer_boundary(every),
                              periodic_checkpoints=bool(every),
                              final_on_boundary=strategy.outer_boundary(run.train.max_steps),
                              replicated_copies=cluster.replica_groups if cluster.fault_tolerance == "torchft" else 1)


# A job asks SLURM for its estimated training time times this: the MFU is an assumption (a run at
# 0.27 of the peak instead of 0.4 still ends within its limit), and evaluation, logging and the
# data's first read are not in 6 x parameters x tokens.
TIME_MARGIN = 1.5
# Minutes every job spends before its first step: the environment, the ranks' rendezvous, the
# model built and a checkpoint loaded.
STARTUP_MIN = 10
# Time limits are asked for in whole quarter hours.
TIME_STEP_MIN = 15


def checkpoint_count(train: TrainSpec) -> int:
    """Checkpoints a run writes from start to end: every ``checkpoint_every`` steps and at the end."""
    if not train.checkpoint_every:
        return 1
    return math.ceil(train.max_steps / train.checkpoint_every)


@dataclass(frozen=True)
class JobPlan:
    """One run as a SLURM job: what it costs (GPU-hours, checkpoint time, scratch space) and the
    time limit it asks for, which follows from its size: the training estimate x
    :data:`TIME_MARGIN`, plus its checkpoints and :data:`STARTUP_MIN`, rounded up to
    :data:`TIME_STEP_MIN`, at most the profile's ``cluster.timeout_min`` (past it, the job times
    out, is requeued and resumes from the checkpoint it writes on the warning signal)."""

    run: RunConfig  # cluster.timeout_min: the time limit asked for
    estimate: Estimate
    checkpoint: CheckpointEstimate
    checkpoints: int  # written from start to end
    needed_min: float | None  # None: no GPUs, no estimate; the profile's limit is asked for
    cap_min: int  # the profile's cluster.timeout_min

    @property
    def time_limit_min(self) -> int:
        return self.run.cluster.timeout_min

    @property
    def checkpoint_s(self) -> float:
        return self.checkpoint.run_write_s(self.checkpoints)

    @property
    def gpu_hours(self) -> float | None:
        """Training and writing checkpoints (the job holds its GPUs while it writes)."""
        if self.estimate.gpu_hours is None:
            return None
        return self.estimate.gpu_hours + self.estimate.gpus * self.checkpoint_s / 3600

    @property
    def scratch_bytes(self) -> float:
        """Checkpoints on disk at the peak: ``keep_checkpoints``, and one more while the next is
        written (the oldest is deleted after it); that one may be a preemption's, written between
        two outer boundaries (the largest)."""
        held = min(self.checkpoints, self.run.train.keep_checkpoints + 1)
        return (held - 1) * self.checkpoint.periodic_total_bytes + self.checkpoint.total_bytes

    @property
    def capped(self) -> bool:
        return self.needed_min is not None and self.needed_min > self.cap_min

    @property
    def requeues(self) -> int:
        """Time-outs (each requeued) a job needs to end when its limit is capped."""
        return math.ceil(self.needed_min / self.cap_min) - 1 if self.capped else 0

    @property
    def too_few_requeues(self) -> bool:
        return self.requeues > self.run.cluster.max_requeues

    def describe_time(self) -> str:
        """The time limit asked for, and why."""
        cluster = self.run.cluster
        if self.needed_min is None:
            return f"{slurm_time(self.time_limit_min)} (cluster.timeout_min: no GPUs, no time estimate)"
        why = (f"{self.estimate.wall_hours:,.2f} h of training x {TIME_MARGIN:g} + checkpoints "
               f"{self.checkpoint.describe_writes(self.checkpoints)} + {STARTUP_MIN} min start-up = "
               f"{self.needed_min / 60:,.2f} h")
        if not self.capped:
            return f"{slurm_time(self.time_limit_min)} on {cluster.nodes} nodes ({why}, rounded up)"
        text = (f"{slurm_time(self.time_limit_min)} on {cluster.nodes} nodes: needs {self.needed_min / 60:,.1f} h "
                f"({why}): capped at {slurm_time(self.cap_min)} (cluster.timeout_min); it resumes from its "
                f"checkpoint across {self.requeues} time-out requeue{'s' if self.requeues > 1 else ''}")
        if self.too_few_requeues:
            text += (f"; WARNING: cluster.max_requeues is {cluster.max_requeues}: raise it, or submit again when "
                     "the job stops")
        return text


def with_time_limit(run: RunConfig, minutes: int) -> RunConfig:
    """``run`` asking SLURM for ``minutes`` (its config, written to the run directory, says so)."""
    cluster = dataclasses.replace(run.cluster, timeout_min=minutes)
    return dataclasses.replace(run, cluster=cluster, raw={**run.raw, "cluster": {**run.raw["cluster"],
                                                                                  "timeout_min": minutes}})


def plan_job(run: RunConfig, *, mfu: float = DEFAULT_MFU, peak_flops: float = DEFAULT_PEAK_FLOPS) -> JobPlan:
    """``run`` as a job: its estimates, and (SLURM with GPUs) the time limit its size needs."""
    estimate = compute_estimate(run, mfu=mfu, peak_flops=peak_flops)
    checkpoint = checkpoint_estimate(run)
    count = checkpoint_count(run.train)
    cap = run.cluster.timeout_min
    if run.cluster.launcher != "slurm" or estimate.wall_hours is None:
        return JobPlan(run, estimate, checkpoint, count, None, cap)
    needed = estimate.wall_hours * 60 * TIME_MARGIN + checkpoint.run_write_s(count) / 60 + STARTUP_MIN
    # whole quarter hours, and longer than the warning signal's lead (SLURM refuses otherwise)
    floor = run.cluster.signal_delay_s / 60
    limit = TIME_STEP_MIN * math.ceil(max(needed, floor + 1) / TIME_STEP_MIN)
    return JobPlan(with_time_limit(run, min(limit, cap)), estimate, checkpoint, count, needed, cap)
