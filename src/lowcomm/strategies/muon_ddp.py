"""``muon_ddp``: AdamW-DDP's metered all-reduce every step (PyTorch DDP, its buckets and its
overlap of communication with the backward pass), then Muon on the hidden matrices and AdamW
on embeddings, head and vectors (:func:`lowcomm.optim.grouping.muon_adamw`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.optim.grouping import CombinedOptimizer, MuonArgs, muon_adamw, split_muon_adamw
from lowcomm.strategies.adamw_ddp import AdamWDDPConfig
from lowcomm.strategies.base import Display, Point, Row, parameter_bytes, register
from lowcomm.strategies.ddp import WIRE_DTYPES, DDPStrategy, dense_gradient_bytes


@dataclass(kw_only=True)
class MuonDDPConfig(AdamWDDPConfig, MuonArgs):
    """``configs/optimizer/muon_ddp.yaml``: ``lr`` is Muon's (scaled per matrix by
    ``adjust_lr_fn``), ``adamw_lr`` AdamW's; ``weight_decay`` applies to both; ``wire_dtype``
    as AdamW-DDP's (the gradients' dtype on the wire)."""

    config_name: ClassVar[str] = "muon_ddp"


def muon_adamw_state_bytes(model: torch.nn.Module) -> float:
    """Muon's momentum (one copy) of the hidden matrices and AdamW's two moments of the rest."""
    split = split_muon_adamw(model)
    return parameter_bytes(model, names=set(split.muon)) + 2 * parameter_bytes(model, names=set(split.adamw))


@register
class MuonDDP(DDPStrategy):
    """DDP all-reduce of the gradients every step (AdamW-DDP's metered hook, fp32 or bf16 on
    the wire), then Muon on the hidden matrices and AdamW on the rest."""

    name = "muon_ddp"
    Config = MuonDDPConfig
    display = Display("Muon-DDP", marker="s", color="C1")
    quickstart = (Point("Muon-DDP", "optimizer.lr=2e-2"),)
    table1_tiny = quickstart
    comm_table = (Row("Muon-DDP"),)

    def make_optimizer(self, model: torch.nn.Module) -> CombinedOptimizer:
        return muon_adamw(model, self.cfg)

    def analytic_payload_bytes(self, model: torch.nn.Module) -> int:
        """Per step and worker: every gradient element once, in the wire dtype."""
        return dense_gradient_bytes(model, WIRE_DTYPES[self.cfg.wire_dtype])

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        return muon_adamw_state_bytes(model), 0.0
