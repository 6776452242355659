"""DiLoCo as a strategy: H local AdamW steps per worker, then the mean pseudo-gradient drives an
outer Nesterov SGD step (:class:`lowcomm.optim.DiLoCo`). The pseudo-gradient is sent dense (an
all-reduce) or through the ``compression`` group's codec, any codec whose decode averages the
workers' payloads (``decodes_mean``), with an optional error-feedback accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.compress import Codec, build_codec
from lowcomm.optim.diloco import DiLoCo, DiLoCoArgs
from lowcomm.optim.grouping import AdamWArgs
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
class DiLoCoConfig(StrategyConfig, AdamWArgs, DiLoCoArgs):
    """``configs/optimizer/diloco.yaml``: inner AdamW (``lr`` is the inner, scheduled lr) and
    the outer Nesterov SGD; ``error_feedback`` is the accumulator beta for a compressed
    pseudo-gradient (null: none)."""

    config_name: ClassVar[str] = "diloco"


@register
class DiLoCoStrategy(OuterLoopStrategy):
    """DiLoCo with an AdamW inner optimizer. A variant with another inner optimizer (MuLoCo:
    Muon) overrides :meth:`make_inner_optimizer`."""

    name = "diloco"
    Config = DiLoCoConfig
    display = Display("DiLoCo", marker="^", color="C5")
    quickstart = (Point("DiLoCo H=10", "optimizer.lr=6e-3", "optimizer.sync_every=10"),)
    table1_tiny = quickstart
    comm_table = (Row("DiLoCo H=10", "optimizer.sync_every=10"),
                  Row("DiLoCo H=10, 2-bit quantized", "optimizer.sync_every=10", "compression=quantize"))
    mid_period = ("optimizer.sync_every=2",)
    cycle = Cycle(2, "optimizer.sync_every=2")
    algorithm: ClassVar[type[DiLoCo]] = DiLoCo  # a variant of the outer loop (eager DiLoCo) names its own
    replica_groups_refusal = None  # its dense exchange runs between replica groups (lowcomm.comm.ft)

    @classmethod
    def accepts_codec(cls, codec: type[Codec]) -> bool:
        """Any codec whose decode of the workers' payloads is their mean: the outer step wants
        the mean pseudo-gradient."""
        return bool(getattr(codec, "decodes_mean", False))

    @classmethod
    def check_compression(cls, cfg: DiLoCoConfig, compression: dict[str, Any]) -> list[str]:
        if cfg.error_feedback is not None and compression.get("name", "none") == "none":
            return ["optimizer.error_feedback needs a compression other than none (error feedback "
                    "accumulates what a codec drops)"]
        return super().check_compression(cfg, compression)

    @classmethod
    def check_replica_groups(cls, cfg: DiLoCoConfig, compression: dict[str, Any]) -> list[str]:
        errors = super().check_replica_groups(cfg, compression)
        if not errors and compression.get("name", "none") != "none":
            errors.append(f"optimizer={cls.name} runs under cluster.fault_tolerance=torchft with its dense exchange "
                          f"only (compression=none): a compressed one with its error feedback is not built between "
                          f"replica groups (SparseLoCo's is)")
        return errors

    def codec(self) -> Codec | None:
        return build_codec(self.compression)

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, DiLoCo]:
        params = trainable_parameters(model)
        optimizer = self.algorithm(params, self.make_inner_optimizer(model, params), self.cfg,
                                   compressor=self.codec(), comm=self.comm)
        return model, optimizer
