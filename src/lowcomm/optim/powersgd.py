"""PowerSGD (Vogels et al. 2019): layer-wise low-rank averaging of gradients with error feedback.

Why PowerSGD is re-implemented here rather than used from
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: that hook calls
``dist.all_reduce`` itself, on the process group in its state, so its bytes would bypass the
Communicator's meter (and a wrapper object cannot stand in for a C++ ProcessGroup). The
:class:`PowerSGDReducer` follows the same algorithm and the same rules:

- skip rule: a gradient viewed as n x m (``shape[0]`` x the rest, so a vector is n x 1) is
  compressed at rank r = min(n, m, rank) only if (n + m) r * min_compression_rate < n m;
  all other tensors of a bucket are all-reduced whole, in one flat buffer;
- before ``start_powerSGD_iter`` optimizer steps every bucket is all-reduced whole;
- per compressed matrix M (with the error added): P = M Q, all-reduce P (sum), orthonormalise
  P, Q = M^T P, all-reduce Q and divide by W, M <- P Q^T;
- orthonormalisation: Gram-Schmidt (with ``orthogonalization_epsilon``) for r <= 2 or half
  precision, QR otherwise;
- warm start: Q of the previous step, re-orthonormalised, replaces the random start;
- error feedback: what the approximation left out of this worker's (gradient + error) is
  added to its next gradient.

Three deliberate differences, none of which changes the averaged gradient:

1. State (error, Q) is kept per parameter (by name), not per bucket index. DDP rebuilds its
   buckets after the first step and a resumed run starts with the initial layout again, so
   per-bucket state would not survive a resume; per parameter it does, and the restriction
   ``start_powerSGD_iter > 1`` of torch's hook is not needed.
2. Error feedback covers the compressed matrices only. torch's hook also stores, for the
   tensors it all-reduces whole, each worker's deviation from the mean; those deviations sum
   to zero over the workers, so adding them back leaves the next average unchanged.
3. The random start Q of a parameter is drawn from a generator seeded by
   (``random_seed``, step, parameter index) instead of one NumPy stream per bucket, so it is
   the same on every worker and independent of the bucket layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from lowcomm.comm import Communicator
from lowcomm.optim.args import Args

__all__ = ["PowerSGDArgs", "PowerSGDReducer"]


@dataclass(kw_only=True)
class PowerSGDArgs(Args):
    """:class:`PowerSGDReducer`'s arguments, as in
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``; defaults (the
    DeMo paper's rank 32 and 1000 warm-up steps) in ``configs/optimizer/powersgd.yaml``."""

    config_name: ClassVar[str] = "powersgd"

    matrix_approximation_rank: int
    start_powerSGD_iter: int
    min_compression_rate: float
    use_error_feedback: bool
    warm_start: bool
    orthogonalization_epsilon: float
    random_seed: int

    def errors(self) -> list[str]:
        errors = super().errors()
        if self.matrix_approximation_rank < 1:
            errors.append(f"matrix_approximation_rank must be >= 1, got {self.matrix_approximation_rank}")
        for name in ("start_powerSGD_iter", "min_compression_rate", "orthogonalization_epsilon", "random_seed"):
            if getattr(self, name) < 0:
                errors.append(f"{name} must be >= 0, got {getattr(self, name)}")
        return errors


def matrix_dims(shape: Sequence[int]) -> tuple[int, int]:
    """How PowerSGD views a gradient: ``shape[0]`` rows by the product of the rest."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(size) for size in shape[1:])


def compression_rank(shape: Sequence[int], matrix_approximation_rank: int, min_compression_rate: float) -> int:
    """The rank a gradient of ``shape`` is compressed at, or 0 when it is sent whole (the skip
    rule of torch's hook: (n + m) r * min_compression_rate < n m, with r = min(n, m, rank))."""
    rows, cols = matrix_dims(shape)
    rank = min(rows, cols, matrix_approximation_rank)
    return rank if (rows + cols) * rank * min_compression_rate < rows * cols else 0


def powersgd_payload_bytes(
    shapes: Iterable[Sequence[int]],
    matrix_approximation_rank: int,
    min_compression_rate: float,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Payload bytes per worker of one compressed step: P and Q, (n + m) r elements, for each
    compressed matrix, and every element of the other tensors."""
    elements = 0
    for shape in shapes:
        rows, cols = matrix_dims(shape)
        rank = compression_rank(shape, matrix_approximation_rank, min_compression_rate)
        elements += (rows + cols) * rank if rank else rows * cols
    return elements * dtype.itemsize


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the r columns of an n x r matrix (r <= n) in place, as torch's PowerSGD
    does: Gram-Schmidt for r <= 2 or half precision (where QR is unavailable or slower), QR
    otherwise. ``epsilon`` guards Gram-Schmidt against an all-zero column."""
    rank = matrix.shape[1]
    if rank <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            column = matrix[:, i : i + 1]
            column.div_(column.norm() + epsilon)
            if i + 1 < rank:
                rest = matrix[:, i + 1 :]
                rest.sub_((column * rest).sum(dim=0, keepdim=True) * column)
    else:
        matrix.copy_(torch.linalg.qr(matrix).Q)
    return matrix


class PowerSGDReducer:
    """Layer-wise PowerSGD averaging of gradients over the Communicator's workers (see the
    module docstring for the algorithm and how it relates to torch's ``powerSGD_hook``).

    Args:
        comm: the workers' Communicator; every collective goes through it.
        named_parameters: the model's ``(name, parameter)`` pairs, identical on every worker
            (names key the state; the order fixes each parameter's random start).
        args: :class:`PowerSGDArgs`.

    ``iteration`` counts the steps whose gradients were averaged (DDP advances it on the last
    bucket of a step); compression starts once it reaches ``start_powerSGD_iter``.
    """

    def __init__(
        self,
        comm: Communicator,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        args: PowerSGDArgs,
    ):
        args.check()
        self.comm = comm
        self.matrix_approximation_rank = args.matrix_approximation_rank
        self.start_iter = args.start_powerSGD_iter
        self.min_compression_rate = args.min_compression_rate
        self.use_error_feedback = args.use_error_feedback
        self.warm_start = args.warm_start
        self.epsilon = args.orthogonalization_epsilon
        self.random_seed = args.random_seed
        self._params = dict(named_parameters)
        self._index = {name: index for index, name in enumerate(self._params)}
        self._name_of = {id(param): name for name, param in self._params.items()}
        self.iteration = 0
        self._error: dict[str, torch.Tensor] = {}  # this worker's error feedback, per parameter
        self._q: dict[str, torch.Tensor] = {}  # warm start: last step's Q (m x r), per parameter

    @property
    def compressing(self) -> bool:
        return self.iteration >= self.start_iter

    def name_of(self, param: torch.Tensor) -> str:
        return self._name_of[id(param)]

    def initial_q(self, name: str, cols: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """The random start for parameter ``name`` at the current iteration: standard normal,
        m x r, the same on every worker (drawn on the CPU so it is device-independent)."""
        seed = np.random.SeedSequence([self.random_seed, self.iteration, self._index[name]])
        generator = torch.Generator().manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0]))
        return torch.randn(cols, rank, generator=generator, dtype=dtype)

    # ------------------------------------------------------------------ averaging
    @torch.no_grad()
    def average_(self, gradients: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Replace each gradient by the workers' (approximate) mean, in place: compressed
        matrices through P and Q, the rest whole in one flat all-reduce. All workers must
        call this with the same parameters (in any order)."""
        world = self.comm.world_size
        matrices, whole = [], []
        # Model order, not DDP's bucket order: a resumed run starts with DDP's initial bucket
        # layout, and the order fixes where each element sits in the summed buffers.
        for name, grad in sorted(gradients, key=lambda item: self._index[item[0]]):
            rank = compression_rank(grad.shape, self.matrix_approximation_rank, self.min_compression_rate)
            if rank:
                matrices.append((name, grad.view(matrix_dims(grad.shape)), rank))
            else:
                whole.append(grad)
        flat_whole = torch.cat([grad.reshape(-1) for grad in whole]) if whole else None
        work = self.comm.all_reduce(flat_whole, async_op=True) if flat_whole is not None else None
        if matrices:
            self._low_rank_average_(matrices)
        if work is not None:
            work.wait()
            flat_whole.div_(world)
            offset = 0
            for grad in whole:
                grad.copy_(flat_whole[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _low_rank_average_(self, matrices: list[tuple[str, torch.Tensor, int]]) -> None:
        world = self.comm.world_size
        inputs, qs = [], []
        for name, matrix, rank in matrices:
            if self.use_error_feedback:
                if name in self._error:
                    matrix.add_(self._error[name])
                inputs.append(matrix.clone())
            q = self._q.get(name) if self.warm_start else None
            if q is None:
                q = self.initial_q(name, matrix.shape[1], rank, matrix.dtype).to(matrix.device)
            qs.append(orthogonalize_(q, self.epsilon))

        # P = M Q of every matrix in one buffer; summed, not averaged: it is orthonormalised next.
        flat_p = torch.cat([(matrix @ q).reshape(-1) for (_, matrix, _), q in zip(matrices, qs, strict=True)])
        self.comm.all_reduce(flat_p)
        ps = self._split(flat_p, [(matrix.shape[0], rank) for _, matrix, rank in matrices])
        for p in ps:
            orthogonalize_(p, self.epsilon)

        flat_q = torch.cat([(matrix.T @ p).reshape(-1) for (_, matrix, _), p in zip(matrices, ps, strict=True)])
        self.comm.all_reduce(flat_q)
        flat_q.div_(world)
        qs = self._split(flat_q, [(matrix.shape[1], rank) for _, matrix, rank in matrices])

        for index, ((name, matrix, _), p, q) in enumerate(zip(matrices, ps, qs, strict=True)):
            torch.mm(p, q.T, out=matrix)
            if self.use_error_feedback:
                self._error[name] = inputs[index].sub_(matrix)
            if self.warm_start:
                # A copy, not a view of flat_q: a saved view would drag the whole buffer along.
                self._q[name] = q.clone()

    @staticmethod
    def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        sizes = [rows * cols for rows, cols in shapes]
        return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes, strict=True)]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This worker's state: the step count, its error-feedback buffers, the warm-start Qs."""
        return {"iteration": self.iteration, "error": dict(self._error), "q": dict(self._q)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = (set(state["error"]) | set(state["q"])) - set(self._params)
        if unknown:
            raise ValueError(f"PowerSGD state names parameters this model does not have: {sorted(unknown)}")
        self.iteration = int(state["iteration"])
        self._error = {name: t.to(self._params[name].device) for name, t in state["error"].items()}
        self._q = {name: t.to(self._params[name].device) for name, t in state["q"].items()}
