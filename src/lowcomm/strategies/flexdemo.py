"""FlexDeMo as a strategy: FSDP2 inside each sharding group S, DeMo across the replication groups R
(see :mod:`lowcomm.optim.flexdemo` for the algorithm and the rank layout).

Why FSDP2 and not a sharding of lowcomm's own: ``fully_shard`` over a 1-D device mesh built from
the sharding group's own process group runs on CPU with gloo as on GPUs with NCCL, and its two
collectives can be replaced (``set_custom_all_gather`` / ``set_custom_reduce_scatter``). Both
go through the sharding group's Communicator here, so the meter sees every parameter gather
and gradient reduction under the scope ``intra``; DeMo's all-gathers run on the replication
group's Communicator under ``inter``. The mesh is 1-D on purpose: a 2-D (HSDP) mesh would make
FSDP all-reduce gradients across R itself, which is exactly what DeMo replaces. Nothing else
in FSDP2 communicates on this path: there is no initial broadcast (every rank builds the model
from the same seed or loads the same checkpoint), and this strategy never calls DTensor
operations that redistribute (the full state dict and the gradient norm are computed from
local shards with metered collectives).

Units and traffic per optimizer step, with M micro-batches (``reshard_after_forward`` is FSDP's
default: a transformer block frees its gathered parameters after forward and gathers them again
in backward; the root unit, the embedding, keeps them until backward)::

    intra all-gather     M x (2 x block shards + root shard)          payload = the padded shard
    intra reduce-scatter 1 per unit (accumulation waits for the last)  payload = the padded unit
    inter all-gather     DeMo's payload of the rank's shards           (per parameter)

Validation forwards gather the parameters too (the root frees its own right after); they are
metered as ``control`` traffic.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from lowcomm.comm import Communicator
from lowcomm.comm.fsdp import MeteredAllGather, MeteredReduceScatter
from lowcomm.comm.meter import reduce_scatter_bytes, ring_all_gather_bytes
from lowcomm.distenv import local_layout
from lowcomm.optim.flexdemo import (
    FlexDeMo,
    flexdemo_payload_bytes,
    hybrid_groups,
    is_dtensor,
    local_shard,
    row_shard,
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
from lowcomm.strategies.demo import DeMoConfig, DeMoStrategy

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

log = logging.getLogger("lowcomm.strategies.flexdemo")

# (payload, tx, rx) bytes per worker and optimizer step
ScopeBytes = tuple[float, float, float]


def layout_error(shard_size: int, world_size: int) -> str:
    return (f"optimizer.shard_group_size={shard_size} must divide the world size {world_size} "
            "(null takes the ranks per node)")


@dataclass(kw_only=True)
class FlexDeMoConfig(DeMoConfig):
    """``configs/optimizer/flexdemo.yaml``: DeMo's fields and the sharding group size
    (null: the ranks per node, ``LOCAL_WORLD_SIZE``)."""

    config_name: ClassVar[str] = "flexdemo"

    shard_group_size: int | None

    def errors(self) -> list[str]:
        errors = super().errors()
        if self.shard_group_size is not None and self.shard_group_size < 1:
            errors.append(f"shard_group_size must be null (the ranks per node) or >= 1, got {self.shard_group_size}")
        return errors


def _sharding_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP units, innermost first: each transformer block (OLMo's ``transformer.blocks``), then
    the root, which takes every remaining parameter (the tied embedding)."""
    blocks = getattr(getattr(model, "transformer", None), "blocks", None)
    return [*(blocks if blocks is not None else []), model]


@register
class FlexDeMoStrategy(DeMoStrategy):
    name = "flexdemo"
    Config = FlexDeMoConfig
    display = Display("FlexDeMo", marker="X", color="C4")
    quickstart = (Point("FlexDeMo 2x2", "optimizer.lr=6e-3", "optimizer.shard_group_size=2"),)
    table1_tiny = quickstart
    comm_table = (Row("FlexDeMo |S|=8", "optimizer.shard_group_size=8"),)
    cycle = Cycle(1, "optimizer.shard_group_size=2")
    replicated_optimizer_state = False  # each rank's momentum of its own shard

    def __init__(self, cfg: FlexDeMoConfig, compression: dict[str, Any], comm: Communicator):
        super().__init__(cfg, compression, comm)
        self.intra: Communicator | None = None
        self.inter: Communicator | None = None
        self._accumulating = False
        self._purpose = "data"

    def shard_group_size(self, local_world_size: int) -> int:
        """|S|: the configured size, or the ranks per node."""
        return self.cfg.shard_group_size or local_world_size

    @classmethod
    def check_layout(cls, cfg: FlexDeMoConfig, world_size: int, local_world_size: int) -> list[str]:
        shard_size = cfg.shard_group_size or local_world_size
        if world_size % shard_size:
            return [layout_error(shard_size, world_size)]
        return []

    # ----------------------------------------------------------------- build
    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, FlexDeMo]:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FlexDeMo shards the model with FSDP2, which needs torch.distributed initialised")
        world = self.comm.world_size
        local_rank, local_world = local_layout(self.comm.rank, world)
        shard_size = self.shard_group_size(local_world)
        if world % shard_size:
            raise ValueError(layout_error(shard_size, world))
        node_major = local_rank == self.comm.rank % local_world
        if local_world % shard_size or not node_major:
            # a sharding group is |S| consecutive ranks: one node's only when nodes hold whole
            # groups and ranks are numbered node by node (SLURM's default block distribution)
            reason = (f"{local_world} ranks per node is not a multiple of {shard_size}" if node_major
                      else "ranks are not numbered node by node: LOCAL_RANK != RANK mod LOCAL_WORLD_SIZE")
            log.warning("sharding groups of %d consecutive ranks span nodes (%s): 'intra' traffic crosses nodes",
                        shard_size, reason)
        sharding, replication = hybrid_groups(world, shard_size)
        self.intra = self.comm.split(sharding, "intra")
        self.inter = self.comm.split(replication, "inter")

        # imported here, not with the module: FSDP2 imports DTensor, half a second of every
        # process's start (the launcher's, every worker's) that only this strategy needs
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(self.intra.group, device.type, mesh_dim_names=("shard",))
        units = _sharding_units(model)
        gather = MeteredAllGather(self.intra, lambda: self._purpose)
        scatter = MeteredReduceScatter(self.intra)
        for unit in units:
            # FSDP's defaults, made explicit so that _before_forward can switch the root's
            fully_shard(unit, mesh=mesh, reshard_after_forward=unit is not model)
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
        # prepended, so it runs before FSDP's own pre-forward hook issues the root's all-gather
        model.register_forward_pre_hook(self._before_forward, prepend=True)

        return model, self.make_optimizer(model, self.inter, FlexDeMo)

    def _before_forward(self, module: FSDPModule, args: tuple) -> None:  # noqa: ARG002 - hook signature
        # FSDP reads the gradient-sync flag in backward, after the loop has left no_sync() (which,
        # as DDP's, only wraps the forward): so the flag is set here, at forward time.
        module.set_requires_gradient_sync(not self._accumulating)
        # a forward in eval mode is validation: its gathers are the harness's, not the optimizer's,
        # and with no backward to come the root frees its gathered parameters at once (otherwise
        # they would stay allocated and save the next training step its root all-gather)
        self._purpose = "data" if module.training else "control"
        module.set_reshard_after_forward(not module.training, recurse=False)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:  # noqa: ARG002 - the flag is ours
        """Forwards inside accumulate gradients unsharded; the reduce-scatter waits for the
        first forward outside (the last micro-batch)."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    # ----------------------------------------------------------- model state
    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full model on CPU, gathered (control traffic) inside rank 0's sharding group,
        one tensor at a time; rank 0 returns it, every other rank an empty dict (the
        checkpoint's ``model.pt`` is rank 0's)."""
        if self.comm.rank >= self.intra.world_size:  # not in rank 0's sharding group
            return {}
        full = {}
        for name, value in self.unwrap(model).state_dict().items():
            tensor = self._gather_rows(value) if is_dtensor(value) else value.detach()
            if self.comm.rank == 0:
                full[name] = tensor.cpu()
        return full

    def _gather_rows(self, sharded: DTensor) -> torch.Tensor:
        rows, size = sharded.shape[0], self.intra.world_size
        per_shard = math.ceil(rows / size)
        local = sharded.to_local().detach()
        # all-gather needs equal shapes: pad the (shorter or empty) trailing shards
        padded = local.new_zeros((per_shard, *local.shape[1:]))
        padded[: local.shape[0]] = local
        return torch.cat(self.intra.all_gather(padded, purpose="control"))[:rows]

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state: every rank copies its rows into its shards (no communication)."""
        own = self.unwrap(model).state_dict()
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        if missing or unexpected:
            raise KeyError(f"model state mismatch: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name, target in own.items():
                source = state[name]
                if tuple(source.shape) != tuple(target.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(source.shape)}, model {tuple(target.shape)}")
                if is_dtensor(target):
                    start, count = row_shard(source.shape[0], self.intra.world_size, self.intra.rank)
                    target.to_local().copy_(source.narrow(0, start, count))
                else:
                    target.copy_(source)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the sharding group's mean gradient (DeMo's input) by its global norm: the norm of
        the group's shard norms, gathered as control traffic. With |S| = 1 this is exactly
        ``torch.nn.utils.clip_grad_norm_``."""
        grads = [local_shard(p.grad) for p in self.unwrap(model).parameters() if p.grad is not None]
        device = next(self.unwrap(model).parameters()).device
        local_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
        shard_norms = self.intra.all_gather(local_norm.reshape(1), purpose="control")
        total_norm = torch.linalg.vector_norm(torch.cat(shard_norms))
        # clip_grad_norm_'s coefficient; clip_grads_with_norm_ itself wants parameters, not shards
        coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient)
        return float(total_norm)

    def extra_state(self) -> dict[str, Any]:
        return {"shard_group_size": self.intra.world_size}

    @classmethod
    def layout(cls, cfg: FlexDeMoConfig, local_world_size: int) -> dict[str, Any]:
        """Each rank's momentum is of its shard: rank r mod W' holds the same shard as rank r
        wherever the shard group size is the same (it divides every world size it runs on)."""
        return {"optimizer.shard_group_size": cfg.shard_group_size or local_world_size}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if state.get("shard_group_size") != self.intra.world_size:
            raise ValueError(
                f"the checkpoint's optimizer shards are for shard_group_size={state.get('shard_group_size')}, "
                f"this run has {self.intra.world_size}: resume with the same optimizer.shard_group_size"
            )

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:
        """The momentum of this rank's shards: about 1/|S| of the parameters per rank."""
        return 0.0, parameter_bytes(model) / self.shard_group_size(local_world_size)

    # --------------------------------------------------------------- bytes
    def analytic_scope_bytes(
        self, model: torch.nn.Module, world_size: int, local_world_size: int, micro_batches: int = 1,
        backend: str = "nccl",
    ) -> dict[str, ScopeBytes]:
        """(payload, tx, rx) per worker and optimizer step in the scopes ``intra`` and ``inter``,
        from shapes alone (``model`` may be on the meta device): the formulas of the module doc
        for ``micro_batches`` forward/backward passes per step, with the meter's conventions for
        ``backend`` (NCCL's ring reduce-scatter; gloo's is an all-reduce). The inter payload is
        averaged over shard indices (uneven row splits)."""
        shard_size = self.shard_group_size(local_world_size)
        replicas = len(hybrid_groups(world_size, shard_size)[1][0])
        intra = [0.0, 0.0, 0.0]
        if shard_size > 1:  # FSDP skips both collectives in a group of one
            units = _sharding_units(model)
            claimed: set[int] = set()
            for position, unit in enumerate(units):
                params = [p for p in unit.parameters() if id(p) not in claimed]
                claimed.update(id(p) for p in params)
                shard_bytes = sum(
                    math.ceil(p.shape[0] / shard_size) * math.prod(p.shape[1:]) * p.element_size() for p in params
                )
                is_root = position == len(units) - 1
                gathers = micro_batches * (1 if is_root else 2)
                tx, rx = ring_all_gather_bytes(shard_bytes, shard_size)
                scatter_tx, scatter_rx = reduce_scatter_bytes(shard_bytes * shard_size, shard_size, backend)
                intra[0] += gathers * shard_bytes + shard_bytes * shard_size
                intra[1] += gathers * tx + scatter_tx
                intra[2] += gathers * rx + scatter_rx
        params, cfg = trainable_parameters(model), self.cfg
        payload = flexdemo_payload_bytes([p.shape for p in params], shard_size, chunk=cfg.compression_chunk,
                                         topk=cfg.compression_topk, wire=cfg.wire, dtype=params[0].dtype)
        # a ring all-gather over R: every rank forwards the others' payloads, (|R|-1) x each way
        tx, rx = (float((replicas - 1) * payload),) * 2 if replicas > 1 else (0.0, 0.0)
        return {"intra": tuple(intra), "inter": (payload, tx, rx)}

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        """Intra + inter payload per step and worker (one micro-batch); needs an explicit
        ``shard_group_size`` (the ranks per node are not known from shapes)."""
        if self.cfg.shard_group_size is None:
            raise ValueError("analytic FlexDeMo bytes need optimizer.shard_group_size (null means the ranks per node)")
        size = self.cfg.shard_group_size
        return sum(payload for payload, _, _ in self.analytic_scope_bytes(model, size, size).values())
