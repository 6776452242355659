"""Streaming DiLoCo as a strategy: local updates (no DDP wrapper) with an AdamW inner
optimizer, the model's transformer blocks grouped into fragments
(:func:`lowcomm.optim.streaming_diloco.fragment_params`) and each fragment's outer gradient
sent as 4-bit E3M0 (``quantization: e3m0``) or dense (``none``).

Workers differ between synchronisations and exchanges can be in flight at a checkpoint, so
the optimizer state (with the in-flight means) is saved per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowcomm.compress.registry import build_codec
from lowcomm.optim.grouping import weight_decay_groups
from lowcomm.optim.rules import as_config_errors
from lowcomm.optim.streaming_diloco import StreamingDiLoCo, fragment_params, streaming_diloco_errors
from lowcomm.strategies.base import AdamWFields, Strategy, register

PATTERNS = ("strided", "sequential")
QUANTIZATIONS = ("e3m0", "none")


@dataclass
class StreamingDiLoCoConfig(AdamWFields):
    """``configs/optimizer/streaming_diloco.yaml`` (its comments give the paper's settings)."""

    sync_every: int = 100
    num_fragments: int = 4
    pattern: str = "strided"
    overlap: int = 1
    mixing: float = 0.5
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    quantization: str = "e3m0"

    def validate(self) -> list[str]:
        errors = super().validate() + as_config_errors(streaming_diloco_errors(
            sync_every=self.sync_every, num_fragments=self.num_fragments, overlap=self.overlap, mixing=self.mixing,
            outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
        ))
        for key, allowed in (("pattern", PATTERNS), ("quantization", QUANTIZATIONS)):
            if getattr(self, key) not in allowed:
                errors.append(f"optimizer.{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        return errors


@register
class StreamingDiLoCoStrategy(Strategy):
    name = "streaming_diloco"
    Config = StreamingDiLoCoConfig
    replicated_optimizer_state = False  # inner states, and the local copies the mixing keeps, are per worker

    def codec(self):
        return build_codec({"name": self.cfg.quantization})

    def fragments(self, model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        return fragment_params(named, self.cfg.num_fragments, self.cfg.pattern)

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, StreamingDiLoCo]:
        cfg = self.cfg
        optimizer = StreamingDiLoCo(
            self.fragments(model),
            lambda params: torch.optim.AdamW(
                weight_decay_groups(model, params, weight_decay=cfg.weight_decay, decay_embeddings=cfg.decay_embeddings),
                lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay),
            sync_every=cfg.sync_every, overlap=cfg.overlap, mixing=cfg.mixing, outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum, nesterov=cfg.nesterov, compressor=self.codec(), comm=self.comm,
        )
        return model, optimizer

    @classmethod
    def comm_overlap(cls, cfg: StreamingDiLoCoConfig, parameters: int) -> float:  # noqa: ARG003
        """A fragment is sent every sync_every / num_fragments steps and merged ``overlap``
        (tau) inner steps later: its exchange runs behind tau steps of compute."""
        return min(1.0, cfg.overlap * cfg.num_fragments / cfg.sync_every)

    def wire_collective(self) -> str:
        return "all_reduce" if self.cfg.quantization == "none" else "all_gather"

    def _fragment_shapes(self, model: torch.nn.Module):
        return [[p.shape for p in fragment] for fragment in self.fragments(model)]

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        """Per worker and step, amortised: every fragment once per H steps."""
        dtype = next(model.parameters()).dtype
        return StreamingDiLoCo.amortized_payload_bytes(self._fragment_shapes(model), self.cfg.sync_every,
                                                       self.codec(), dtype)

    def analytic_peak_payload_bytes(self, model: torch.nn.Module) -> int:
        """The largest single-step payload: one fragment's (the method's flattened peak)."""
        dtype = next(model.parameters()).dtype
        return StreamingDiLoCo.peak_payload_bytes(self._fragment_shapes(model), self.cfg.sync_every, self.codec(),
                                                  dtype)
