"""FlexDeMo (From et al. 2025, arXiv 2502.06728): DeMo across nodes, the model sharded inside each.

The W ranks form a grid of sharding groups S (by default the ranks of one node) and replication
groups R (the ranks that hold the same shard on the other nodes)::

    rank r  ->  node r // |S|, shard index r % |S|
    S of r  =  the |S| consecutive ranks of its node        (fast links: NVLink, shared memory)
    R of r  =  the W / |S| ranks with r's shard index        (slow links: the network)

Inside S the model is sharded as in FSDP: each rank keeps about 1/|S| of every parameter, its
gradient and its optimizer state; gradients are reduce-scattered (mean) over S, and the
parameters all-gathered for each forward. Across R, DeMo replaces the gradient all-reduce: each
rank keeps the momentum of its shard's gradient, sends the top-k DCT coefficients of every
block of it, all-gathers over R only, and applies the aggregate to its shard. FlexDeMo is DeMo
when |S| = 1 and FSDP with DeMo's update rule (nothing crosses nodes) when |S| = W.

This module is the optimizer half: :class:`FlexDeMo` runs :class:`~lowcomm.optim.DeMo` (the same
code, codec and state) on the rank's local shards. The sharding half, FSDP2 with every
collective routed through the Communicator, is :mod:`lowcomm.strategies.flexdemo`.

Shard layout. FSDP2 shards each parameter by rows (dim 0, ``torch.chunk`` rule): a shard is a
``ceil(n0 / |S|) x ...`` slab (the last ones shorter, possibly empty). DeMo then cuts each slab
into blocks with its own chunk rule, so the 2-D DCT of DeMo is kept. When the slab's row count
is a multiple of the DCT chunk (every OLMo matrix with |S| = 8 except the embedding) the blocks
are exactly DeMo's blocks of the full matrix; the reference instead runs a 1-D DCT over FSDP1's
flat shard. With |S| = 1 the shard is the parameter and FlexDeMo computes exactly what DeMo does.
Everything DeMo does per parameter is done per shard: ``base="muon"`` orthogonalises each row
slab, not the whole matrix.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence

import torch

from lowcomm.comm import Communicator
from lowcomm.optim.closure import closure_loss
from lowcomm.optim.demo import DeMo, DeMoArgs, demo_payload_bytes

__all__ = ["FlexDeMo", "flexdemo_payload_bytes", "is_dtensor", "local_shard"]


def hybrid_groups(world_size: int, shard_group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The sharding groups (consecutive ranks: one node when ``shard_group_size`` is the ranks
    per node) and the replication groups (the ranks with the same index in their sharding
    group), as lists of global ranks."""
    if shard_group_size < 1 or world_size % shard_group_size:
        raise ValueError(
            f"the shard group size must divide the world size: {shard_group_size} does not divide {world_size}"
        )
    replicas = world_size // shard_group_size
    sharding = [[node * shard_group_size + index for index in range(shard_group_size)] for node in range(replicas)]
    replication = [[node * shard_group_size + index for node in range(replicas)] for index in range(shard_group_size)]
    return sharding, replication


def row_shard(rows: int, shard_group_size: int, index: int) -> tuple[int, int]:
    """(first row, row count) of shard ``index`` of a dimension of ``rows`` rows under FSDP's
    ``torch.chunk`` rule: shards of ``ceil(rows / |S|)`` rows, the last ones shorter or empty."""
    per_shard = math.ceil(rows / shard_group_size)
    start = min(index * per_shard, rows)
    return start, min(per_shard, rows - start)


def shard_shape(shape: Sequence[int], shard_group_size: int, index: int) -> tuple[int, ...]:
    """The shape of shard ``index`` of a tensor of ``shape`` (row-sharded; a scalar is not split)."""
    if len(shape) == 0:
        return tuple(shape)
    return (row_shard(shape[0], shard_group_size, index)[1], *shape[1:])


def flexdemo_payload_bytes(
    shapes: Iterable[Sequence[int]],
    shard_group_size: int,
    chunk: int = 64,
    topk: int = 32,
    wire: str = "paper",
    dtype: torch.dtype = torch.float32,
) -> float:
    """DeMo's payload per step over the replication group, averaged over the shard indices
    (shards of uneven row counts send different amounts; empty shards send nothing)."""
    shapes = [tuple(shape) for shape in shapes]
    per_index = []
    for index in range(shard_group_size):
        local = [shard_shape(shape, shard_group_size, index) for shape in shapes]
        per_index.append(
            demo_payload_bytes([s for s in local if math.prod(s) > 0], chunk=chunk, topk=topk, wire=wire, dtype=dtype)
        )
    return sum(per_index) / shard_group_size


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor`` (half a
    second at the start of every process, which most never shard): no DTensor exists before
    that module is imported (FSDP2 imports it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage); a plain tensor is its own shard."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


class FlexDeMo(DeMo):
    """DeMo on the local shards of row-sharded parameters, communicating over a replication group.

    ``params`` are the model's parameters as the sharding left them: DTensors (FSDP2, one shard
    per rank) or plain tensors (no sharding: then this is DeMo). The optimizer state, its
    ``state_dict()`` and the parameter groups the LR schedule drives are DeMo's, over the local
    shards; ``step()`` reads each parameter's (reduce-scattered) gradient shard and updates the
    shard in place, so the next all-gather sees the new values.

    Every rank of a replication group holds the same shard index, so their shards have equal
    shapes and DeMo's per-parameter all-gathers line up. Parameters whose shard is empty on
    this rank (fewer rows than the sharding group has ranks) are empty on every rank of its
    replication group too, and are left out.

    Args:
        params: parameters or param groups, as for :class:`~lowcomm.optim.DeMo`.
        args: :class:`~lowcomm.optim.demo.DeMoArgs`.
        comm: the Communicator of this rank's replication group (what DeMo all-gathers over).
    """

    graphable = False  # each step re-points the shards, which a captured step would not see

    def __init__(self, params, args: DeMoArgs, comm: Communicator | None = None):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._params: list[torch.Tensor] = []
        self._shards: list[tuple[torch.Tensor, torch.Tensor]] = []
        local_groups = []
        for group in groups:
            local_params = []
            for param in group["params"]:
                self._params.append(param)
                shard = local_shard(param).detach()
                if shard.numel():
                    self._shards.append((param, shard))
                    local_params.append(shard)
            local_groups.append({**group, "params": local_params})
        super().__init__(local_groups, args, comm)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for param, shard in self._shards:
            # FSDP re-pads and replaces a shard's storage when the module is moved or loaded with
            # assign=True; re-pointing keeps the optimizer's tensors (its state keys) the same.
            shard.data = local_shard(param).detach()
            shard.grad = None if param.grad is None else local_shard(param.grad)
        super().step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the parameters (where FSDP accumulates) and of the shards."""
        super().zero_grad(set_to_none)
        for param in self._params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.zero_()
