"""Streaming DiLoCo as a strategy: local updates (no DDP wrapper) with an AdamW inner
optimizer, the model's transformer blocks grouped into fragments
(:func:`lowcomm.optim.streaming_diloco.fragment_params`) and each fragment's outer gradient
sent as 4-bit E3M0 (``quantization: e3m0``) or dense (``none``).

Workers differ between synchronisations and exchanges can be in flight at a checkpoint, so
the optimizer state (with the in-flight means) is saved per rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.comm.meter import WireBytes
from lowcomm.compress.registry import build_codec
from lowcomm.optim.args import one_of_error
from lowcomm.optim.diloco import reduces_quantized, sync_traffic
from lowcomm.optim.grouping import AdamWArgs, adamw
from lowcomm.optim.streaming_diloco import (
    StreamingDiLoCo,
    StreamingDiLoCoArgs,
    fewest_steps_between_sends,
    fragment_errors,
    fragment_params,
    fragments_sent_at,
)
from lowcomm.strategies.base import (
    Cycle,
    Display,
    Point,
    Row,
    Strategy,
    StrategyConfig,
    parameter_bytes,
    register,
)

PATTERNS = ("strided", "sequential")
QUANTIZATIONS = ("e3m0", "none")


@dataclass(kw_only=True)
class StreamingDiLoCoConfig(StrategyConfig, AdamWArgs, StreamingDiLoCoArgs):
    """``configs/optimizer/streaming_diloco.yaml`` (its comments give the paper's settings):
    the algorithm's arguments, and how the harness cuts the model into ``num_fragments``
    fragments (``pattern``) and sends them (``quantization``)."""

    config_name: ClassVar[str] = "streaming_diloco"

    num_fragments: int
    pattern: str
    quantization: str

    def errors(self) -> list[str]:
        return (super().errors() + fragment_errors(self.num_fragments, self.sync_every)
                + one_of_error("pattern", self.pattern, PATTERNS)
                + one_of_error("quantization", self.quantization, QUANTIZATIONS))


@register
class StreamingDiLoCoStrategy(Strategy):
    name = "streaming_diloco"
    # Between replica groups each send step forms a quorum (a group rejoining at another phase of
    # the schedule heals to the peer's step, and sends its fragment) and the step it is merged
    # commits it: dense, and merged before the next send (check_replica_groups).
    replica_groups_refusal = None
    Config = StreamingDiLoCoConfig
    display = Display("Streaming DiLoCo", marker=">", color="C9")
    quickstart = (Point("Streaming DiLoCo H=10 P=2", "optimizer.lr=6e-3", "optimizer.sync_every=10",
                        "optimizer.num_fragments=2"),)
    table1_tiny = quickstart
    comm_table = (Row("Streaming DiLoCo H=100 P=4 E3M0"),
                  Row("Streaming DiLoCo H=10 P=4 E3M0", "optimizer.sync_every=10"))
    mid_period = ("optimizer.sync_every=4",)
    cycle = Cycle(4, "optimizer.sync_every=4", "optimizer.num_fragments=2")
    replicated_optimizer_state = False  # inner states, and the local copies the mixing keeps, are per worker

    @classmethod
    def replica_groups_overrides(cls) -> tuple[str, ...]:
        return (*super().replica_groups_overrides(), "optimizer.quantization=none")

    @classmethod
    def check_replica_groups(cls, cfg: StreamingDiLoCoConfig, compression: dict) -> list[str]:
        errors = super().check_replica_groups(cfg, compression)
        prefix = f"optimizer={cls.name} under cluster.fault_tolerance=torchft"
        if cfg.quantization != "none":
            errors.append(f"{prefix} sends its fragments dense (optimizer.quantization=none): the quantized "
                          f"all-reduce is not offered between replica groups")
        if not fragment_errors(cfg.num_fragments, cfg.sync_every) and cfg.sync_every >= 1:
            gap = fewest_steps_between_sends(cfg.num_fragments, cfg.sync_every)
            if cfg.overlap >= gap:
                errors.append(f"{prefix} merges each fragment before the next is sent (one quorum at a time): "
                              f"optimizer.overlap ({cfg.overlap}) must be below the {gap} steps between sends "
                              f"(sync_every {cfg.sync_every} / num_fragments {cfg.num_fragments})")
        return errors

    def heal_sends_model(self, step: int) -> bool:  # noqa: ARG002
        """Never: the optimizer's state holds the worker's parameters (``local_params``)."""
        return False

    def codec(self):
        return build_codec({"name": self.cfg.quantization})

    def fragments(self, model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        return fragment_params(named, self.cfg.num_fragments, self.cfg.pattern)

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, StreamingDiLoCo]:
        inner = functools.partial(adamw, model, self.cfg)
        optimizer = StreamingDiLoCo(self.fragments(model), inner, self.cfg, compressor=self.codec(), comm=self.comm)
        return model, optimizer

    @classmethod
    def report_lag(cls, cfg: StreamingDiLoCoConfig) -> int:
        """tau: a fragment's all-reduce is merged ``overlap`` inner steps after it starts."""
        return cfg.overlap

    @classmethod
    def comm_overlap(cls, cfg: StreamingDiLoCoConfig, parameters: int, compression=None) -> float:  # noqa: ARG003
        """A fragment is sent every sync_every / num_fragments steps and merged ``overlap``
        (tau) inner steps later: its exchange runs behind tau steps of compute. Under the
        quantized all-reduce only the all-to-all, about half of its bytes, is in flight then;
        the all-gather of the reduced chunks runs at the receive step, in the open."""
        hidden = min(1.0, cfg.overlap * cfg.num_fragments / cfg.sync_every)
        quantized = reduces_quantized(cfg.exchange, build_codec({"name": cfg.quantization}))
        return hidden / 2 if quantized else hidden

    def analytic_traffic(self, model: torch.nn.Module, world_size: int, *, warmup: bool = False,  # noqa: ARG002
                         ) -> WireBytes:
        """Every fragment's synchronisation once per H steps, each exchanged as configured
        (:func:`lowcomm.optim.diloco.sync_traffic`)."""
        dtype = next(model.parameters()).dtype
        per_fragment = [sync_traffic(shapes, self.codec(), self.cfg.exchange, world_size, dtype)
                        for shapes in self._fragment_shapes(model)]
        return WireBytes(*(sum(values) / self.cfg.sync_every for values in zip(*per_fragment, strict=True)))

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """None replicated; per rank, the most a checkpoint holds: the worker's parameters, the
        global fragments and their outer momentum, the inner AdamW's two moments, and the means
        of the fragments in flight at once (a fragment's, from the step it is sent until
        ``overlap`` steps later), the most over a cycle."""
        params = parameter_bytes(model)
        sizes = [sum(p.numel() * p.element_size() for p in fragment) for fragment in self.fragments(model)]
        period = self.cfg.sync_every
        # after step s, in flight: the exchanges sent at t in (s - overlap, s]
        in_flight = max(sum(sizes[index] for sent in range(step - self.cfg.overlap + 1, step + 1)
                            for index in fragments_sent_at(sent, len(sizes), period))
                        for step in range(period, 2 * period))
        outer = params * (2 if self.cfg.outer_momentum > 0 else 1)
        return 0.0, params + outer + 2 * params + in_flight

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
