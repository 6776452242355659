"""The training loop: one loop for every optimizer. It talks to the strategy seam only."""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowcomm.comm import Communicator
from lowcomm.config import RunConfig
from lowcomm.config.cluster import LINKS_SHAPED_ENV, node_link_rates, shaped_links
from lowcomm.data import BatchOrder, open_data, validation_indices
from lowcomm.distenv import DistEnv
from lowcomm.hardware import bf16_peak_flops
from lowcomm.models import build_model, count_parameters, flops_per_token
from lowcomm.rundir import RunDir, list_checkpoints, write_json_atomic
from lowcomm.train.boundary import Boundary, BoundaryAgreement
from lowcomm.train.checkpoint import CheckpointManager, Restored
from lowcomm.train.metrics import MetricsWriter, Progress
from lowcomm.train.peers import PeerTable
from lowcomm.train.replicas import ReplicaGroup, group_place, own_run_dir
from lowcomm.train.schedule import apply_lr, lr_multiplier
from lowcomm.train.slowdown import Slowdown
from lowcomm.train.synchronizer import (
    learner_dir,
    learners_with_checkpoints,
    synchronizer_address,
    synchronizer_resumed_from,
    uses_synchronizer,
)

log = logging.getLogger("lowcomm.train")


@dataclass
class TrainResult:
    run_dir: Path
    final_step: int
    preempted: bool
    summary: dict
    diverged: dict | None = None  # the summary's "diverged" entry when the run diverged
    stop_signal: int | None = None  # where preempted: the signal the ranks agreed to stop on


# The exit status of a run that diverged: EX_DATAERR of sysexits.h. Rerunning it as it is
# would diverge again; it needs another setting (the lr), hence another run.
EXIT_DIVERGED = 65


class RunDiverged(RuntimeError):
    """A run stopped because its loss diverged (``summary.json``'s ``diverged`` entry)."""

    def __init__(self, run_dir: Path, diverged: dict):
        self.run_dir, self.diverged = run_dir, diverged
        super().__init__(divergence_line(run_dir, diverged))


def divergence_line(run_dir: Path, diverged: dict) -> str:
    """The one line that says a run diverged, where, and what is kept."""
    kept = diverged.get("last_checkpoint")
    return (f"[lowcomm] diverged at step {diverged['step']}: {diverged['reason']} (lr {diverged['lr']:.3g}); "
            f"no checkpoint written from it, {f'the last finite one is {kept}' if kept else 'no earlier checkpoint'}"
            f"; {run_dir / 'summary.json'} records the run as diverged: change the lr (or another setting) for a "
            "new run, or delete the run directory to train this one again")


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device=cuda but no GPU is visible")
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            # two ranks on one GPU: NCCL refuses the second communicator on the same device
            raise RuntimeError(
                f"local rank {local_rank} has no GPU of its own: {visible} visible "
                "(one task per GPU; with fewer GPUs set cluster.workers or cluster.device=cpu)"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(env: DistEnv, device: torch.device, timeout: datetime.timedelta | None = None) -> None:
    """NCCL for data on GPUs (eagerly bound to this rank's device), gloo on CPUs. The control
    traffic's gloo group beside NCCL is :meth:`Communicator.world`'s. ``timeout``: how long a
    collective waits for its peers (``cluster.collective_timeout_s``; None: torch's default)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                device_id=device if device.type == "cuda" else None, timeout=timeout)


class DeviceClock:
    """``perf_counter`` after the device has finished its queued work. CUDA kernels and NCCL
    collectives run asynchronously: without the synchronisation a timed ``train_step`` ends
    when its work is queued, not done, and the wait lands in whatever reads a result next."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def validation_batches(num_instances: int, max_instances: int, micro_batch: int, rank: int,
                       world_size: int) -> list[tuple[np.ndarray, bool]]:
    """This rank's validation micro-batches as ``(indices, counted)``: its ``[rank::W]`` slice,
    padded with uncounted batches (a repeat of instance 0) up to the largest rank's count."""
    indices = validation_indices(num_instances, max_instances, rank, world_size)
    per_rank_max = -(-min(num_instances, max_instances) // world_size)
    count = -(-per_rank_max // micro_batch)
    batches = [(indices[start : start + micro_batch], True) for start in range(0, len(indices), micro_batch)]
    while len(batches) < count:
        batches.append((np.zeros(1, dtype=np.int64), False))
    return batches


def compiles(setting: bool | str, device: torch.device) -> bool:
    """Whether ``train.compile`` compiles the model on ``device``: ``auto`` on a GPU only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The next-token loss of ``logits`` (batch x positions x vocabulary) against ``targets``
    (batch x positions), in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction=reduction)


@functools.cache
def compiled_cross_entropy() -> Callable[..., torch.Tensor]:
    """:func:`cross_entropy` compiled, one per process. Eagerly the loss writes a float32 copy
    of the logits and passes over it in its softmax, forward and backward: at OLMo-300M's 16 x
    2,048 x 50,304 logits that copy is 6.6 GB of memory traffic per micro-batch, which the
    compiled loss fuses into its reductions."""
    return torch.compile(cross_entropy)


def with_speed_settings(model: torch.nn.Module, train, device: torch.device):
    """The model in ``train.param_dtype`` and compiled as ``train.compile`` says, the autocast
    context ``train.precision`` asks for (bf16 on a GPU, none on the CPU), and the loss to take of
    its logits (compiled where the model is): what the Trainer and ``benchmarks/throughput.py``'s
    bare loop both run. Returns ``(model, autocast, loss)``."""
    if train.param_dtype == "bf16":
        model = model.to(torch.bfloat16)
    loss = cross_entropy
    if compiles(train.compile, device):
        model.compile()  # in place: the state dict's keys, and so the checkpoints, are unchanged
        loss = compiled_cross_entropy()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                if device.type == "cuda" and train.precision in ("auto", "bf16") else contextlib.nullcontext())
    return model, autocast, loss


def next_token_loss(model: torch.nn.Module, tokens: torch.Tensor, reduction: str = "mean",
                    loss: Callable[..., torch.Tensor] = cross_entropy) -> torch.Tensor:
    """``model``'s loss of predicting each of ``tokens`` (batch x length) from those before it,
    taken by ``loss`` (:func:`cross_entropy`, or the compiled one of :func:`with_speed_settings`)."""
    return loss(model(tokens[:, :-1]).logits, tokens[:, 1:], reduction)


class Trainer:
    def __init__(self, run: RunConfig, env: DistEnv, should_stop: Callable[[], bool] | None = None):
        self.run, self.env, self.should_stop = run, env, should_stop
        threads = run.cluster.threads_per_worker or max(1, (os.cpu_count() or 1) // env.local_world_size)
        torch.set_num_threads(threads)
        self.device = pick_device(run.cluster.device, env.local_rank)
        timeout = datetime.timedelta(seconds=run.cluster.collective_timeout_s)
        self.clock = DeviceClock(self.device)
        self.group: ReplicaGroup | None = None
        self.learner: int | None = None
        if uses_synchronizer(run):
            # a learner around a synchronizer (lowcomm.strategies.learners): no collective joins
            # it to the other learners, not even the loop's agreement at a boundary (its own
            # alone), and its records are its own (learner 0's are the run's)
            self.learner = env.rank
            self.comm = self.exchange = Communicator(device=self.device, timeout=timeout)
            self.run_dir = own_run_dir(run.run_dir, self.learner)
            self.shard, self.world_size = env.rank, env.world_size
        elif run.cluster.fault_tolerance == "torchft":
            # replica groups of cluster.ranks_per_group ranks: the loop's collectives are the
            # group's own (one rank: none), and only the method's exchange reaches the other groups
            replica, within = group_place(run, env)
            if within.world_size > 1:
                init_distributed(within, self.device, timeout)
                self.comm = Communicator.world(self.device, timeout=timeout)
            else:
                self.comm = Communicator(device=self.device, timeout=timeout)
            self.group = ReplicaGroup(run, replica, self.comm, self.device)
            self.exchange, self.run_dir = self.group.exchange, self.group.run_dir
            ranks = within.world_size
            self.shard, self.world_size = replica * ranks + self.comm.rank, self.group.replicas * ranks
        else:
            init_distributed(env, self.device, timeout)
            self.comm = self.exchange = Communicator.world(self.device, timeout=timeout)
            self.run_dir = run.run_dir
            self.shard, self.world_size = self.comm.rank, self.comm.world_size
        self.is_main = self.comm.rank == 0
        self.peers = PeerTable.gather(self.comm, run.cluster.collective_timeout_s)
        with self.peers.watch(self.last_checkpoint_step):
            self._build()

    def _build(self) -> None:
        run = self.run
        train = run.train
        self.data = open_data(run.data, train.seq_len, run.run_root, run.model.tokenizer)
        model, self.autocast, self.loss = with_speed_settings(build_model(run.model, self.device, seed=run.seed),
                                                              train, self.device)
        self.n_params = count_parameters(model)
        self.strategy = run.strategy_class(run.optimizer, run.compression, self.exchange)
        if self.learner is not None:
            address = synchronizer_address(run.run_dir, wait_s=run.cluster.collective_timeout_s)
            self.strategy.connect(address, self.learner, timeout_s=run.cluster.collective_timeout_s,
                                  tokens_per_step=train.global_batch_size // self.world_size * train.seq_len)
        self.model, self.optimizer = self.strategy.build(model)
        self.order = BatchOrder(len(self.data.train), train.global_batch_size, self.shard,
                                self.world_size, train.micro_batch_size, seed=run.seed)
        self.slowdown = Slowdown.of_rank(run.cluster.slow_ranks, run.cluster.slowdown, self.shard)
        # each node's link rate where the run's links are shaped (on network-namespace nodes: the
        # config is checked against the nodes here, before a step, where they are known)
        self.node_links = (node_link_rates(run.cluster, max(1, self.env.world_size // self.env.local_world_size))
                           if shaped_links(run.cluster) else None)
        if self.group is not None:
            self.group.serve(self.model, self.optimizer, self.strategy)
        self.checkpoints = CheckpointManager(self.run_dir, self.comm, self.strategy, train.keep_checkpoints,
                                             layout=self.strategy.layout(run.optimizer, self.env.local_world_size))

    def last_checkpoint_step(self) -> int | None:
        """The newest complete checkpoint's step (what a rerun resumes from), None when none."""
        newest = list_checkpoints(RunDir(self.run_dir).checkpoints)
        return int(newest[0].name.split("_")[1]) if newest else None

    # ----------------------------------------------------------------- pieces
    def train_step(self, step: int) -> torch.Tensor:
        micro_batches = self.order.indices_for_step(step)
        loss_sum = torch.zeros((), device=self.device)
        for i, indices in enumerate(micro_batches):
            tokens = self.data.train.batch(indices).to(self.device, non_blocking=True)
            last = i == len(micro_batches) - 1
            with (contextlib.nullcontext() if last else self.strategy.no_sync(self.model)), self.autocast:
                loss = next_token_loss(self.model, tokens, loss=self.loss)
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        # a strategy whose method clips otherwise (DES-LOC: per coordinate) opts out
        if self.run.train.max_grad_norm > 0 and self.strategy.clips_global_norm:
            self.strategy.clip_grad_norm(self.model, self.run.train.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / len(micro_batches)

    def validate(self) -> float:
        """Mean next-token loss over the fixed validation slice, across all ranks."""
        totals = torch.tensor(self.validation_totals(), dtype=torch.float64, device=self.comm.control_device)
        self.comm.all_reduce(totals, purpose="control")
        return float(totals[0] / totals[1])

    @torch.no_grad()
    def validation_totals(self) -> tuple[float, float]:
        """This rank's share of the validation slice: (summed next-token loss, tokens).

        Every rank runs the same number of forwards: under FSDP (FlexDeMo) each forward is a
        collective, and the ``[rank::W]`` split leaves some ranks one instance short. A rank
        out of instances runs a forward on a batch it does not count."""
        self.model.eval()
        micro_batch = self.run.train.micro_batch_size
        batches = validation_batches(len(self.data.val), self.run.train.eval_instances, micro_batch,
                                     self.comm.rank, self.comm.world_size)
        nll_sum, count = 0.0, 0
        for indices, counted in batches:
            tokens = self.data.val.batch(indices).to(self.device)
            with self.autocast:
                nll = next_token_loss(self.strategy.unwrap(self.model), tokens, "sum", self.loss)
            if counted:
                nll_sum, count = nll_sum + nll.item(), count + tokens[:, 1:].numel()
        self.model.train()
        return nll_sum, float(count)

    # ------------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        """Train to ``train.max_steps`` (or a stop request); a collective that fails because peers
        are gone raises :class:`~lowcomm.train.peers.PeersLost` naming them."""
        with self.peers.watch(self.last_checkpoint_step):
            return self._fit()

    def _fit(self) -> TrainResult:
        run, train = self.run, self.run.train
        restored = self.restore()
        start = restored.step if restored else 0
        if self.group is not None:  # ready to train: the other groups' quorums may wait for this one
            self.group.join(run.cluster.collective_timeout_s)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            where = restored.describe() if restored else "starting"
            workers = (f"{self.comm.world_size} workers" if self.group is None else
                       f"replica group {self.group.replica} of {self.group.replicas}"
                       + (f", {self.comm.world_size} ranks" if self.comm.world_size > 1 else "") + " (torchft)")
            print(f"[lowcomm] {self.record_name}: {where}; {self.n_params:,} params, {workers} "
                  f"on {self.device.type}, data {self.data.description}", flush=True)
        writer = MetricsWriter(self.run_dir, enabled=self.is_main, wandb_cfg=run.wandb, run_name=self.record_name,
                               config=run.raw, resume_step=start if restored else None)
        if restored and restored.elastic_rule:
            writer.event(start, "resume", world_size=self.world_size if self.learner is not None else self.comm.world_size,
                         written_by=restored.written_by,
                         rule=restored.elastic_rule)
        # (under torchft group 0's progress stands for the run's; every group has its own record)
        progress = Progress(train.max_steps, start, enabled=self.is_main and self.shard == 0)
        tokens_per_step = train.global_batch_size * train.seq_len
        window_t0, window_steps, compute_s = self.clock(), 0, 0.0
        window_aside = 0.0  # validation and checkpoint time inside the logging window: not the steps'
        preempted, val_loss, divergence, stop_signal = False, None, None, None
        agreement = BoundaryAgreement(self.comm, self.strategy.report_lag(self.strategy.cfg))
        self.model.train()
        self._tell_stop("begin")  # from here a stop signal waits for a step boundary
        step = start
        steps = Steps(start, train.max_steps)
        for step in steps:
            lr = apply_lr(self.optimizer, lr_multiplier(step, train.warmup_steps, train.max_steps, train.alpha_f))
            t0 = self.clock()
            if self.group is not None:
                self.group.stepping = step + 1
            with self.slowdown.step():  # (a rank of cluster.slow_ranks takes longer, for real)
                loss = self.train_step(step)
            if self.group is not None:
                step = self._replica_events(writer, steps, step)
            window_steps += 1
            done = step + 1
            local = float(loss)  # the step's clock has waited for the device already
            # a stop at the last step is moot: the run finishes and writes its summary
            asked = self.should_stop is not None and bool(self.should_stop())
            due = bool((train.checkpoint_every and done % train.checkpoint_every == 0) or done == train.max_steps)
            here = Boundary(done, local, requested=asked and done < train.max_steps, acceptable=self._finite(local),
                            lr=lr, logged=done % train.log_every == 0 or done == train.max_steps,
                            signum=getattr(self.should_stop, "received", None) if asked else None)
            if here.logged:
                elapsed = self.clock() - window_t0 - window_aside
                here.record.update({"opt/lr": lr, "perf/tokens_per_s": tokens_per_step * window_steps / elapsed,
                                    "perf/step_s": elapsed / window_steps})
                in_flight = self.comm.meter.take_in_flight_s()
                if in_flight > 0:  # asynchronous collectives in flight while this rank computed
                    here.record["perf/in_flight_s"] = in_flight / window_steps
                window_t0, window_steps, window_aside = self.clock(), 0, 0.0
            # the step's time is everything but the validation forwards and the checkpoint: the
            # agreement's waits are the step's, since where an exchange is still in flight on the
            # link they share they wait behind its bytes
            excluded = 0.0
            if (train.eval_every and done % train.eval_every == 0) or done == train.max_steps:
                t_val = self.clock()
                here.validation = self.validation_totals()
                excluded = self.clock() - t_val
                window_aside += excluded
                if self.data.bayes_floor is not None:
                    here.record["val/bayes_floor"] = self.data.bayes_floor
            here.record.update(self.comm.meter.end_step())
            agreed = agreement.submit(here, now=due)
            stop = any(a.stop for a in agreed) and done < train.max_steps
            if stop or any(a.diverged for a in agreed):
                agreed += agreement.drain()  # every rank leaves here: read what is still in flight
            if stop:  # SIGTERM if any boundary read here carries it (a later one too, once drained)
                signals = {a.signum for a in agreed if a.stop}
                stop_signal = signal.SIGTERM if signal.SIGTERM in signals else signal.SIGINT
            first_diverged = next((i for i, a in enumerate(agreed) if a.diverged), None)
            for a in agreed[:first_diverged]:  # what came before a divergence is logged
                if not (a.boundary.logged or a.boundary.validation is not None):
                    continue
                record = a.record()
                writer.log(a.step, record)
                if a.val_loss is not None:
                    val_loss = a.val_loss
                    progress.last_val = f" | val {val_loss:.4f}" + (
                        f" (floor {self.data.bayes_floor:.4f})" if self.data.bayes_floor is not None else "")
                if a.boundary.logged:
                    progress.report(a.step - 1, a.mean_loss, record["comm/cum_payload_MB"],
                                    record["perf/tokens_per_s"])
            saving = due or stop
            diverged = None if first_diverged is None else agreed[first_diverged].boundary
            reason = None if diverged is None else self._divergence(diverged.loss)
            if saving and diverged is None and self.comm.agree(not self._parameters_finite()):
                diverged, reason = here, "the parameters are not finite after the update"
            compute_s += self.clock() - t0 - excluded
            if stop or diverged is not None or done == train.max_steps:
                self._leaving()
            if diverged is not None:
                divergence = {"step": diverged.step, "reason": reason, "lr": diverged.lr,
                              "last_checkpoint": next((c.name for c in list_checkpoints(self.checkpoints.root)), None)}
                break
            if saving:
                t_save = self.clock()
                self.checkpoints.save(done, self.model, self.optimizer, consumed=done * train.global_batch_size)
                window_aside += self.clock() - t_save
            if stop:
                preempted = True
                break
        # a learner leaves its synchronizer (the merges of its last offers come to it first)
        self.strategy.finish(self.optimizer)
        if divergence is not None:
            summary = {**self._summary(done, None, compute_s, start), "diverged": divergence}
            if self.is_main:
                write_json_atomic(RunDir(self.run_dir).summary, summary, allow_nan=False)
                print(divergence_line(self.run_dir, divergence), flush=True)
            writer.close()
            return TrainResult(self.run_dir, done, False, summary, diverged=divergence)
        final_step = step + 1 if train.max_steps > start else start
        if val_loss is None and not preempted:
            # restarted from the final checkpoint (killed before summary.json was written)
            val_loss = self.validate()
        summary = self._summary(final_step, val_loss, compute_s, start)
        if self.is_main and not preempted:
            write_json_atomic(RunDir(self.run_dir).summary, summary, allow_nan=False)
        writer.close()
        return TrainResult(self.run_dir, final_step, preempted, summary,
                           stop_signal=stop_signal if preempted else None)

    def restore(self) -> Restored | None:
        """The newest usable checkpoint, restored. A learner that has none of its own, in a run whose
        learners 0 ... k - 1 left some, resumes from learner (its index mod k)'s
        (:meth:`~lowcomm.strategies.learners.LearnerStrategy.elastic_rule`)."""
        if self.learner is None:
            return self.checkpoints.restore_latest(self.model, self.optimizer)
        # as the synchronizer found them before this launch's learners started (a peer may be
        # writing newer checkpoints by now)
        recorded = synchronizer_resumed_from(self.run.run_dir)
        resumed_from, written = recorded if recorded else (None, learners_with_checkpoints(self.run.run_dir))
        source = self.learner if self.learner < written or not written else self.learner % written
        at_most = None if source == self.learner else resumed_from
        restored = self.checkpoints.restore_latest(self.model, self.optimizer, at_most=at_most,
                                                   root=RunDir(learner_dir(self.run, source)).checkpoints)
        if restored is not None and written != self.world_size:
            restored.written_by, restored.elastic_rule = written, self.strategy.elastic_rule(written)
        return restored

    def _replica_events(self, writer: MetricsWriter, steps: Steps, step: int) -> int:
        """A replica group's step ends: its membership changes go to its record, and after a heal
        the loop goes on from the peer's step (returned as the step that just ended)."""
        healed = self.group.take_heal()
        if healed is not None:
            step = healed - 1
            steps.resume_after(step)
            if self.is_main:
                print(f"[lowcomm] {self.record_name}: rejoined and healed from a live peer at step {healed}",
                      flush=True)
        for event in self.group.take_events():
            writer.event(step + 1, event.pop("event"), replica=self.group.replica, **event)
        return step

    @property
    def record_name(self) -> str:
        """The run's name, and under torchft the replica group's (its records are its own)."""
        return self.run.run_name if self.group is None or self.group.replica == 0 else \
            f"{self.run.run_name}-replica{self.group.replica}"

    def _leaving(self) -> None:
        """Tell ``should_stop`` (where it wants to know: ``honour()``, a
        :class:`~lowcomm.train.stop.StopFlag`) that the loop has reached the boundary it leaves
        at: a SIGTERM's deadline counts to here, not to the boundary that read the request."""
        self._tell_stop("honour")

    def _tell_stop(self, event: str) -> None:
        """Call ``should_stop``'s ``begin()`` or ``honour()`` where it has one (a
        :class:`~lowcomm.train.stop.StopFlag`; a plain callable does not)."""
        method = getattr(self.should_stop, event, None)
        if method is not None:
            method()

    # ------------------------------------------------------------ divergence
    @property
    def divergence_bound(self) -> float | None:
        """The loss above which a run has diverged: ``train.divergence_factor`` x ln(vocabulary
        size), a multiple of a uniform guess's loss (None: only a non-finite loss)."""
        factor = self.run.train.divergence_factor
        return None if factor is None else factor * math.log(self.run.model.vocab_size)

    def _finite(self, loss: float) -> bool:
        bound = self.divergence_bound
        return math.isfinite(loss) and (bound is None or loss <= bound)

    def _divergence(self, local: float) -> str:
        """What diverged, over all ranks (a collective, on the step that diverged only)."""
        worst = torch.tensor([0.0 if math.isfinite(local) else 1.0, local if math.isfinite(local) else -math.inf],
                             dtype=torch.float64, device=self.comm.control_device)
        self.comm.all_reduce(worst, op="max", purpose="control")
        if worst[0] > 0:
            return "the training loss is not finite"
        return (f"the training loss {worst[1].item():.4g} is above {self.divergence_bound:.4g} "
                f"(train.divergence_factor {self.run.train.divergence_factor:g} x ln(vocabulary size))")

    def _parameters_finite(self) -> bool:
        """Whether this rank's parameters (its shards under FSDP) are all finite: checked before
        every checkpoint, so that none is written from a diverged state."""
        return all(bool(torch.isfinite(p.detach()).all()) for p in self.model.parameters())

    def _summary(self, final_step: int, val_loss: float | None, compute_s: float, start: int) -> dict:
        meter, train = self.comm.meter, self.run.train
        steps = max(meter.steps_closed, 1)
        ran = max(final_step - start, 1)
        tokens_per_s = train.global_batch_size * train.seq_len * ran / max(compute_s, 1e-9)
        return {
            "run_name": self.run.run_name,
            "experiment": self.run.experiment,
            "model": self.run.model.name,
            "optimizer": self.run.optimizer_name,
            "compression": self.run.compression.get("name", "none"),
            "world_size": self.world_size,
            **({"fault_tolerance": "torchft", "replica": self.group.replica,
                "heal_tx_MB": meter.cumulative_bytes("tx", purpose="heal") / 1e6,
                "heal_rx_MB": meter.cumulative_bytes("rx", purpose="heal") / 1e6} if self.group is not None else {}),
            # a learner's whole exchange with its synchronizer, its hellos and goodbyes too
            **({"learner": self.learner, "sent_bytes": sum(meter.cumulative_bytes("tx", purpose=p) for p in ("data", "control")),
                "received_bytes": sum(meter.cumulative_bytes("rx", purpose=p) for p in ("data", "control"))}
               if self.learner is not None else {}),
            "parameters": self.n_params,
            "steps": final_step,
            "tokens": final_step * train.global_batch_size * train.seq_len,
            "final_val_loss": val_loss,
            "bayes_floor": self.data.bayes_floor,
            "payload_MB_per_step": meter.cumulative_bytes("payload") / 1e6 / steps,
            # the link between nodes when each node is one sharding group (FlexDeMo's "inter"
            # scope); a strategy without sharding groups sends everything over it
            "inter_node_payload_MB_per_step": meter.cumulative_bytes(
                "payload", scope="inter" if "inter" in meter.scopes() else None) / 1e6 / steps,
            "tx_MB_per_step": meter.cumulative_bytes("tx") / 1e6 / steps,
            "cum_payload_MB": meter.cumulative_bytes("payload") / 1e6,
            # the largest payload of a single step: what a link must carry at once
            "comm/peak_MB": meter.peak_step_payload / 1e6,
            "tokens_per_s": tokens_per_s,
            **self._utilisation(tokens_per_s),
            **self._unequal_workers(),
            **self._unequal_links(),
        }

    def _unequal_links(self) -> dict:
        """With shaped links: the settings, each node's rate in bits/s, and who shaped them."""
        cluster = self.run.cluster
        if self.node_links is None:
            return {}
        return {"link_rate": cluster.link_rate, "slow_link_nodes": list(cluster.slow_link_nodes),
                "slow_link_rate": cluster.slow_link_rate, "node_link_bps": self.node_links,
                "links_shaped_by": os.environ.get(LINKS_SHAPED_ENV)}

    def _unequal_workers(self) -> dict:
        """With ``cluster.slow_ranks``: which ranks, the factor, and the seconds each rank slept to
        compute that much slower (a control collective, on every rank)."""
        cluster = self.run.cluster
        if not cluster.slow_ranks or cluster.slowdown == 1:
            return {}
        stretched = torch.zeros(self.comm.world_size, dtype=torch.float64, device=self.comm.control_device)
        stretched[self.comm.rank] = self.slowdown.stretched_s  # (under torchft: this group's alone)
        self.comm.all_reduce(stretched, purpose="control")
        return {"slow_ranks": list(cluster.slow_ranks), "slowdown": cluster.slowdown,
                "stretched_s": [round(float(value), 3) for value in stretched]}

    def _utilisation(self, tokens_per_s: float) -> dict[str, float]:
        """FLOPs per token by both conventions (:class:`lowcomm.models.FlopsPerToken`) and, on a
        GPU whose bf16 peak is known, the model FLOP utilisation of each: FLOPs per token x
        tokens/s over every rank's peak."""
        flops = flops_per_token(self.run.model, self.n_params, self.run.train.seq_len)
        out = {"flops_per_token_6N": flops.six_n, "flops_per_token_olmo_core": flops.olmo_core}
        peak = bf16_peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        if peak is not None:
            out["peak_flops_per_rank"] = peak
            out["mfu_6N"] = flops.six_n * tokens_per_s / (self.world_size * peak)
            out["mfu_olmo_core"] = flops.olmo_core * tokens_per_s / (self.world_size * peak)
        return out

    def close(self) -> None:
        """Tear down in an order that cannot deadlock. Gloo's worker threads take the GIL to
        release a finished collective's tensors; a process group destroyed by the last Python
        reference to it (DDP's reducer, when the model is garbage-collected) joins those threads
        while holding the GIL. So: drain the queue, drop the model and optimizer while the group
        is still registered, give the threads the GIL once, then destroy the group."""
        if self.group is not None:
            self.group.close()
        if self.learner is not None:  # a learner made no process group (one there is its caller's)
            self.peers.close()
            return
        if not dist.is_initialized():
            return
        self.comm.barrier()
        self.peers.close()
        self.model = self.optimizer = self.strategy = self.checkpoints = None
        gc.collect()
        time.sleep(0.01)  # releases the GIL: gloo's threads finish releasing the last works
        dist.destroy_process_group()


class Steps:
    """The loop's steps, ``start`` ... ``stop - 1``, which a replica group's heal can move on:
    after :meth:`resume_after` the next step is the one after the peer's."""

    def __init__(self, start: int, stop: int):
        self._next, self._stop = start, stop

    def __iter__(self):
        while self._next < self._stop:
            step = self._next
            self._next += 1
            yield step

    def resume_after(self, step: int) -> None:
        self._next = step + 1


def train(run: RunConfig, env: DistEnv, should_stop: Callable[[], bool] | None = None) -> TrainResult:
    trainer = Trainer(run, env, should_stop)
    result = trainer.fit()
    trainer.close()  # only after success: its barrier would wait forever for a failed rank
    return result
