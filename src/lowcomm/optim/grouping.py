"""Muon for the hidden weight matrices, AdamW for everything else, as one optimizer.

Muon orthogonalises a 2-D update, which suits the hidden linear maps of a transformer but not
lookup tables or the output head (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for
LLM Training"), nor vectors. :func:`split_muon_adamw` sorts a model's trainable parameters by
name and shape:

- Muon: every 2-D weight that is neither an embedding nor the output head;
- AdamW: embeddings (``transformer.wte``, ``transformer.wpe``, or any ``nn.Embedding``), the
  untied output head (``transformer.ff_out``; tied models have none), every 1-D (and any
  other non-2-D) parameter.

:func:`muon_adamw` builds :class:`~lowcomm.optim.muon.BatchedMuon` (``torch.optim.Muon``, its
Newton-Schulz iteration batched by shape) and ``torch.optim.AdamW`` over the two sets and
joins them in a :class:`CombinedOptimizer`, whose ``param_groups`` are the union of theirs, so
an LR schedule that multiplies each group's ``initial_lr`` drives both learning rates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.optim.args import Args, one_of_error
from lowcomm.optim.closure import closure_loss
from lowcomm.optim.muon import BatchedMuon

__all__ = ["AdamArgs", "AdamWArgs", "CombinedOptimizer", "MuonArgs", "adamw", "muon_adamw", "split_muon_adamw", "weight_decay_groups"]

# Module names (in OLMo's naming) whose weights are tables or the vocabulary head, not hidden maps.
# `transformer.ff_out` is the top-level head; the blocks' `transformer.blocks.<i>.ff_out` are hidden.
ADAMW_MODULES: frozenset[str] = frozenset({"transformer.wte", "transformer.wpe", "transformer.ff_out"})

ADJUST_LR_FNS = ("original", "match_rms_adamw")


@dataclass(frozen=True)
class MuonSplit:
    """Parameter names of a model (trainable only), in ``named_parameters`` order."""

    muon: list[str]
    adamw: list[str]


def split_muon_adamw(model: torch.nn.Module) -> MuonSplit:
    """Which of ``model``'s trainable parameters Muon updates, and which AdamW does.

    Works on any device, including ``meta`` (only names and shapes are read).
    """
    embedding_modules = {
        name for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)
    }
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        owner = name.rpartition(".")[0]
        hidden_matrix = param.ndim == 2 and owner not in ADAMW_MODULES and owner not in embedding_modules
        (muon if hidden_matrix else adamw).append(name)
    return MuonSplit(muon=muon, adamw=adamw)


def embedding_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s embedding tables: weights of ``nn.Embedding`` modules and of OLMo's
    ``transformer.wte`` / ``transformer.wpe`` (with tied weights ``wte`` is the head too)."""
    owners = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    owners |= {"transformer.wte", "transformer.wpe"}
    return {name for name, _ in model.named_parameters() if name.rpartition(".")[0] in owners}


def weight_decay_groups(
    model: torch.nn.Module,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    weight_decay: float,
    decay_embeddings: bool = False,
) -> list[dict[str, Any]]:
    """Param groups for an optimizer with decoupled weight decay: ``params`` (default: every
    trainable parameter of ``model``) in model order, the embeddings in a group of their own
    with ``weight_decay`` 0 unless ``decay_embeddings``. OLMo's default (``decay_embeddings:
    false``), which the DeMo paper says its baselines follow: decay shrinks a table row only
    while its token is absent from the batch, which pulls rare tokens towards zero."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if params is not None:
        wanted = {id(p) for p in params}
        named = [(name, p) for name, p in named if id(p) in wanted]
        if len(named) != len(wanted):
            raise ValueError("params must be trainable parameters of model")
    if decay_embeddings:
        return [{"params": [p for _, p in named], "weight_decay": weight_decay}]
    embeddings = embedding_parameter_names(model)
    groups = [
        {"params": [p for name, p in named if name not in embeddings], "weight_decay": weight_decay},
        {"params": [p for name, p in named if name in embeddings], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together as one.

    ``param_groups`` is the concatenation of the parts' groups (the same dict objects, so
    setting a group's ``lr`` reaches the part that owns it); ``step``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` delegate to every part. The state dict holds one
    entry per part name.

    Args:
        parts: name -> optimizer; no parameter may appear in two parts.
    """

    def __init__(self, parts: Mapping[str, torch.optim.Optimizer]):
        if not parts:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.parts = dict(parts)
        params = [p for part in self.parts.values() for group in part.param_groups for p in group["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter is managed by more than one of the combined optimizers")
        super().__init__(params, defaults={})
        # Replace the copies Optimizer.__init__ made with the parts' own group dicts.
        self.param_groups = [group for part in self.parts.values() for group in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = closure_loss(closure)
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != set(self.parts):
            raise ValueError(
                f"optimizer state has parts {sorted(state_dict)}, this optimizer has {sorted(self.parts)}"
            )
        for name, part in self.parts.items():
            # torch's load_state_dict swaps in new group dicts; copy them into the existing ones so
            # that this optimizer's param_groups, and anything holding them (an LR schedule, an
            # outer optimizer such as DiLoCo), keep driving the parts after a resume.
            live_groups = part.param_groups
            part.load_state_dict(state_dict[name])
            for live, loaded in zip(live_groups, part.param_groups, strict=True):
                live.clear()
                live.update(loaded)
            part.param_groups = live_groups


@dataclass(kw_only=True)
class AdamArgs(Args):
    """Adam(W)'s hyperparameters (``torch.optim.AdamW``'s; DES-LOC's Adam too)."""

    lr: float
    weight_decay: float
    betas: list[float]
    eps: float

    def errors(self) -> list[str]:
        errors = super().errors()
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            errors.append(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0:
            errors.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not self.eps > 0:
            errors.append(f"eps must be > 0, got {self.eps}")
        return errors


@dataclass(kw_only=True)
class AdamWArgs(AdamArgs):
    """AdamW over a model (:func:`adamw`): Adam's hyperparameters and whether weight decay
    reaches the embedding (tied: also the output head; see :func:`weight_decay_groups`).
    Defaults, OLMo's and the DeMo paper's baseline, in ``configs/optimizer/adamw_ddp.yaml``."""

    config_name: ClassVar[str] = "adamw_ddp"

    decay_embeddings: bool


def adamw(model: torch.nn.Module, args: AdamWArgs, params: Iterable[torch.nn.Parameter] | None = None,
          ) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``params`` of ``model`` (default: every trainable parameter),
    the embeddings in an undecayed group of their own unless ``args.decay_embeddings``.

    On a GPU it is torch's fused AdamW: one kernel for every parameter of a group, where the
    for-each default launches several per step (what OLMo-core trains with). On CPU it is the
    for-loop default: its results are the ones the committed tables were measured with (fused is
    not bit-identical: it orders the arithmetic differently)."""
    args.check()
    groups = weight_decay_groups(model, params, weight_decay=args.weight_decay,
                                 decay_embeddings=args.decay_embeddings)
    on_gpu = all(p.is_cuda for group in groups for p in group["params"]) and any(g["params"] for g in groups)
    return torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), eps=args.eps,
                             weight_decay=args.weight_decay, fused=True if on_gpu else None)


@dataclass(kw_only=True)
class MuonArgs(AdamWArgs):
    """Muon's arguments in :func:`muon_adamw`, beside AdamW's (defaults in
    ``configs/optimizer/muon_ddp.yaml``). Prefixed so that they cannot clash with an outer
    optimizer's (DiLoCo's ``nesterov``).

    lr: Muon's learning rate, before ``adjust_lr_fn`` scales it per matrix; the weight decay
        of the Muon group is applied as ``lr * weight_decay`` (unscaled), as in torch's Muon.
    adamw_lr: AdamW's learning rate; None means ``lr`` (Moonlight's recipe: with
        ``match_rms_adamw`` the two share one value).
    muon_momentum, muon_nesterov, ns_steps: Muon's momentum (an EMA in torch's implementation;
        the Newton-Schulz orthogonalisation makes the update scale-free) and its iterations.
    adjust_lr_fn: ``match_rms_adamw`` (Moonlight: lr x 0.2 sqrt(max(A, B)), so the update RMS
        matches AdamW's) or ``original`` (Keller Jordan: lr x sqrt(max(1, A / B))).
    """

    config_name: ClassVar[str] = "muon_ddp"

    adamw_lr: float | None
    muon_momentum: float
    muon_nesterov: bool
    adjust_lr_fn: str
    ns_steps: int

    def errors(self) -> list[str]:
        errors = super().errors()
        if self.adamw_lr is not None and not self.adamw_lr > 0:
            errors.append(f"adamw_lr must be null or > 0, got {self.adamw_lr}")
        if not 0 <= self.muon_momentum < 1:
            errors.append(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        errors += one_of_error("adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR_FNS)
        if not 1 <= self.ns_steps < 100:
            errors.append(f"ns_steps must be in [1, 100), got {self.ns_steps}")
        return errors


def muon_adamw(model: torch.nn.Module, args: MuonArgs, params: Iterable[torch.nn.Parameter] | None = None,
               ) -> CombinedOptimizer:
    """Muon on ``model``'s hidden matrices and AdamW on the rest (see :func:`split_muon_adamw`),
    restricted to ``params`` of ``model`` (default: all trainable ones); AdamW's weight decay
    spares the embeddings unless ``args.decay_embeddings`` (Muon never holds them).

    Returns a :class:`CombinedOptimizer` with parts ``muon`` and ``adamw`` (a part with no
    parameters is left out).
    """
    args.check()
    named = dict(model.named_parameters())
    split = split_muon_adamw(model)
    if params is None:
        params = [p for p in named.values() if p.requires_grad]
    wanted = {id(p) for p in params}
    muon_params = [named[name] for name in split.muon if id(named[name]) in wanted]
    adamw_params = [named[name] for name in split.adamw if id(named[name]) in wanted]
    if len(muon_params) + len(adamw_params) != len(wanted):
        raise ValueError("params must be trainable parameters of model")
    parts: dict[str, torch.optim.Optimizer] = {}
    if muon_params:
        parts["muon"] = BatchedMuon(
            muon_params, lr=args.lr, weight_decay=args.weight_decay, momentum=args.muon_momentum,
            nesterov=args.muon_nesterov, ns_steps=args.ns_steps, adjust_lr_fn=args.adjust_lr_fn,
        )
    if adamw_params:
        parts["adamw"] = adamw(model, dataclasses.replace(args, lr=args.lr if args.adamw_lr is None else args.adamw_lr),
                               adamw_params)
    return CombinedOptimizer(parts)
