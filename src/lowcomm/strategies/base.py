"""The strategy seam: how a named optimizer config becomes (wrapped model, optimizer).

A strategy is a class registered under the optimizer config's ``name`` with a dataclass
``Config`` that is the schema of ``configs/optimizer/<name>.yaml``. Adding an optimizer to the
harness means one such class and one config file; the training loop only ever calls the
methods below and never branches on a name.

Contract with the loop:
- ``build(model)`` returns the module to run forward/backward on and the optimizer whose
  ``step()`` does all communication (directly or through DDP comm hooks) via ``self.comm``;
- ``no_sync(model)`` wraps every micro-batch but the last of a step (gradient accumulation);
- the LR schedule multiplies each param group's ``initial_lr``; an optimizer that wraps
  another (DiLoCo) exposes in ``param_groups`` the groups the schedule should drive;
- ``replicated_optimizer_state``: True when every rank holds the same optimizer state, so
  checkpoints keep one copy; False means one file per rank, except the ``replicated_state_keys``
  of the optimizer's state dict (the same on every rank: DiLoCo's global parameters and outer
  momentum), which rank 0 writes once;
- ``checkpoint_bytes(model, local_world_size)``: (replicated, per-rank) bytes of a checkpoint,
  from shapes (the dry run checks them against the preemption lead time);
- ``extra_state()`` / ``load_extra_state()``: anything else to resume exactly (comm-hook state);
- ``model_state_dict`` / ``clip_grad_norm``: overridden by strategies that shard the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lowcomm.comm import Communicator

STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    if cls.name in STRATEGIES:
        raise ValueError(f"strategy {cls.name!r} registered twice")
    STRATEGIES[cls.name] = cls
    return cls


@dataclass
class OptimizerConfig:
    """Fields every optimizer config has. Subclasses add theirs.

    ``clip_global_norm``: whether the loop clips the gradient's global norm to
    ``train.max_grad_norm`` before the step. A per-strategy choice because not every method
    clips that way: DES-LOC's equations clip per coordinate instead (its default is false).
    ``decay_embeddings``: whether weight decay reaches the embedding (tied: also the output
    head). OLMo's default, which the DeMo paper follows, excludes it: false for every optimizer.
    """

    lr: float = 4e-4
    clip_global_norm: bool = True
    decay_embeddings: bool = False

    def validate(self) -> list[str]:
        return [] if self.lr > 0 else [f"optimizer.lr must be > 0, got {self.lr}"]


@dataclass
class AdamWFields(OptimizerConfig):
    """The fields of an AdamW-style update (every-step baselines, inner optimizers, DES-LOC),
    validated in one place. Defaults: OLMo's (and the DeMo paper's baseline)."""

    lr: float = 4e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8

    def validate(self) -> list[str]:
        errors = super().validate()
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            errors.append(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0:
            errors.append(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.eps > 0:
            errors.append(f"optimizer.eps must be > 0, got {self.eps}")
        return errors


def parameter_bytes(model: torch.nn.Module, *, trainable: bool = True, names: set[str] | None = None) -> float:
    """Bytes of the model's (trainable, or all) parameters, optionally only those in ``names``."""
    return float(sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if (p.requires_grad or not trainable) and (names is None or name in names)
    ))


class Strategy:
    name: ClassVar[str]
    Config: ClassVar[type[OptimizerConfig]] = OptimizerConfig
    # compression config names this strategy can send with (validated before launch)
    accepts_compression: ClassVar[tuple[str, ...]] = ("none",)
    replicated_optimizer_state: ClassVar[bool] = True
    replicated_state_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: OptimizerConfig, compression: dict[str, Any], comm: Communicator):
        self.cfg = cfg
        self.compression = compression
        self.comm = comm

    @classmethod
    def check_compression(cls, cfg: OptimizerConfig, compression: dict[str, Any]) -> list[str]:  # noqa: ARG003
        """Errors in how this optimizer's fields combine with the compression config."""
        return []

    @classmethod
    def check_layout(cls, cfg: OptimizerConfig, world_size: int, local_world_size: int) -> list[str]:  # noqa: ARG003
        """Errors in how this optimizer's fields fit the ranks it will run on (``world_size`` in
        all, ``local_world_size`` per node): checked before any process starts, so that nothing
        a worker would refuse at construction reaches a launch."""
        return []

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def no_sync(self, model: torch.nn.Module):  # noqa: ARG002 - the DDP strategies use it
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The bare model inside whatever ``build`` wrapped it in."""
        return getattr(model, "module", model)

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded model state (what a checkpoint's ``model.pt`` holds)."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)

    @property
    def clips_global_norm(self) -> bool:
        """Does the loop clip this strategy's gradient norm (``optimizer.clip_global_norm``)?"""
        return bool(getattr(self.cfg, "clip_global_norm", True))

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the gradients the optimizer will see (averaged under DDP, local otherwise)."""
        return float(torch.nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm))

    def extra_state(self) -> dict[str, Any]:
        return {}

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """(replicated, per-rank) bytes of the optimizer's checkpointed state, from shapes
        (``model`` may be on the meta device). Default: AdamW's two moments, the same on every
        rank."""
        return 2 * parameter_bytes(model), 0.0

    def checkpoint_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:
        """(written once, written by every rank) bytes of one checkpoint: the model and the
        optimizer state that every rank holds alike, and each rank's own state. Tensor data
        only: the files' framing adds a few hundred bytes per tensor."""
        replicated, per_rank = self.optimizer_state_bytes(model, local_world_size)
        return parameter_bytes(model, trainable=False) + replicated, per_rank

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        """Payload bytes per step and worker (amortised over sync periods), from shapes alone
        (``model`` may be on the meta device). Used by ``lowcomm-comm-table``."""
        raise NotImplementedError(f"strategy {self.name!r} has no analytic byte count")

    def warmup_payload_bytes(self, model: torch.nn.Module) -> float:
        """Payload bytes per step before the strategy's compression starts (PowerSGD's warm-up);
        the same as :meth:`analytic_payload_bytes` for strategies without a warm-up."""
        return self.analytic_payload_bytes(model)

    def wire_collective(self) -> str:
        """The collective that carries the payload (it sets tx/rx per worker for a given W)."""
        return "all_reduce"

    @classmethod
    def comm_overlap(cls, cfg: OptimizerConfig, parameters: int) -> float:  # noqa: ARG003
        """The share of a step's compute that this strategy's traffic can run behind, for a model
        of ``parameters`` parameters, in the wall-clock model (:mod:`lowcomm.report.wallclock`).
        0: every step waits for its bytes (DeMo's all-gathers follow the backward pass; DiLoCo's
        outer step waits for its sync)."""
        return 0.0

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"strategy {self.name!r} got extra state it does not know: {sorted(state)}")
