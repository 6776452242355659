"""Muon with its Newton-Schulz iteration run once per matrix shape, not once per matrix.

``torch.optim.Muon`` orthogonalises parameter after parameter: five iterations of three matrix
products and a norm each, about twenty kernels per matrix, so OLMo-300M's 64 hidden matrices
cost some 1,300 kernel launches a step, and the products themselves are small. The matrices of
one shape (in OLMo, every block's ``att_proj``, every ``attn_out``, ...) can be stacked and
iterated as one batch: the same products, as ``bmm``, once per shape. microsoft/dion does the
same for its Muon and reports host work, not FLOPs, as what limits such optimizers.

:class:`BatchedMuon` is ``torch.optim.Muon`` (its arguments, its state and ``state_dict``, its
momentum, Nesterov, weight decay and learning-rate adjustment) with that one change, and
:func:`lowcomm.optim.grouping.muon_adamw` (Muon-DDP, MuLoCo) uses it. On the CPU its updates
are bit for bit torch's (``tests/test_muon_ddp.py``; 30-step Muon-DDP and MuLoCo runs give the
same losses to the last bit), and a step takes as long: the products dominate there (OLMo-300M's
4 matrix shapes, 2 blocks: 5.0 s against 4.9 s, the stacking copies). On a GPU the batched
products may sum in another order (bfloat16 either way); its time there is not yet measured.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.optim._muon import _adjust_lr

from lowcomm.optim.closure import closure_loss

__all__ = ["BatchedMuon", "batched_newton_schulz"]


def batched_newton_schulz(
    matrices: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on a batch ``(B, m, n)`` of matrices, each on its
    own (in bfloat16, on the smaller Gram matrix, each normalised by its Frobenius norm), as
    torch's ``_zeropower_via_newtonschulz`` does for one."""
    a, b, c = coefficients
    x = matrices.bfloat16()
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if transposed else x


class BatchedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs once per shape (module doc)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            lr, momentum = group["lr"], group["momentum"]
            grads = [param.grad for param in params]
            buffers = []
            for param in params:
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
                buffers.append(state["momentum_buffer"])
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            by_shape: dict[torch.Size, list[int]] = defaultdict(list)
            for index, param in enumerate(params):
                by_shape[param.shape].append(index)
            for shape, indices in by_shape.items():
                stacked = torch.stack([updates[index] for index in indices])
                orthogonal = batched_newton_schulz(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"])
                same = [params[index] for index in indices]
                torch._foreach_mul_(same, 1 - lr * group["weight_decay"])
                torch._foreach_add_(same, list(orthogonal.unbind(0)),
                                    alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
        return loss
