"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512).

DiLoCo whose parameters are split into P fragments, each synchronised every H inner steps on
its own staggered schedule, with the exchange overlapped with the next tau inner steps and its
result mixed into the still-training local copy. With inner step count t (1, 2, ...), fragment
p (offset t_p = p * H // P) is **sent** after inner step t when t % H == t_p % H::

    Delta_p = theta_global_p - theta_p(t)          # outer gradient of fragment p, this worker
    start the exchange of Q(Delta_p)               # quantized all-reduce (or all-gather, or dense)

and **received** after inner step t + tau (the workers kept training on their own data)::

    Delta = mean over workers of decode(Q(Delta_p))          # accumulated in float32
    b <- mu b + Delta;  theta_global_p <- theta_global_p - lr_out (Delta + mu b)   # outer Nesterov SGD
    theta_p <- alpha theta_p(t + tau) + (1 - alpha) theta_global_p                 # mixing

The exchange (``exchange``) is torchft's quantized all-reduce by default
(:meth:`lowcomm.comm.Communicator.all_reduce_quantized`, which torchft's Streaming DiLoCo uses:
Q per chunk of each tensor, chunk j reduced in float32 on rank j and re-quantized, the reduced
chunks all-gathered; its all-to-all runs under the tau inner steps, the rest at the receive),
or an all-gather of every worker's Q(Delta_p), each worker taking the float32 mean of the W
decoded payloads (``all_gather``).

With P = 1, tau = 0 and alpha = 0 this is DiLoCo exactly. Bytes: each fragment's payload at the
step it is sent, so the per-step traffic is about 1/P of DiLoCo's burst at P times its rate: the
same amortised bytes, a P-fold lower peak.

Exchanges in flight are part of the state: :meth:`state_dict` waits for them and saves the
received mean (identical on every worker) with the step it is due, so a resume applies it at
the same step as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.compress.base import Codec
from lowcomm.optim.args import Args, one_of_error, raise_argument_errors
from lowcomm.optim.diloco import (
    EXCHANGES,
    InnerOptimizer,
    PendingMean,
    outer_direction_,
    payload_nbytes,
)

__all__ = ["StreamingDiLoCo", "StreamingDiLoCoArgs"]


@dataclass(kw_only=True)
class StreamingDiLoCoArgs(Args):
    """Streaming DiLoCo's arguments; defaults in ``configs/optimizer/streaming_diloco.yaml``.

    sync_every: H, the period of every fragment's synchronisation.
    overlap: tau, inner steps between a fragment's send and its receive (0: blocking).
    mixing: alpha, the share of the local copy kept when the global fragment arrives.
    outer_lr, outer_momentum, nesterov: the outer SGD.
    exchange: how a quantized outer gradient travels: ``all_reduce`` or ``all_gather`` (module doc).
    """

    config_name: ClassVar[str] = "streaming_diloco"

    sync_every: int
    overlap: int
    mixing: float
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    exchange: str

    def errors(self) -> list[str]:
        errors = super().errors() + one_of_error("exchange", self.exchange, EXCHANGES)
        if self.sync_every < 1:
            errors.append(f"sync_every must be >= 1, got {self.sync_every}")
        if self.overlap < 0 or (self.sync_every >= 1 and self.overlap >= self.sync_every):
            errors.append(f"overlap must be in [0, sync_every), got {self.overlap}")
        if not 0 <= self.mixing <= 1:
            errors.append(f"mixing must be in [0, 1], got {self.mixing}")
        if not self.outer_lr > 0:
            errors.append(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            errors.append(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        return errors


def fragment_offsets(num_fragments: int, sync_every: int) -> list[int]:
    """The inner step (mod ``sync_every``) after which each fragment's synchronisation starts:
    spread evenly over the period."""
    return [index * sync_every // num_fragments for index in range(num_fragments)]


def fragments_sent_at(step: int, num_fragments: int, sync_every: int) -> list[int]:
    """Fragments whose synchronisation starts after inner step ``step`` (1-based)."""
    return [index for index, offset in enumerate(fragment_offsets(num_fragments, sync_every))
            if step % sync_every == offset % sync_every]


def fewest_steps_between_sends(num_fragments: int, sync_every: int) -> int:
    """The fewest inner steps from one fragment's send to the next one's, over the cycle."""
    offsets = sorted(set(fragment_offsets(num_fragments, sync_every)))
    return min(later - earlier for earlier, later in zip(offsets, [*offsets[1:], offsets[0] + sync_every], strict=True))


def fragment_errors(num_fragments: int, sync_every: int) -> list[str]:
    """The rule on the number of fragments: one staggered offset per fragment in H steps."""
    if num_fragments < 1:
        return [f"num_fragments must be >= 1, got {num_fragments}"]
    if sync_every >= 1 and num_fragments > sync_every:
        return [f"num_fragments must be <= sync_every (one staggered offset per fragment), got "
                f"{num_fragments} > {sync_every}"]
    return []


@dataclass
class _Exchange:
    """One fragment's synchronisation between its send and its receive step."""

    fragment: int
    due: int
    mean: PendingMean  # the worker mean of Delta_p, on its way until waited for
    begun_here: bool = True  # False for one restored from a checkpoint: no quorum of this process holds it


class StreamingDiLoCo(torch.optim.Optimizer):
    """Streaming DiLoCo around any inner optimizer.

    Args:
        fragments: the parameters grouped into fragments (lists of parameters, disjoint, in
            a fixed order); every worker must start from identical values.
        inner: the inner optimizer over exactly these parameters (or a factory).
        args: :class:`StreamingDiLoCoArgs`.
        compressor: codec of the outer gradient, exchanged as ``args.exchange`` says, or None
            for a dense all-reduce in the parameters' dtype.
        comm: the workers' Communicator.
    """

    def __init__(
        self,
        fragments: Sequence[Sequence[torch.nn.Parameter]],
        inner: InnerOptimizer,
        args: StreamingDiLoCoArgs,
        *,
        compressor: Codec | None = None,
        comm: Communicator | None = None,
    ):
        fragments = [list(fragment) for fragment in fragments]
        args.check()
        raise_argument_errors(fragment_errors(len(fragments), args.sync_every))
        params = [p for fragment in fragments for p in fragment]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("fragments must be disjoint")
        super().__init__(params, dict(outer_lr=args.outer_lr, sync_every=args.sync_every))
        self.inner = inner(params) if callable(inner) else inner
        if {id(p) for g in self.inner.param_groups for p in g["params"]} != {id(p) for p in params}:
            raise ValueError("the inner optimizer must be built over exactly the parameters in the fragments")
        self.param_groups = self.inner.param_groups

        self.sync_every, self.overlap, self.mixing = args.sync_every, args.overlap, args.mixing
        self.outer_lr, self.outer_momentum, self.nesterov = args.outer_lr, args.outer_momentum, args.nesterov
        self.compressor = compressor
        self.exchange = args.exchange
        self.comm = comm if comm is not None else Communicator()
        self.fragments = fragments
        self.offsets = fragment_offsets(len(fragments), args.sync_every)
        with torch.no_grad():
            self._global = [[p.detach().clone() for p in fragment] for fragment in fragments]
        self._momentum = ([[torch.zeros_like(p) for p in fragment] for fragment in self._global]
                          if args.outer_momentum > 0 else None)
        self._in_flight: list[_Exchange] = []
        self.local_step = 0

    # ------------------------------------------------------------------ schedule
    def fragments_sent_at(self, step: int) -> list[int]:
        """Fragments whose synchronisation starts after inner step ``step`` (1-based)."""
        return fragments_sent_at(step, len(self.fragments), self.sync_every)

    # ------------------------------------------------------------------ stepping
    def step(self, closure: Callable[[], float] | None = None):
        loss = self.inner.step(closure)
        self.local_step += 1
        if self.fragments_sent_at(self.local_step):
            # Between replica groups that may fail (lowcomm.comm.ft) a quorum forms first. A group
            # that rejoins behind takes a live peer's state there, its local step included, and
            # then sends what the peer's step sends (its own step's fragment may be another one).
            self.comm.begin_exchange()
            for fragment in self.fragments_sent_at(self.local_step):
                self._send(fragment)
        due = [e for e in self._in_flight if e.due == self.local_step]
        if due:
            means = [exchange.mean.wait() for exchange in due]
            # the exchanges due now began together; one a peer died inside is dropped by all alike.
            # Restored from a checkpoint, no quorum holds it: plainly it is merged, as it would
            # have been; between replica groups it is dropped, which every group resuming there
            # does alike (a peer may have died inside it; a group behind its peers heals next)
            committed = self.comm.commit() if any(e.begun_here for e in due) else not self.comm.replica_groups
            if not committed and not any(e.begun_here for e in due):
                self.comm.fall_behind()  # peers may have merged it: take their state at the next quorum
            for exchange, mean in zip(due, means, strict=True):
                self._receive(exchange.fragment, mean if committed else None)
                self._in_flight.remove(exchange)
        return loss

    @torch.no_grad()
    def _send(self, fragment: int) -> None:
        deltas = [g - p for g, p in zip(self._global[fragment], self.fragments[fragment], strict=True)]
        mean = PendingMean.start(self.comm, deltas, self.compressor, self.exchange)
        self._in_flight.append(_Exchange(fragment, self.local_step + self.overlap, mean))

    @torch.no_grad()
    def _receive(self, fragment: int, means: list[torch.Tensor] | None) -> None:
        """The outer step of ``fragment`` with the worker mean ``means``, then the mixing. A
        dropped exchange (``None``) moves no global copy: the local fragment is mixed with the
        unchanged one (with alpha = 0 it restarts from it, as DiLoCo's workers do)."""
        for index, (global_, local) in enumerate(zip(self._global[fragment], self.fragments[fragment], strict=True)):
            if means is not None:
                direction = means[index].clone()
                momentum = self._momentum[fragment][index] if self._momentum is not None else None
                outer_direction_(direction, momentum, self.outer_momentum, self.nesterov)
                global_.sub_(direction, alpha=self.outer_lr)
            local.mul_(self.mixing).add_(global_, alpha=1 - self.mixing)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This worker's state: inner state, global fragments, outer momenta, the local step and
        every exchange in flight (received here, so its mean is saved with its due step)."""
        return {
            "inner": self.inner.state_dict(),
            # this worker's own parameters (a checkpoint's model file holds rank 0's)
            "local_params": [[p.detach() for p in fragment] for fragment in self.fragments],
            "local_step": self.local_step,
            "global_params": [list(fragment) for fragment in self._global],
            "outer_momentum": [list(f) for f in self._momentum] if self._momentum is not None else None,
            "in_flight": [{"fragment": e.fragment, "due": e.due, "mean": list(e.mean.wait())}
                          for e in self._in_flight],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, mine in (("global_params", self._global), ("outer_momentum", self._momentum),
                          ("local_params", self.fragments)):
            saved = state_dict[key]
            if (saved is None) != (mine is None) or (
                    mine is not None and [len(f) for f in saved] != [len(f) for f in mine]):
                raise ValueError(f"StreamingDiLoCo state {key!r} does not match this optimizer's fragments")
            for targets, sources in zip(mine or [], saved or [], strict=True):
                for target, source in zip(targets, sources, strict=True):
                    target.copy_(source)
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups
        self.local_step = int(state_dict["local_step"])
        self._in_flight = [
            _Exchange(int(e["fragment"]), int(e["due"]), PendingMean.done([t.clone() for t in e["mean"]]),
                      begun_here=False)
            for e in state_dict["in_flight"]
        ]

    # ------------------------------------------------------------------ accounting
    @staticmethod
    def fragment_payload_bytes(
        fragment_shapes: Sequence[Sequence[torch.Size | tuple[int, ...]]], compressor: Codec | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> list[int]:
        """Bytes one worker sends for each fragment's synchronisation."""
        return [sum(payload_nbytes(compressor, shape, dtype) for shape in shapes) for shapes in fragment_shapes]

    @staticmethod
    def amortized_payload_bytes(
        fragment_shapes: Sequence[Sequence[torch.Size | tuple[int, ...]]], sync_every: int,
        compressor: Codec | None = None, dtype: torch.dtype = torch.float32,
    ) -> float:
        """Average payload bytes per step and worker: every fragment once per H steps."""
        return sum(StreamingDiLoCo.fragment_payload_bytes(fragment_shapes, compressor, dtype)) / sync_every

    @staticmethod
    def peak_payload_bytes(
        fragment_shapes: Sequence[Sequence[torch.Size | tuple[int, ...]]], sync_every: int,
        compressor: Codec | None = None, dtype: torch.dtype = torch.float32,
    ) -> int:
        """The most bytes one worker sends in a single step (fragments sharing an offset add up)."""
        per_fragment = StreamingDiLoCo.fragment_payload_bytes(fragment_shapes, compressor, dtype)
        count = len(per_fragment)
        per_offset: dict[int, int] = {}
        for p, nbytes in enumerate(per_fragment):
            offset = p * sync_every // count
            per_offset[offset] = per_offset.get(offset, 0) + nbytes
        return max(per_offset.values())


def fragment_params(named: Iterable[tuple[str, torch.nn.Parameter]], num_fragments: int,
                    pattern: str = "strided") -> list[list[torch.nn.Parameter]]:
    """Group a model's parameters into fragments by transformer block.

    Block ``i`` (a name containing ``.blocks.<i>.``) of ``n`` goes to fragment ``i % P``
    (``strided``, the paper's better pattern: each fragment spans the depth) or ``i * P // n``
    (``sequential``: consecutive blocks). Parameters outside the blocks go with the block nearest
    to them: those named before the first block (the embedding) with block 0, those after
    (final norm, untied head) with the last block. A model without blocks is fragmented by
    parameter position the same way. Empty fragments are dropped.
    """
    named = list(named)
    layer_of: list[int | None] = []
    for name, _ in named:
        marker = ".blocks."
        layer = None
        if marker in name:
            head = name.split(marker, 1)[1].split(".", 1)[0]
            layer = int(head) if head.isdigit() else None
        layer_of.append(layer)
    if all(layer is None for layer in layer_of):
        layer_of = list(range(len(named)))
    known = [layer for layer in layer_of if layer is not None]
    first, last = min(known), max(known)
    seen_block = False
    resolved = []
    for layer in layer_of:
        if layer is not None:
            seen_block = True
            resolved.append(layer)
        else:
            resolved.append(last if seen_block else first)
    count = last - first + 1
    fragments: list[list[torch.nn.Parameter]] = [[] for _ in range(num_fragments)]
    for (_, param), layer in zip(named, resolved, strict=True):
        position = layer - first
        index = position % num_fragments if pattern == "strided" else position * num_fragments // count
        fragments[index].append(param)
    return [fragment for fragment in fragments if fragment]
