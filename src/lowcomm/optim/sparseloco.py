"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025; arXiv 2508.15706).

DiLoCo whose outer momentum is replaced by a per-worker error-feedback accumulator and whose
pseudo-gradient is sparsified per chunk and quantized (the paper's Algorithm 1)::

    Delta_i = theta_global - theta_i                       # after H inner (AdamW) steps
    E_i <- beta E_i + Delta_i
    D_i  = Q(TopK_chunk(E_i))                              # the payload sent (all-gather)
    E_i <- E_i - decode(D_i)
    Delta[e] = mean of decode(D_i)[e] over the workers i that sent entry e   # aggregate="senders"
    theta_global <- theta_global - alpha Delta             # outer SGD, no momentum
    theta_i <- theta_global

This is :class:`lowcomm.optim.DiLoCo` with ``outer_momentum=0``, a
:class:`lowcomm.compress.chunked_topk.ChunkedTopK` codec, an error-feedback beta and an
all-gather (the kept entries differ per worker, so there is nothing to reduce in place). The one
addition is the aggregation. ``senders`` (default) is the reference code's
(``scatter_reduce(reduce="mean", include_self=False)``): an entry kept by one of R workers moves
by that worker's value, not 1/R of it. ``mean`` is Algorithm 1 as printed, (1/R) sum_i
decode(D_i), kept as an ablation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.compress.chunked_topk import MAX_PACKED_CHUNK, TWELVE_BIT_WIRES, WIRES, ChunkedTopK
from lowcomm.compress.quantize import BITS
from lowcomm.optim.args import one_of_error
from lowcomm.optim.diloco import DiLoCo, DiLoCoArgs, InnerOptimizer, OuterArgs, all_gather_stacked

__all__ = ["SparseLoCo", "SparseLoCoArgs"]

AGGREGATES = ("mean", "senders")


@dataclass(kw_only=True)
class SparseLoCoArgs(OuterArgs):
    """SparseLoCo's arguments: DiLoCo's outer loop (its Nesterov momentum follows
    ``outer_momentum > 0``) and the codec's; defaults in ``configs/optimizer/sparseloco.yaml``.

    chunk, topk: kept entries per ``chunk x chunk`` block of the accumulator.
    bits: values quantized to this many bits (None: the parameters' dtype).
    wire, range_sigmas: the codec's (:class:`~lowcomm.compress.chunked_topk.ChunkedTopK`).
    aggregate: ``senders`` (the mean over the workers that sent each entry, the reference
        code's) or ``mean`` (the sum over workers / R, Algorithm 1 as printed).
    """

    config_name: ClassVar[str] = "sparseloco"

    chunk: int
    topk: int
    bits: int | None
    wire: str
    range_sigmas: float
    aggregate: str

    def errors(self) -> list[str]:
        errors = super().errors()
        if self.chunk < 1:
            errors.append(f"chunk must be >= 1, got {self.chunk}")
        elif not 1 <= self.topk <= self.chunk * self.chunk:
            errors.append(f"topk must be in [1, chunk**2 = {self.chunk * self.chunk}], got {self.topk}")
        errors += one_of_error("wire", self.wire, WIRES)
        if self.wire in TWELVE_BIT_WIRES and self.chunk > MAX_PACKED_CHUNK:
            errors.append(f"wire={self.wire} sends 12-bit block indices, so chunk must be <= {MAX_PACKED_CHUNK}, "
                          f"got {self.chunk}")
        if self.bits is not None and self.bits not in BITS:
            errors.append(f"bits must be null or one of {', '.join(map(str, BITS))}, got {self.bits}")
        if not self.range_sigmas > 0:
            errors.append(f"range_sigmas must be > 0, got {self.range_sigmas}")
        errors += one_of_error("aggregate", self.aggregate, AGGREGATES)
        return errors

    def codec(self) -> ChunkedTopK:
        return ChunkedTopK(self.chunk, self.topk, self.bits, self.wire, self.range_sigmas)


class SparseLoCo(DiLoCo):
    """SparseLoCo around any inner optimizer (see the module doc for the update).

    Args: the parameters, the inner optimizer (or a factory), :class:`SparseLoCoArgs` and the
    workers' Communicator.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        inner: InnerOptimizer,
        args: SparseLoCoArgs,
        *,
        comm: Communicator | None = None,
    ):
        args.check()
        # SparseLoCo's outer loop is DiLoCo's, with Nesterov momentum whenever it has momentum
        # and its exchange is an all-gather: the kept entries differ per worker
        outer = DiLoCoArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(OuterArgs)},
                           nesterov=args.outer_momentum > 0, exchange="all_gather")
        super().__init__(params, inner, outer, compressor=args.codec(), comm=comm)
        self.aggregate = args.aggregate

    def _average_compressed(self) -> None:
        if self.aggregate == "mean":
            super()._average_compressed()
            return
        # each tensor's W payloads in one pass (decode_gathered), not one pass per worker
        for delta, gathered in zip(self._params, all_gather_stacked(self.comm, self._encoded()), strict=True):
            delta.copy_(self.compressor.decode_gathered(gathered))
