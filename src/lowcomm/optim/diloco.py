"""DiLoCo (Douillard et al. 2023), optionally with a compressed pseudo-gradient and error
feedback (MuLoCo, Thérien et al. 2025).

Every worker runs ``sync_every`` (H) steps of its own inner optimizer, then all workers
synchronise::

    Delta_i = theta_global - theta_i                    # pseudo-gradient of worker i
    Delta   = mean_i Delta_i                            # all-reduce (uncompressed), or:
        E_i <- beta E_i + Delta_i;  D_i = C(E_i);  E_i <- E_i - decode(D_i)
        Delta = mean_i decode(D_i)                      # exchange of the payloads D_i
    b <- mu b + Delta                                   # outer SGD, Nesterov momentum
    theta_global <- theta_global - lr_out (Delta + mu b)
    theta_i <- theta_global                             # every worker restarts from it

The outer step is ``torch.optim.SGD(lr=lr_out, momentum=mu, dampening=0, nesterov=True)``
applied to theta_global with gradient Delta (``nesterov=False``: theta -= lr_out b). With a
constant outer lr it equals MuLoCo's form u <- mu u + lr_out Delta; theta <- theta - mu u -
lr_out Delta (u = lr_out b). The compressed branch is MuLoCo's Algorithm 1: the accumulator
takes Delta_i itself. The official MuLoCo code also multiplies the outer lr into the
accumulator, so lr_out enters twice; we follow the paper.

The exchange of compressed payloads (``exchange``):

- ``all_reduce`` (default) for a quantizer (a codec that encodes every entry, ``reducible``):
  the quantized all-reduce (:meth:`lowcomm.comm.Communicator.all_reduce_quantized`), torchft's
  ``allreduce_quantized``: C is applied per chunk of each tensor (W chunks, each with its own
  statistics), rank j reduces chunk j in float32 and re-quantizes it, and Delta is the decoded
  re-quantized mean, the same on every worker. MuLoCo's code simulates this exchange
  (``simulate_quantization_after_reduce``) with whole-tensor statistics both times; per-chunk
  statistics are what an implementation that sends rank j only chunk j has. About 2 (W-1)/W x the payload per worker, like a ring all-reduce.
  The re-quantization of the mean is not fed back: E_i sees only the worker's own C (MuLoCo's
  ``_save_grads`` subtracts the local reconstruction only). A sparsifier (top-k, DCT top-k)
  all-gathers whatever ``exchange`` says: its supports differ per worker (MuLoCo's code turns
  the simulated re-quantization off for top-k).
- ``all_gather``: every worker's payload to every worker, (W-1) x the payload each, and Delta
  the plain mean of the W decoded payloads (MuLoCo's Algorithm 1 as first read here).

Inner optimizer states stay local and are never reset. MuLoCo is this class configured with
a Muon inner optimizer (``inner`` is any optimizer, or a factory building one over the
parameters), a ``compressor`` and an ``error_feedback`` beta.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.comm.meter import WireBytes, ring_all_gather_bytes, ring_all_reduce_bytes
from lowcomm.comm.quantized import encoded_sizes, quantized_all_reduce_bytes, unstacked
from lowcomm.compress.base import Codec, Payload
from lowcomm.compress.error_feedback import ErrorFeedback
from lowcomm.optim.args import Args, one_of_error

__all__ = ["EXCHANGES", "DiLoCo", "DiLoCoArgs", "OuterArgs", "PendingMean", "all_gather_payloads",
           "all_gather_stacked", "reduces_quantized", "sync_traffic"]

EXCHANGES = ("all_reduce", "all_gather")

InnerOptimizer = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def all_gather_payloads(comm: Communicator, payloads: Sequence[Payload]) -> list[list[Payload]]:
    """All-gather one payload per tensor from every worker: ``gathered[rank][i]`` (the rows of
    :func:`all_gather_stacked`'s payloads)."""
    stacked = all_gather_stacked(comm, payloads)
    rows = [tensor.shape[0] for payload in stacked for tensor in payload.tensors.values()]
    senders = rows[0] if rows else comm.world_size
    return [[unstacked(payload, rank) for payload in stacked] for rank in range(senders)]


def all_gather_stacked(comm: Communicator, payloads: Sequence[Payload]) -> list[Payload]:
    """All-gather one payload per tensor from every worker, as one payload per tensor whose
    tensors carry a leading dimension of the W workers, in rank order: what a codec decodes in
    one pass (:meth:`~lowcomm.compress.chunked_topk.ChunkedTopK.decode_gathered`).

    The payloads' tensors are concatenated per dtype into one flat buffer, gathered into one
    ``W x`` buffer, so a synchronisation costs one all-gather per wire dtype (e.g. uint8 codes
    and float32 tables) rather than one per tensor; the metered payload is exactly the sum of
    ``Payload.nbytes``. Every worker must pass payloads of the same shapes (codecs size them
    from the tensor's shape only). ``meta`` is rebuilt locally, never sent.
    """
    world = comm.world_size
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in payloads]
    for entries in _segments(payloads).values():
        flat = _flat(payloads, entries)
        buffer = flat.new_empty(world * flat.numel())  # flat: gloo wants the output one-dimensional
        comm.all_gather_into_tensor(buffer, flat)
        # (between replica groups, a group that has just healed contributes no row)
        buffer = comm.contributions(buffer.view(world, -1))
        offset = 0
        for index, key, shape in entries:
            piece = buffer[:, offset:offset + shape.numel()]
            gathered[index][key] = piece.unflatten(1, shape) if len(shape) else piece.view(-1)
            offset += shape.numel()
    return [Payload(tensors={key: tensors[key] for key in payload.tensors}, meta=payload.meta)
            for payload, tensors in zip(payloads, gathered, strict=True)]


Segment = list[tuple[int, str, torch.Size]]  # (payload index, tensor key, shape) of one wire dtype


def _segments(payloads: Sequence[Payload]) -> dict[torch.dtype, Segment]:
    """The payloads' tensors grouped by dtype, in a fixed order: one flat buffer per dtype."""
    segments: dict[torch.dtype, Segment] = {}
    for index, payload in enumerate(payloads):
        for key, tensor in payload.tensors.items():
            segments.setdefault(tensor.dtype, []).append((index, key, tensor.shape))
    return segments


def _flat(payloads: Sequence[Payload], entries: Segment) -> torch.Tensor:
    return torch.cat([payloads[index].tensors[key].reshape(-1) for index, key, _ in entries])


def _cut(buffers: Sequence[torch.Tensor], entries: Segment, gathered: list[list[Payload]]) -> None:
    """Every rank's flat buffer of one dtype cut back into its payloads' tensors."""
    sizes = [shape.numel() for _, _, shape in entries]
    for rank, buffer in enumerate(buffers):
        for (index, key, shape), piece in zip(entries, buffer.split(sizes), strict=True):
            gathered[rank][index].tensors[key] = piece.view(shape)


@dataclass
class PendingMean:
    """The worker mean of ``deltas`` on its way: :meth:`start` issues the exchange without
    blocking and :meth:`wait`, at the step that needs the mean, finishes it. Streaming DiLoCo's
    fragments and eager DiLoCo's outer gradients run behind inner steps this way.

    The exchange is the one :func:`sync_traffic` counts: a dense all-reduce (``compressor``
    None: the mean lands in ``deltas``), the quantized all-reduce (the decoded re-quantized mean,
    in ``deltas``; its all-to-all runs in the background, its all-gather in :meth:`wait`) or an
    all-gather of every worker's payload, each worker taking the float32 mean of the W decoded
    payloads (new tensors of ``deltas``' dtype). A mean known already (restored from a
    checkpoint) is :meth:`done`.
    """

    deltas: list[torch.Tensor]
    compressor: Codec | None = None
    works: list[Any] = field(default_factory=list)
    # the all-gather's: this rank's payloads and, per wire dtype, the gathered buffers, work and layout
    payloads: list[Payload] = field(default_factory=list)
    gathers: list[tuple[list[torch.Tensor], Any, Segment]] = field(default_factory=list)
    world_size: int = 1
    mean: list[torch.Tensor] | None = None

    @classmethod
    def start(cls, comm: Communicator, deltas: list[torch.Tensor], compressor: Codec | None,
              exchange: str) -> PendingMean:
        pending = cls(deltas, compressor, world_size=comm.world_size)
        if compressor is None:
            pending.works = [comm.all_reduce(delta, op="avg", async_op=True) for delta in deltas]
        elif reduces_quantized(exchange, compressor):
            pending.works = [comm.all_reduce_quantized(deltas, compressor, async_op=True)]
        else:
            pending.payloads = [compressor.encode(delta) for delta in deltas]
            for entries in _segments(pending.payloads).values():
                buffers, work = comm.all_gather(_flat(pending.payloads, entries), async_op=True)
                pending.gathers.append((buffers, work, entries))
        return pending

    @classmethod
    def done(cls, mean: list[torch.Tensor]) -> PendingMean:
        return cls(list(mean), mean=list(mean))

    def wait(self) -> list[torch.Tensor]:
        """The worker mean (waited for once, then kept)."""
        if self.mean is not None:
            return self.mean
        for work in self.works:
            work.wait()
        if not self.gathers:
            self.mean = self.deltas
        else:
            gathered = [[Payload(tensors={}, meta=p.meta) for p in self.payloads] for _ in range(self.world_size)]
            for buffers, work, entries in self.gathers:
                work.wait()
                _cut(buffers, entries, gathered)
            self.mean = []
            for index, reference in enumerate(self.deltas):
                total = torch.zeros(reference.shape, dtype=torch.float32, device=reference.device)
                for worker in gathered:
                    total += self.compressor.decode([worker[index]]).float()
                self.mean.append(total.div_(len(gathered)).to(reference.dtype))
        self.works, self.payloads, self.gathers = [], [], []
        return self.mean


def payload_nbytes(compressor: Codec | None, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes one worker sends for one tensor of ``shape``: dense, or ``compressor``'s payload."""
    shape = torch.Size(shape)
    if compressor is None:
        return shape.numel() * dtype.itemsize
    return compressor.payload_nbytes(shape, dtype)


def reduces_quantized(exchange: str, compressor: Codec | None) -> bool:
    """Whether payloads of ``compressor`` go through the quantized all-reduce: ``exchange`` asks
    for it and the codec encodes every entry (a quantizer); a sparsifier is all-gathered."""
    return compressor is not None and exchange == "all_reduce" and bool(getattr(compressor, "reducible", False))


def sync_traffic(
    shapes: Iterable[torch.Size | tuple[int, ...]], compressor: Codec | None, exchange: str, world_size: int,
    dtype: torch.dtype = torch.float32,
) -> WireBytes:
    """The bytes one worker's synchronisation of tensors of ``shapes`` costs at world size W,
    averaged over the workers: a dense ring all-reduce, the quantized all-reduce (its payload is
    W chunks per tensor, each with its own side data; its all-to-all half is ``direct``) or an
    all-gather."""
    shapes = [torch.Size(shape) for shape in shapes]
    if reduces_quantized(exchange, compressor):
        return quantized_all_reduce_bytes(*encoded_sizes(compressor, shapes, world_size, dtype), world_size)
    payload = sum(payload_nbytes(compressor, shape, dtype) for shape in shapes)
    formula = ring_all_reduce_bytes if compressor is None else ring_all_gather_bytes
    tx, rx = formula(payload, world_size)
    return WireBytes(float(payload), float(tx), float(rx))


def outer_direction_(direction: torch.Tensor, momentum: torch.Tensor | None, beta: float, nesterov: bool) -> None:
    """The outer optimizer's SGD-with-momentum direction, in place: ``momentum = beta momentum +
    direction``, then ``direction + beta momentum`` (Nesterov) or the momentum itself; without
    momentum the direction is the mean pseudo-gradient as it is."""
    if momentum is None:
        return
    momentum.mul_(beta).add_(direction)
    if nesterov:
        direction.add_(momentum, alpha=beta)
    else:
        direction.copy_(momentum)


def outer_step_errors(sync_every: int, outer_lr: float, outer_momentum: float) -> list[str]:
    """The rules of an outer loop's period and SGD step (every DiLoCo variant's, NoLoCo's)."""
    errors = []
    if sync_every < 1:
        errors.append(f"sync_every must be >= 1, got {sync_every}")
    if not outer_lr > 0:
        errors.append(f"outer_lr must be > 0, got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        errors.append(f"outer_momentum must be in [0, 1), got {outer_momentum}")
    return errors


@dataclass(kw_only=True)
class OuterArgs(Args):
    """The outer loop every DiLoCo variant shares (DiLoCo, MuLoCo, SparseLoCo).

    sync_every: H, the number of inner steps between synchronisations.
    outer_lr, outer_momentum: the outer SGD (the outer lr is not scheduled).
    error_feedback: the accumulator decay beta (None: no accumulator; what the codec drops is
        lost). Needs a compressor.
    """

    sync_every: int
    outer_lr: float
    outer_momentum: float
    error_feedback: float | None

    def errors(self) -> list[str]:
        errors = super().errors() + outer_step_errors(self.sync_every, self.outer_lr, self.outer_momentum)
        if self.error_feedback is not None and not 0 <= self.error_feedback <= 1:
            errors.append(f"error_feedback must be null or in [0, 1], got {self.error_feedback}")
        return errors


@dataclass(kw_only=True)
class DiLoCoArgs(OuterArgs):
    """DiLoCo's arguments (and MuLoCo's, which is DiLoCo with Muon inside); defaults in
    ``configs/optimizer/diloco.yaml``. ``nesterov``: Nesterov outer momentum. ``exchange``: how
    a quantized pseudo-gradient travels, ``all_reduce`` or ``all_gather`` (module doc)."""

    config_name: ClassVar[str] = "diloco"

    nesterov: bool
    exchange: str

    def errors(self) -> list[str]:
        return super().errors() + one_of_error("exchange", self.exchange, EXCHANGES)


class DiLoCo(torch.optim.Optimizer):
    """DiLoCo / MuLoCo around any inner optimizer.

    Args:
        params: the parameters; every worker must start from identical values.
        inner: the inner optimizer over exactly these parameters, or a callable building it
            from the parameter list. Its ``param_groups`` are this optimizer's, so an LR
            schedule drives the inner learning rate.
        args: :class:`DiLoCoArgs` (the outer loop).
        compressor: a codec for the pseudo-gradient (None: dense all-reduce in the parameters'
            dtype), exchanged as ``args.exchange`` says.
        comm: the workers' Communicator (None: the default process group, or one process).

    Bytes on the wire: nothing between synchronisations; at each one, the parameters' size
    (dense) or the sum of the payloads (compressed). ``amortized_payload_bytes`` gives the
    per-step average of whole-tensor payloads (what the all-gather sends); the quantized
    all-reduce encodes W chunks per tensor, each with its own side data, whose bytes at W are
    :func:`sync_traffic`'s.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        inner: InnerOptimizer,
        args: DiLoCoArgs,
        *,
        compressor: Codec | None = None,
        comm: Communicator | None = None,
    ):
        params = list(params)
        args.check()
        if args.error_feedback is not None and compressor is None:
            raise ValueError("error_feedback needs a compressor: uncompressed averaging drops nothing")
        defaults = dict(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, nesterov=args.nesterov,
                        sync_every=args.sync_every)
        super().__init__(params, defaults)

        self.inner = inner(params) if callable(inner) else inner
        inner_ids = {id(p) for group in self.inner.param_groups for p in group["params"]}
        if inner_ids != {id(p) for p in params}:
            raise ValueError("the inner optimizer must be built over exactly the parameters given to DiLoCo")
        # The schedule and anything else reading param_groups (lr logging) see the inner groups.
        self.param_groups = self.inner.param_groups

        self.outer_lr = args.outer_lr
        self.outer_momentum = args.outer_momentum
        self.nesterov = args.nesterov
        self.sync_every = args.sync_every
        self.exchange = args.exchange
        self.compressor = compressor
        self.comm = comm if comm is not None else Communicator()
        self._feedback = ErrorFeedback(compressor, args.error_feedback) if args.error_feedback is not None else None

        self._params = params
        with torch.no_grad():
            self._global = [p.detach().clone() for p in params]
        self._momentum = [torch.zeros_like(p) for p in self._global] if args.outer_momentum > 0 else None
        self._error = [torch.zeros_like(p) for p in self._global] if self._feedback is not None else None
        self._sent: list[Payload] | None = None  # this worker's payloads of the exchange in progress
        self.local_step = 0

    # ------------------------------------------------------------------ stepping
    def step(self, closure: Callable[[], float] | None = None):
        """One inner step; every ``sync_every``-th call also synchronises the workers."""
        loss = self.inner.step(closure)
        self.local_step += 1
        if self.local_step % self.sync_every == 0:
            self._synchronise()
        return loss

    @torch.no_grad()
    def _synchronise(self) -> None:
        # Every worker restarts from the global copy, so a local parameter is dead once its
        # pseudo-gradient is known: its storage holds Delta_i, then the worker mean Delta,
        # then the outer update direction. No model-sized scratch buffer is needed.
        # (Between replica groups that may fail, a quorum forms first; a group that rejoins
        # behind is given a live peer's state there, its Delta then zero: lowcomm.comm.ft.)
        self.comm.begin_exchange()
        for local, global_ in zip(self._params, self._global, strict=True):
            local.sub_(global_).neg_()
        if self.compressor is None:
            works = [self.comm.all_reduce(delta, op="avg", async_op=True) for delta in self._params]
            for work in works:
                work.wait()
        else:
            self._average_compressed()
        if not self.comm.commit():  # a peer died inside the exchange: every group drops it alike
            for local, global_ in zip(self._params, self._global, strict=True):
                local.copy_(global_)
            self._keep_unsent()
            return
        self._sent = None
        for index, (local, global_) in enumerate(zip(self._params, self._global, strict=True)):
            direction = local  # the mean Delta, turned into the outer update direction in place
            momentum = self._momentum[index] if self._momentum is not None else None
            outer_direction_(direction, momentum, self.outer_momentum, self.nesterov)
            global_.sub_(direction, alpha=self.outer_lr)
            local.copy_(global_)

    def _average_compressed(self) -> None:
        """Replace each Delta_i (held in the parameter) by the worker mean of C(E_i) (or of
        C(Delta_i) without error feedback), exchanged as :attr:`exchange` says."""
        if reduces_quantized(self.exchange, self.compressor):
            if self._feedback is not None:
                sources = [self._feedback.accumulate(error, delta)
                           for error, delta in zip(self._error, self._params, strict=True)]
            else:
                sources = self._params
            self.comm.all_reduce_quantized(sources, self.compressor, out=self._params,
                                           residual=self._feedback is not None)
            return
        gathered = self._gather_payloads()
        for index, delta in enumerate(self._params):
            # Decode one payload at a time: Algorithm 1's plain mean over workers, whatever a
            # codec's own multi-payload decode does (DeMo-style codecs average over senders).
            delta.zero_()
            for worker_payloads in gathered:
                delta.add_(self.compressor.decode([worker_payloads[index]]))
            delta.div_(len(gathered))  # the workers that sent (all, bar a replica group just healed)

    def _gather_payloads(self) -> list[list[Payload]]:
        """Encode each Delta_i (through the error-feedback accumulator, if any) and all-gather
        the payloads: ``gathered[rank][i]``."""
        return all_gather_payloads(self.comm, self._encoded())

    def _encoded(self) -> list[Payload]:
        """Each Delta_i encoded, through the error-feedback accumulator if any (which then keeps
        only the residual: :meth:`_keep_unsent` gives it back what was sent, where an exchange
        is dropped)."""
        if self._feedback is not None:
            sent = [self._feedback.compress(error, delta) for error, delta in zip(self._error, self._params, strict=True)]
            self._sent = sent if self.comm.replica_groups else None  # (a fixed world never drops an exchange)
            return sent
        return [self.compressor.encode(delta) for delta in self._params]

    def _keep_unsent(self) -> None:
        """After a dropped exchange (between replica groups): the error-feedback accumulators
        take back what this worker's payloads carried, which no one applied."""
        if self._feedback is not None and self._sent is not None:
            for error, payload in zip(self._error, self._sent, strict=True):
                error.add_(self.compressor.decode([payload]))
        self._sent = None

    def forget_error_feedback(self) -> None:
        """Empty the error-feedback accumulators (a replica group that has taken a live peer's
        state: the peer's residual is the peer's to send)."""
        for error in self._error or []:
            error.zero_()

    # ------------------------------------------------------------------ checkpoint
    @property
    def at_outer_boundary(self) -> bool:
        """Has this worker just synchronised (or not stepped yet)? Its parameters are then its
        global copy."""
        return self.local_step % self.sync_every == 0

    def state_dict(self) -> dict[str, Any]:
        """This worker's state: inner state, global copy, outer momentum, error-feedback
        accumulators, the local step (which fixes where the next sync falls) and, between
        synchronisations, this worker's own parameters (they differ from rank 0's, which is all
        a checkpoint's model file holds). At an outer boundary they are the global copy, so
        they are left out (a model-sized tensor per worker less in each checkpoint) and
        :meth:`load_state_dict` restores them from it."""
        state = {
            "inner": self.inner.state_dict(),
            "local_step": self.local_step,
            "global_params": list(self._global),
            "outer_momentum": list(self._momentum) if self._momentum is not None else None,
            "error_feedback": list(self._error) if self._error is not None else None,
        }
        if not self.at_outer_boundary:
            state["local_params"] = [p.detach() for p in self._params]
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, mine in (
            ("global_params", self._global),
            ("outer_momentum", self._momentum),
            ("error_feedback", self._error),
        ):
            saved = state_dict[key]
            if (saved is None) != (mine is None) or (mine is not None and len(saved) != len(mine)):
                raise ValueError(f"DiLoCo state {key!r} does not match this optimizer's configuration")
            for target, source in zip(mine or [], saved or [], strict=True):
                target.copy_(source)
        self.local_step = int(state_dict["local_step"])
        if "local_params" in state_dict:
            for param, saved in zip(self._params, state_dict["local_params"], strict=True):
                param.copy_(saved)
        elif self.at_outer_boundary:  # the parameters are the global copy there (state_dict)
            for param, global_ in zip(self._params, self._global, strict=True):
                param.copy_(global_)
        # (neither: a checkpoint written before the local parameters were saved; they are the
        # model file's, as they were then)
        self.inner.load_state_dict(state_dict["inner"])
        # torch's load_state_dict gives the inner optimizer new param_group dicts; share them
        # again so the LR schedule keeps driving the inner lr after a resume.
        self.param_groups = self.inner.param_groups

    # ------------------------------------------------------------------ accounting
    @staticmethod
    def amortized_payload_bytes(
        shapes: Iterable[torch.Size | tuple[int, ...]],
        sync_every: int,
        compressor: Codec | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> float:
        """Average payload bytes per step and worker: one synchronisation's payload / H
        (uncompressed: numel * 4 / H for fp32 parameters)."""
        per_sync = sum(payload_nbytes(compressor, shape, dtype) for shape in shapes)
        return per_sync / sync_every
