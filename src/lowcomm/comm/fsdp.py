"""FSDP2's two collectives through a Communicator, so that its meter sees every parameter gather
and gradient reduction (``set_custom_all_gather`` / ``set_custom_reduce_scatter``).

They implement torch's ``AllGather`` and ``ReduceScatter`` interfaces
(``torch.distributed.fsdp._fully_shard._fsdp_api``) without subclassing them: importing that
module imports FSDP and DTensor, half a second at the start of every process (the launcher,
each worker), which only a run that shards needs. FSDP calls them and checks no type;
``tests/test_flexdemo.py`` checks that they have each method of the interfaces, with its
parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lowcomm.comm.communicator import Communicator

__all__ = ["MeteredAllGather", "MeteredReduceScatter"]


class MeteredAllGather:
    """FSDP2's parameter all-gather, through the sharding group's Communicator; ``purpose``
    says, at each call, whose traffic it is ("data", or "control" for validation's)."""

    def __init__(self, comm: Communicator, purpose: Callable[[], str]):
        self.comm, self.purpose = comm, purpose

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        _check_group(group, self.comm)
        return self.comm.all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op, purpose=self.purpose())


class MeteredReduceScatter:
    """FSDP2's gradient reduce-scatter, through the sharding group's Communicator. FSDP asks
    for the mean over the group (AVG), or for a plain sum when it divides itself."""

    _OPS = {dist.ReduceOp.AVG: "avg", dist.ReduceOp.SUM: "sum"}

    def __init__(self, comm: Communicator):
        self.comm = comm

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        _check_group(group, self.comm)
        if op not in self._OPS:
            raise ValueError(f"FlexDeMo's reduce-scatter supports AVG and SUM, FSDP asked for {op}")
        return self.comm.reduce_scatter(output_tensor, input_tensor, op=self._OPS[op], async_op=async_op)


def _check_group(group, comm: Communicator) -> None:
    if group is not comm.group:
        raise RuntimeError("FSDP issued a collective on a process group other than the sharding group's")
