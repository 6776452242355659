"""DeMo as a strategy: no DDP wrapper; each worker's local gradient goes to
:class:`lowcomm.optim.DeMo`, which sends its compressed momentum through the Communicator.

The optimizer config (``configs/optimizer/demo.yaml``) holds all of DeMo's settings, chunk,
top-k and wire format included, so ``optimizer=demo`` alone is the paper's setup. DeMo's codec
is set that one way: the ``compression`` group is for what an optimizer sends through a
separate codec (DiLoCo's pseudo-gradient), and with DeMo it must stay ``none``.

Momentum is per worker, so checkpoints keep one optimizer file per rank. As with DDP, every
rank builds the model from the same seed (or loads the same checkpoint) and the workers stay
identical because they all apply the same aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.compress.dct_topk import topk_block_errors
from lowcomm.optim.demo import DeMo, DeMoArgs, demo_payload_bytes
from lowcomm.optim.grouping import weight_decay_groups
from lowcomm.strategies.base import (
    Display,
    Point,
    Strategy,
    StrategyConfig,
    parameter_bytes,
    register,
    trainable_parameters,
)


@dataclass(kw_only=True)
class DeMoConfig(StrategyConfig, DeMoArgs):
    """``configs/optimizer/demo.yaml``; the fields are :class:`~lowcomm.optim.demo.DeMoArgs`."""

    config_name: ClassVar[str] = "demo"

    def errors(self) -> list[str]:
        # The optimizer clamps k to a block's size (small tensors have small blocks); a config
        # whose k does not compress the target block is a mistake, refused here.
        return super().errors() + topk_block_errors(self.compression_chunk, self.compression_topk,
                                                    "compression_topk", "compression_chunk")


@register
class DeMoStrategy(Strategy):
    name = "demo"
    replica_groups_refusal = (
        "every step all-gathers each worker's compressed momentum, an all-gather not offered between replica groups (and a rejoining worker's own momentum has no peer copy)")
    Config = DeMoConfig
    display = Display("DeMo", marker="*", color="C3")
    quickstart = (Point("DeMo k=32", "optimizer.lr=6e-3", "optimizer.compression_topk=32"),
                  Point("DeMo k=4", "optimizer.lr=6e-3", "optimizer.compression_topk=4"))
    table1_tiny = tuple(
        Point(f"DeMo k={topk}", "optimizer.compression_chunk=64", f"optimizer.compression_topk={topk}",
              "optimizer.lr=6e-3")
        for topk in (32, 8, 1)
    )
    # its comm-table rows are the paper's Table 1 (results/paper/table1.csv)
    replicated_optimizer_state = False  # the momentum is each worker's own

    def make_optimizer(self, model: torch.nn.Module, comm: Communicator, optimizer_class: type[DeMo] = DeMo) -> DeMo:
        """DeMo (or a subclass, for FlexDeMo) over the model's trainable parameters, sending
        through ``comm``, with this config."""
        groups = weight_decay_groups(model, weight_decay=self.cfg.weight_decay,
                                     decay_embeddings=self.cfg.decay_embeddings)
        return optimizer_class(groups, self.cfg, comm)

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, DeMo]:
        return model, self.make_optimizer(model, self.comm)

    def wire_collective(self) -> str:
        return "all_gather"

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """The momentum: one copy of the parameters per rank."""
        return 0.0, parameter_bytes(model)

    def analytic_payload_bytes(self, model: torch.nn.Module) -> int:
        """Per step and worker: the DCT top-k payload of every trainable parameter."""
        params = trainable_parameters(model)
        cfg = self.cfg
        return demo_payload_bytes([p.shape for p in params], chunk=cfg.compression_chunk, topk=cfg.compression_topk,
                                  wire=cfg.wire, dtype=params[0].dtype)
