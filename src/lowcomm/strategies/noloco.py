"""NoLoCo as a strategy: H local AdamW steps per worker, then each worker averages with one
random peer through NoLoCo's modified Nesterov step (:class:`lowcomm.optim.NoLoCo`). No
collective at all: the outer step is a point-to-point exchange, whose bytes per worker do not
depend on the world size. NoLoCo's other half, random routing of activations between pipeline
stages, needs pipeline parallelism, which the harness does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.comm.meter import TRAFFIC, WireBytes
from lowcomm.compress import Codec
from lowcomm.optim.grouping import AdamWArgs
from lowcomm.optim.noloco import NoLoCo, NoLoCoArgs
from lowcomm.strategies.base import (
    Cycle,
    Display,
    OuterLoopStrategy,
    Point,
    Row,
    StrategyConfig,
    parameter_bytes,
    register,
    trainable_parameters,
)


@dataclass(kw_only=True)
class NoLoCoConfig(StrategyConfig, AdamWArgs, NoLoCoArgs):
    """``configs/optimizer/noloco.yaml``: inner AdamW (``lr`` is the inner, scheduled lr) and
    NoLoCo's outer step (``outer_lr`` beta, ``outer_momentum`` alpha, ``pull`` gamma)."""

    config_name: ClassVar[str] = "noloco"


@register
class NoLoCoStrategy(OuterLoopStrategy):
    """NoLoCo with an AdamW inner optimizer. Every piece of optimizer state is the worker's own
    (its outer weights and momentum too: replicas are never made equal), so a checkpoint holds
    one copy per rank and none written once."""

    name = "noloco"
    replica_groups_refusal = (
        "workers meet in pairs drawn over the whole world (point-to-point, no collective), so a lost worker leaves its partner waiting; its pairing would have to be drawn over the live groups")
    Config = NoLoCoConfig
    display = Display("NoLoCo", marker="p", color="teal")
    # DiLoCo's quickstart lr and H: the same family (AdamW inner phases of 10 steps)
    quickstart = (Point("NoLoCo H=10", "optimizer.lr=6e-3", "optimizer.sync_every=10"),)
    table1_tiny = quickstart
    comm_table = (Row("NoLoCo H=50 (pairs)"),
                  Row("NoLoCo H=10 (pairs)", "optimizer.sync_every=10"))
    mid_period = ("optimizer.sync_every=2",)
    cycle = Cycle(2, "optimizer.sync_every=2")
    replicated_state_keys = ()

    @classmethod
    def accepts_codec(cls, codec: type[Codec]) -> bool:  # noqa: ARG003
        """None: the reference sends its weights dense, and a peer's outer weights are not a
        mean that a codec's decode could stand for."""
        return False

    def codec(self) -> Codec | None:
        return None

    def wire_collective(self) -> str:
        return "exchange"

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, NoLoCo]:
        params = trainable_parameters(model)
        # The run's seed: the loop builds the model with torch.manual_seed(run.seed) just before
        # (lowcomm.models.build_model), on every rank alike, so the pairing follows the run's seed.
        optimizer = NoLoCo(params, self.make_inner_optimizer(model, params), self.cfg, comm=self.comm,
                           seed=torch.initial_seed())
        return model, optimizer

    def _sync_payload(self, model: torch.nn.Module) -> int:
        params = trainable_parameters(model)
        return NoLoCo.payload_bytes_per_sync([p.shape for p in params], params[0].dtype)

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        """Per worker and step: its outer and current weights once per H steps."""
        return self._sync_payload(model) / self.cfg.sync_every

    def analytic_traffic(self, model: torch.nn.Module, world_size: int, *, warmup: bool = False,  # noqa: ARG002
                         ) -> WireBytes:
        """The payload to one peer per outer step, amortised over H: tx per worker = payload / H
        at every even W (an odd W's group of three sends twice, averaged over the W workers).
        All of it goes straight to the peer (``direct``): a random peer is on another node with
        probability (W - g) / (W - 1), not a ring's one hop in g."""
        payload = self._sync_payload(model)
        traffic = TRAFFIC["exchange"](payload, world_size)
        return WireBytes(*(value / self.cfg.sync_every for value in (payload, traffic.tx, traffic.rx, traffic.tx)))

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """None replicated; per rank: the worker's parameters, outer weights and momentum, and
        the inner AdamW's two moments."""
        return 0.0, 3 * parameter_bytes(model) + self.inner_state_bytes(model)

    @classmethod
    def comm_overlap(cls, cfg: NoLoCoConfig, parameters: int, compression=None) -> float:  # noqa: ARG003
        """0: the outer step needs the peer's weights before it can move, and the next inner
        phase starts from the result, so the exchange is waited for where it is issued (as in
        the reference, whose sends block). What NoLoCo saves is the wait for the slowest of W
        workers and the bytes a ring forwards, not the time of its own exchange."""
        return 0.0
