"""``powersgd``: PyTorch DDP with a layer-wise PowerSGD comm hook, then AdamW.

The algorithm (and why lowcomm has its own, metered, re-implementation of torch's hook) is
:mod:`lowcomm.optim.powersgd`; this module only plugs it into DDP and the config.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at runtime.
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from lowcomm.optim.grouping import AdamWArgs, adamw
from lowcomm.optim.powersgd import (
    PowerSGDArgs,
    PowerSGDReducer,
    compression_rank,
    matrix_dims,
    powersgd_payload_bytes,
)
from lowcomm.strategies.base import (
    Cycle,
    Display,
    Point,
    Row,
    parameter_bytes,
    register,
    trainable_parameters,
)
from lowcomm.strategies.ddp import DDPConfig, DDPStrategy, dense_gradient_bytes, metered_allreduce_hook


def powersgd_hook(
    reducer: PowerSGDReducer, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the plain metered average until ``start_powerSGD_iter``, PowerSGD after."""
    if not reducer.compressing:
        future = metered_allreduce_hook(reducer.comm, bucket)
    else:
        names = [reducer.name_of(param) for param in bucket.parameters()]
        reducer.average_(list(zip(names, bucket.gradients(), strict=True)))
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
    if bucket.is_last():
        reducer.iteration += 1
    return future


@dataclass(kw_only=True)
class PowerSGDConfig(DDPConfig, AdamWArgs, PowerSGDArgs):
    """``configs/optimizer/powersgd.yaml``: AdamW on the PowerSGD-averaged gradient; the other
    fields are ``PowerSGDState``'s (defaults: the DeMo paper's rank 32 and 1000 warm-up steps).
    P, Q and the uncompressed tensors travel in the gradients' dtype."""

    config_name: ClassVar[str] = "powersgd"


@register
class PowerSGD(DDPStrategy):
    """DDP with the PowerSGD comm hook, then AdamW on the averaged gradient.

    The error-feedback buffers differ between workers, so the hook's state is saved per rank
    through :meth:`extra_state`; AdamW's state stays replicated (every worker applies it to the
    same averaged gradient).
    """

    name = "powersgd"
    replica_groups_refusal = (
        "its comm hook's low-rank exchange and per-worker error feedback run inside DDP's backward over the "
        "world's process group; a rejoining worker's error feedback has no peer copy")
    Config = PowerSGDConfig
    display = Display("PowerSGD", marker="P", color="C2")
    quickstart = (Point("PowerSGD r=8", "optimizer.lr=3e-3", "optimizer.matrix_approximation_rank=8",
                        "optimizer.start_powerSGD_iter=20"),)
    table1_tiny = quickstart
    comm_table = (Row("PowerSGD r=32 (before warm-up)", warmup=True),
                  Row("PowerSGD r=32 (after warm-up)", "optimizer.start_powerSGD_iter=0"))
    mid_period = ("optimizer.start_powerSGD_iter=2",)  # the checkpoint after compression starts
    cycle = Cycle(1, "optimizer.start_powerSGD_iter=0")

    reducer: PowerSGDReducer

    def register_hook(self, ddp: DistributedDataParallel) -> None:
        self.reducer = PowerSGDReducer(self.comm, ddp.module.named_parameters(), self.cfg)
        ddp.register_comm_hook(self.reducer, powersgd_hook)

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.AdamW:
        return adamw(model, self.cfg)

    def extra_state(self) -> dict[str, Any]:
        return {"powersgd": self.reducer.state_dict()}

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """AdamW's moments (the same on every rank); per rank, the reducer's error feedback and
        warm-start Q of every compressed matrix (in the rank's own file)."""
        cfg, per_rank = self.cfg, 0.0
        for p in model.parameters():
            rank = compression_rank(p.shape, cfg.matrix_approximation_rank, cfg.min_compression_rate)
            if p.requires_grad and rank:
                per_rank += (p.numel() + matrix_dims(p.shape)[1] * rank) * p.element_size()
        return 2 * parameter_bytes(model), per_rank

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.reducer.load_state_dict(state["powersgd"])

    def analytic_payload_bytes(self, model: torch.nn.Module) -> int:
        """Per worker and step once compression has started (after ``start_powerSGD_iter``)."""
        params = trainable_parameters(model)
        return powersgd_payload_bytes(
            [p.shape for p in params], self.cfg.matrix_approximation_rank, self.cfg.min_compression_rate,
            params[0].dtype,
        )

    def warmup_payload_bytes(self, model: torch.nn.Module) -> int:
        """Per worker and step before ``start_powerSGD_iter``: the dense gradient."""
        return dense_gradient_bytes(model)
