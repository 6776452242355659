"""AdamW-DDP, the DeMo paper's baseline: DDP all-reduce of bf16 gradients (``wire_dtype``),
then AdamW (OLMo's settings, embeddings not decayed)."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.optim.grouping import AdamWArgs, adamw
from lowcomm.strategies.base import Display, Point, register
from lowcomm.strategies.ddp import (
    WIRE_DTYPES,
    DDPConfig,
    DDPStrategy,
    dense_gradient_bytes,
    wire_dtype_errors,
)


@dataclass(kw_only=True)
class AdamWDDPConfig(DDPConfig, AdamWArgs):
    """``configs/optimizer/adamw_ddp.yaml``. ``wire_dtype``: bfloat16 by default, since the DeMo
    paper's AdamW rows (636.9 / 2416.6 MB) are about 2 bytes per parameter, so its compression
    ratios are against bf16 gradients; float32 stays a choice."""

    config_name: ClassVar[str] = "adamw_ddp"

    wire_dtype: str

    def errors(self) -> list[str]:
        return super().errors() + wire_dtype_errors(self.wire_dtype)


@register
class AdamWDDP(DDPStrategy):
    name = "adamw_ddp"
    Config = AdamWDDPConfig
    display = Display("AdamW-DDP", marker="o", color="C0")
    quickstart = (Point("AdamW-DDP", "optimizer.lr=6e-3"),)
    table1_tiny = (Point("AdamW-DDP", "optimizer.wire_dtype=bfloat16", "optimizer.lr=6e-3"),)
    # its comm-table rows are the paper's Table 1 (results/paper/table1.csv)

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.AdamW:
        return adamw(model, self.cfg)

    def analytic_payload_bytes(self, model: torch.nn.Module) -> int:
        """Per step and worker: every gradient element once, in the wire dtype."""
        return dense_gradient_bytes(model, WIRE_DTYPES[self.cfg.wire_dtype])
