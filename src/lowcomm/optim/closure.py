"""The closure a ``torch.optim.Optimizer.step`` may take, evaluated as torch's optimizers do."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["closure_loss"]


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """Run ``closure`` (which recomputes the loss and its gradients) with gradients enabled,
    since ``step`` itself runs under ``torch.no_grad``; its loss, or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
