"""DES-LOC as a strategy: local Adam with parameters, first and second moments averaged on
their own periods (:class:`lowcomm.optim.DESLoc`). No DDP wrapper: the backward pass sends
nothing. Sends uncompressed (the periods are its compression).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.optim.desloc import DESLoc, DESLocArgs
from lowcomm.optim.grouping import weight_decay_groups
from lowcomm.strategies.base import (
    Cycle,
    Display,
    Point,
    Row,
    Strategy,
    StrategyConfig,
    parameter_bytes,
    register,
    trainable_parameters,
)


@dataclass(kw_only=True)
class DESLocConfig(StrategyConfig, DESLocArgs):
    """``configs/optimizer/desloc.yaml``. ``sync_u`` / ``sync_v`` null mean 3 and 6 x ``sync_x``.
    ``clip`` (rho, per coordinate) is the only clipping in DES-LOC's equations, so the loop's
    global-norm clip is off by default (a global clip first would leave rho nothing to do)."""

    config_name: ClassVar[str] = "desloc"


@register
class DESLocStrategy(Strategy):
    name = "desloc"
    replica_groups_refusal = (
        "its parameters and both moments are averaged on their own periods over the world's process group; not offered between replica groups")
    Config = DESLocConfig
    display = Display("DES-LOC", marker="D", color="C7")
    quickstart = (Point("DES-LOC Kx=10", "optimizer.lr=6e-3", "optimizer.sync_x=10"),)
    table1_tiny = quickstart
    comm_table = (Row("DES-LOC Kx=10", "optimizer.sync_x=10"),)
    mid_period = ("optimizer.sync_x=2",)
    cycle = Cycle(1, "optimizer.sync_x=1", "optimizer.sync_u=1", "optimizer.sync_v=1")
    replicated_optimizer_state = False  # moments drift apart between their averages

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, DESLoc]:
        groups = weight_decay_groups(model, weight_decay=self.cfg.weight_decay,
                                     decay_embeddings=self.cfg.decay_embeddings)
        return model, DESLoc(groups, self.cfg, comm=self.comm)

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """The worker's parameters and both moments, per rank (they drift apart between their
        averages)."""
        return 0.0, 3 * parameter_bytes(model)

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        """Per worker and step, amortised: numel * 4 * (1/K_x + 1/K_u + 1/K_v) for fp32."""
        cfg, params = self.cfg, trainable_parameters(model)
        return DESLoc.amortized_payload_bytes([p.shape for p in params], cfg.sync_x, cfg.sync_u, cfg.sync_v,
                                              params[0].dtype)
