"""Eager DiLoCo as a strategy: DiLoCo (AdamW inside, outer Nesterov SGD) whose all-reduce of the
pseudo-gradients runs behind the next H inner steps, each worker applying its own fresh
pseudo-gradient at once and the others' one outer step late (:class:`lowcomm.optim.EagerDiLoCo`).

Under the eager rule every worker's outer parameters and outer momentum are its own, and an
exchange is in flight at every checkpoint between two outer steps: the whole optimizer state is
saved per rank (no ``replicated_state_keys``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.compress import build_codec
from lowcomm.optim.diloco import reduces_quantized
from lowcomm.optim.eager_diloco import EagerDiLoCo, EagerDiLoCoArgs
from lowcomm.optim.grouping import AdamWArgs
from lowcomm.strategies.base import (
    Cycle,
    Display,
    Point,
    Row,
    StrategyConfig,
    parameter_bytes,
    register,
)
from lowcomm.strategies.diloco import DiLoCoStrategy


@dataclass(kw_only=True)
class EagerDiLoCoConfig(StrategyConfig, AdamWArgs, EagerDiLoCoArgs):
    """``configs/optimizer/eager_diloco.yaml``: DiLoCo's fields (inner AdamW, outer Nesterov SGD,
    H) and ``mode`` (eager or the naive delayed update)."""

    config_name: ClassVar[str] = "eager_diloco"


@register
class EagerDiLoCoStrategy(DiLoCoStrategy):
    name = "eager_diloco"
    # its dense exchange runs between replica groups (lowcomm.comm.ft): a quorum at each outer
    # step, committed at the next, before the next quorum forms
    replica_groups_refusal = None
    Config = EagerDiLoCoConfig
    display = Display("Eager DiLoCo", marker="H", color="navy")
    # DiLoCo's inner lr and H; a gentler outer step, because three quarters of the mean arrive one
    # outer step late at W = 4 (final val loss of the quickstart run, outer lr / momentum:
    # 0.7 / 0.9 4.28, 0.4 / 0.9 3.62, 0.4 / 0.8 3.33; DiLoCo's point 3.25)
    quickstart = (Point("Eager DiLoCo H=10", "optimizer.lr=6e-3", "optimizer.sync_every=10", "optimizer.outer_lr=0.4",
                        "optimizer.outer_momentum=0.8"),)
    table1_tiny = quickstart
    comm_table = (Row("Eager DiLoCo H=10", "optimizer.sync_every=10"),
                  Row("Eager DiLoCo H=100", "optimizer.sync_every=100"),
                  Row("Eager DiLoCo H=100, 2-bit quantized", "optimizer.sync_every=100", "compression=quantize"))
    # sync at 2, 4, 6: the step-3 checkpoint holds step 2's exchange in flight and its own Delta
    mid_period = ("optimizer.sync_every=2",)
    cycle = Cycle(2, "optimizer.sync_every=2")
    replicated_state_keys = ()  # outer parameters and momentum differ per worker under the eager rule
    algorithm = EagerDiLoCo

    @classmethod
    def report_lag(cls, cfg: EagerDiLoCoConfig) -> int:
        """H: an outer step's all-reduce is waited for at the next outer step."""
        return cfg.sync_every

    @classmethod
    def comm_overlap(cls, cfg: EagerDiLoCoConfig, parameters: int,  # noqa: ARG003
                     compression: dict[str, Any] | None = None) -> float:
        """The all-reduce started at an outer step is waited for at the next, H inner steps later:
        one synchronisation's traffic runs behind H steps of compute, all of every step's compute
        (1). Under the quantized all-reduce only the all-to-all, about half of its bytes, is in
        flight then; the all-gather of the reduced chunks runs at the next outer step, in the
        open (1/2, as Streaming DiLoCo counts it). An all-gather is in flight whole."""
        codec = build_codec(compression or {"name": "none"})
        return 0.5 if reduces_quantized(cfg.exchange, codec) else 1.0

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """All per rank: DiLoCo's (outer parameters, outer momentum, local parameters, inner
        state), the mean in flight and, under the eager rule, the worker's last pseudo-gradient."""
        params = parameter_bytes(model)
        outer = params * (2 if self.cfg.outer_momentum > 0 else 1)
        kept = params * (2 if self.cfg.mode == "eager" else 1)
        return 0.0, outer + params + self.inner_state_bytes(model) + kept

