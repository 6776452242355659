"""MuLoCo (Thérien et al. 2025): DiLoCo whose workers train with Muon (hidden matrices) and
AdamW (embeddings, head, vectors), and send a compressed pseudo-gradient with error feedback
(Algorithm 1; implemented by :class:`lowcomm.optim.DiLoCo` given a codec and a beta).

The compression group chooses the codec (the paper's headline: ``compression=quantize`` with 2
bits); ``error_feedback: null`` gives MuLoCo without an accumulator, and ``compression=none``
with it the dense all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.optim.diloco import DiLoCoArgs
from lowcomm.optim.grouping import CombinedOptimizer, MuonArgs, muon_adamw
from lowcomm.strategies.base import Cycle, Display, Point, Row, StrategyConfig, register
from lowcomm.strategies.diloco import DiLoCoStrategy
from lowcomm.strategies.muon_ddp import muon_adamw_state_bytes


@dataclass(kw_only=True)
class MuLoCoConfig(StrategyConfig, MuonArgs, DiLoCoArgs):
    """``configs/optimizer/muloco.yaml``: DiLoCo's fields (``lr`` is the inner Muon lr) plus
    Muon's; the yaml's comments give the paper's settings. ``adjust_lr_fn`` is ``original``
    (sqrt(max(1, out/in))): the paper's Muon scales its step that way and its lr was tuned for
    it; Moonlight's ``match_rms_adamw`` would multiply that lr's step by 6.4-12.8 on OLMo-300M's
    matrices."""

    config_name: ClassVar[str] = "muloco"


@register
class MuLoCoStrategy(DiLoCoStrategy):
    """DiLoCo with the Muon+AdamW inner optimizer; everything else is DiLoCo's."""

    name = "muloco"
    Config = MuLoCoConfig
    display = Display("MuLoCo", marker="v", color="C6")
    quickstart = (Point("MuLoCo 2-bit EF", "optimizer.lr=1e-2", "optimizer.sync_every=10", "compression=quantize",
                        "compression.bits=2"),)
    table1_tiny = quickstart
    comm_table = (Row("MuLoCo H=30, 2-bit quantized", "compression=quantize", "compression.bits=2"),)
    mid_period = ("optimizer.sync_every=2",)
    cycle = Cycle(2, "optimizer.sync_every=2", "compression=quantize")

    @classmethod
    def check_compression(cls, cfg: MuLoCoConfig, compression: dict[str, Any]) -> list[str]:
        if cfg.error_feedback is not None and compression.get("name", "none") == "none":
            return ["optimizer=muloco accumulates what a codec drops (optimizer.error_feedback="
                    f"{cfg.error_feedback}) but compression=none: choose a codec (MuLoCo's headline is "
                    "compression=quantize compression.bits=2) or set optimizer.error_feedback=null"]
        return super().check_compression(cfg, compression)

    def inner_state_bytes(self, model: torch.nn.Module) -> float:
        return muon_adamw_state_bytes(model)

    def make_inner_optimizer(
        self, model: torch.nn.Module, params: list[torch.nn.Parameter]
    ) -> CombinedOptimizer:
        """Muon on ``model``'s hidden matrices, AdamW on the rest (see
        :func:`lowcomm.optim.grouping.split_muon_adamw`)."""
        return muon_adamw(model, self.cfg, params)
