"""DisTrO as a strategy: DeMo's (no DDP wrapper, per-worker momentum, all-gathered top-k), with
:class:`lowcomm.optim.DisTrO` as the optimizer: the all-gather of step t is waited for at step
t+1, so it runs behind a whole step of compute.

``configs/optimizer/distro.yaml`` holds Psyche's 40B settings (chunk 64, top-k 4, 1-bit values,
momentum decay 0.995, weight decay 0.1) and the lookahead. The codec is set there, as DeMo's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.optim.distro import DisTrO, DisTrOArgs
from lowcomm.strategies.base import Display, Point, Row, parameter_bytes, register
from lowcomm.strategies.demo import DeMoConfig, DeMoStrategy


@dataclass(kw_only=True)
class DisTrOConfig(DeMoConfig, DisTrOArgs):
    """``configs/optimizer/distro.yaml``; the fields are :class:`~lowcomm.optim.distro.DisTrOArgs`."""

    config_name: ClassVar[str] = "distro"


@register
class DisTrOStrategy(DeMoStrategy):
    name = "distro"
    Config = DisTrOConfig
    display = Display("DisTrO", marker="d", color="darkgoldenrod")
    # DeMo's quickstart lr (the same update rule: lr x sign); k=4 and the 1-bit wire are the yaml's
    quickstart = (Point("DisTrO k=4 1-bit", "optimizer.lr=6e-3"),)
    table1_tiny = quickstart
    comm_table = (Row("DisTrO k=4 1-bit (Psyche 40B)"),
                  Row("DisTrO k=32 1-bit", "optimizer.compression_topk=32"))
    # no mid_period overrides: every checkpoint falls between a step's all-gather and the next
    # step, which applies it
    # the same on every worker: written once (the per-parameter state is each worker's own)
    replicated_state_keys = ("base_params", "in_flight")

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, DisTrO]:
        return model, self.make_optimizer(model, self.comm, DisTrO)

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """Replicated: the parameters without the lookahead (the same on every worker). Per rank:
        the momentum (one copy of the parameters) and the lookahead direction (one int8 per
        element). The exchange in flight, W x the payload written once, is left out: it depends
        on the world size, and at chunk 64, k = 4, W = 64 it is 3 % of the parameters' bytes."""
        if not self.cfg.lookahead:
            return 0.0, parameter_bytes(model)
        elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return parameter_bytes(model), parameter_bytes(model) + elements

    @classmethod
    def report_lag(cls, cfg: DisTrOConfig) -> int:  # noqa: ARG003
        """1: a step's all-gather is waited for in the next step."""
        return 1

    @classmethod
    def comm_overlap(cls, cfg: DisTrOConfig, parameters: int, compression=None) -> float:  # noqa: ARG003
        """1: every bucket's all-gather starts in step t once the bucket is encoded and is waited
        for in step t+1 after every bucket of step t+1 is encoded, so a whole step's compute (the
        rest of step t's optimizer step, step t+1's forward, backward and encoding) runs while it
        is in flight. A link slower than that still stalls the step by the difference."""
        return 1.0
