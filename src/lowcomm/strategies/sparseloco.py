"""SparseLoCo as a strategy: the DiLoCo family's local updates (no DDP wrapper, AdamW inner
optimizer, per-worker state) building :class:`lowcomm.optim.sparseloco.SparseLoCo`.

The codec's settings (chunk, top-k, bits, wire) are the optimizer config's, so
``optimizer=sparseloco`` alone is the paper's setup; the ``compression`` group stays ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.compress.chunked_topk import ChunkedTopK
from lowcomm.optim.grouping import AdamWArgs
from lowcomm.optim.sparseloco import SparseLoCo, SparseLoCoArgs
from lowcomm.strategies.base import (
    Cycle,
    Display,
    OuterLoopStrategy,
    Point,
    Row,
    StrategyConfig,
    register,
    trainable_parameters,
)


@dataclass(kw_only=True)
class SparseLoCoConfig(StrategyConfig, AdamWArgs, SparseLoCoArgs):
    """``configs/optimizer/sparseloco.yaml`` (its comments say which paper setting each
    default follows)."""

    config_name: ClassVar[str] = "sparseloco"


@register
class SparseLoCoStrategy(OuterLoopStrategy):
    """SparseLoCo: DiLoCo with error feedback, chunked top-k and low-bit values, no outer momentum."""

    name = "sparseloco"
    # its all-gather runs between replica groups of one rank (lowcomm.comm.ft); a group that has
    # just healed sends no row, and its error feedback starts empty (a heal does not send the
    # peer's: after_heal)
    replica_groups_refusal = None
    replica_groups_of_one_rank = True
    heal_leaves_out = ("error_feedback",)
    Config = SparseLoCoConfig
    display = Display("SparseLoCo", marker="<", color="C8")
    quickstart = (Point("SparseLoCo H=10 2-bit", "optimizer.lr=6e-3", "optimizer.sync_every=10"),)
    table1_tiny = quickstart
    comm_table = (Row("SparseLoCo H=15 k=128/4096 2-bit"),
                  Row("SparseLoCo H=15 k=64 2-bit templar", "optimizer.topk=64", "optimizer.wire=templar"))
    mid_period = ("optimizer.sync_every=2",)
    cycle = Cycle(2, "optimizer.sync_every=2")

    @classmethod
    def replica_groups_overrides(cls) -> tuple[str, ...]:
        return ()  # its sparse exchange and error feedback run between replica groups as they are

    def after_heal(self, optimizer: SparseLoCo) -> None:
        optimizer.forget_error_feedback()

    def codec(self) -> ChunkedTopK:
        return self.cfg.codec()

    def exchange(self) -> str:
        return "all_gather"  # the kept entries differ per worker

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, SparseLoCo]:
        params = trainable_parameters(model)
        return model, SparseLoCo(params, self.make_inner_optimizer(model, params), self.cfg, comm=self.comm)
