"""DES-LOC (Iacob et al., arXiv 2505.22549): local Adam whose parameters, first moment and
second moment are each averaged over the workers on their own period.

Step t = 1, 2, ... (``t`` counts calls to ``step()``) on worker m, with the local gradient g
taken at the worker's own theta_t, exactly the paper's equations::

    g   <- clip(g, -rho, rho)                              # per coordinate
    if t % K_u == 0:  m <- mean_workers(m)                 # m_{t-1}, before it is used
    m   <- beta1 m + (1 - beta1) g
    if t % K_v == 0:  v <- mean_workers(v)                 # v_{t-1}, before it is used
    v   <- beta2 v + (1 - beta2) g * g
    if t % K_x == 0:  theta <- mean_workers(theta)         # theta_t, before the update
    theta <- theta (1 - lr wd)                             # decoupled weight decay (AdamW)
    theta <- theta - lr m_hat / (sqrt(v_hat) + eps)        # m_hat = m, v_hat = v unless bias_correction

So theta_{t+1}^m = mean(theta_t) - lr u_t^m: right after a step with t % K_x == 0 the workers
differ by their own updates only, and every state is averaged before it is next used.

Bytes: at step t, one all-reduce of each state whose period divides t (the parameters' dtype);
amortised, numel * bytes * (1/K_x + 1/K_u + 1/K_v) per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.optim.closure import closure_loss
from lowcomm.optim.grouping import AdamArgs

__all__ = ["DESLoc", "DESLocArgs"]


@dataclass(kw_only=True)
class DESLocArgs(AdamArgs):
    """DES-LOC's arguments: Adam(W)'s (``lr``, ``betas``, ``eps``, decoupled ``weight_decay``)
    and its own; defaults in ``configs/optimizer/desloc.yaml``.

    clip: rho, the per-coordinate gradient clip (None: no clipping).
    sync_x: K_x, the parameter averaging period.
    sync_u, sync_v: K_u, K_v for the first and second moments (None: 3 K_x and 6 K_x, the
        paper's recommendation from the moments' half-lives).
    bias_correction: divide m, v by (1 - beta^t) as Adam does; the paper's update has none.
    """

    config_name: ClassVar[str] = "desloc"

    clip: float | None
    sync_x: int
    sync_u: int | None
    sync_v: int | None
    bias_correction: bool

    def errors(self) -> list[str]:
        errors = super().errors()
        if self.clip is not None and not self.clip > 0:
            errors.append(f"clip must be null or > 0, got {self.clip}")
        for name in ("sync_x", "sync_u", "sync_v"):
            period = getattr(self, name)
            if period is not None and period < 1:
                errors.append(f"{name} must be >= 1, got {period}")
        return errors


class DESLoc(torch.optim.Optimizer):
    """Adam with per-coordinate clipping and desynchronised averaging of theta, m and v.

    Args:
        params: parameters or param groups (groups may override ``lr``, ``betas``, ``eps``,
            ``weight_decay``); every worker must start from identical values.
        args: :class:`DESLocArgs`.
        comm: the workers' Communicator (None: the default process group, or one process).

    Parameters without a gradient at a step keep their values and moments but still take part
    in every average, so all workers issue the same collectives.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        args: DESLocArgs,
        comm: Communicator | None = None,
    ):
        args.check()
        defaults = dict(lr=args.lr, betas=tuple(args.betas), eps=args.eps, weight_decay=args.weight_decay)
        super().__init__(params, defaults)
        self.clip = args.clip
        self.sync_x = args.sync_x
        self.sync_u = 3 * args.sync_x if args.sync_u is None else args.sync_u
        self.sync_v = 6 * args.sync_x if args.sync_v is None else args.sync_v
        self.bias_correction = args.bias_correction
        self.comm = comm if comm is not None else Communicator()
        self.steps_taken = 0
        # Eager state: every worker must hold (and average) the moments of every parameter
        # from the first sync on, whether or not it has seen a gradient for it yet.
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _average(self, tensors: list[torch.Tensor]) -> None:
        works = [self.comm.all_reduce(tensor, op="avg", async_op=True) for tensor in tensors]
        for work in works:
            work.wait()

    def _all_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = closure_loss(closure)
        step = self.steps_taken + 1
        params = self._all_params()
        if step % self.sync_u == 0:
            self._average([self.state[p]["exp_avg"] for p in params])
        if step % self.sync_v == 0:
            self._average([self.state[p]["exp_avg_sq"] for p in params])
        if step % self.sync_x == 0:
            self._average(params)

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            step_size = lr / (1 - beta1**step) if self.bias_correction else lr
            second_moment_scale = (1 - beta2**step) ** 0.5 if self.bias_correction else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if self.clip is None else p.grad.clamp(-self.clip, self.clip)
                exp_avg, exp_avg_sq = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                denominator = (exp_avg_sq.sqrt() / second_moment_scale).add_(group["eps"])
                p.addcdiv_(exp_avg, denominator, value=-step_size)
        self.steps_taken = step
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Adam's state, the step count, and this worker's own parameters: between their
        averages they differ from rank 0's, which is all a checkpoint's model file holds."""
        state = super().state_dict()
        state["steps_taken"] = self.steps_taken
        state["local_params"] = [p.detach() for group in self.param_groups for p in group["params"]]
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.steps_taken = int(state_dict.pop("steps_taken"))
        local = state_dict.pop("local_params", None)  # absent in checkpoints written before it was saved
        super().load_state_dict(state_dict)
        if local is not None:
            params = [p for group in self.param_groups for p in group["params"]]
            for param, saved in zip(params, local, strict=True):
                param.copy_(saved)

    @staticmethod
    def amortized_payload_bytes(
        shapes: Iterable[torch.Size | tuple[int, ...]],
        sync_x: int,
        sync_u: int | None = None,
        sync_v: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> float:
        """Average payload bytes per step and worker: numel * bytes * (1/K_x + 1/K_u + 1/K_v)."""
        sync_u = 3 * sync_x if sync_u is None else sync_u
        sync_v = 6 * sync_x if sync_v is None else sync_v
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        return numel * dtype.itemsize * (1 / sync_x + 1 / sync_u + 1 / sync_v)
