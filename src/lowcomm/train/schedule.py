"""Linear warm-up, then cosine decay to ``alpha_f`` x the base learning rate."""

from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, alpha_f: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(max_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return alpha_f + (1 - alpha_f) * 0.5 * (1 + math.cos(math.pi * progress))


def apply_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> float:
    """Set every param group's lr to its base lr x ``multiplier``; return the first group's lr.
    The base lr is remembered in the group as ``initial_lr`` the first time (as torch's
    schedulers do), so this is stateless across checkpoints."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * multiplier
    return optimizer.param_groups[0]["lr"]
