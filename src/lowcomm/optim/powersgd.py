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

__all__ = ["PowerSGDArgs", "PowerSGDReducer", "batched_mm", "orthogonalize_"]


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
    """Orthonormalise the r columns of an n x r matrix (r <= n), or of each matrix of a batch
    ``... x n x r``, in place, as torch's PowerSGD does: Gram-Schmidt for r <= 2 or half
    precision (where QR is unavailable or slower), QR otherwise. ``epsilon`` guards
    Gram-Schmidt against an all-zero column. A batch is one pass for all of its matrices, each
    orthonormalised as if alone."""
    rank = matrix.shape[-1]
    if rank <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            column = matrix[..., i : i + 1]
            column.div_(torch.linalg.vector_norm(column, dim=-2, keepdim=True) + epsilon)
            if i + 1 < rank:
                rest = matrix[..., i + 1 :]
                rest.sub_((column * rest).sum(dim=-2, keepdim=True) * column)
    else:
        matrix.copy_(torch.linalg.qr(matrix).Q)
    return matrix


def batched_mm(a: torch.Tensor, b: torch.Tensor, *, per_matrix: bool | None = None) -> torch.Tensor:
    """``torch.bmm(a, b)``; on the CPU one ``mm`` per matrix into the batch's output instead:
    there bmm ran PowerSGD's tall products at half the speed of mm (136 ms against 83, four
    OLMo-300M blocks at rank 32), and the result is the per-matrix products' bit for bit.
    ``per_matrix`` forces either way (default: on the CPU)."""
    if not (a.device.type == "cpu" if per_matrix is None else per_matrix):
        return torch.bmm(a, b)
    product = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    for i in range(a.shape[0]):
        torch.mm(a[i], b[i], out=product[i])
    return product


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
        # with error feedback, per group of equal-shape matrices (by their names): their inputs
        # stacked, then their remainders; the error feedback of each is a view of it
        self._inputs: dict[tuple[str, ...], torch.Tensor] = {}

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
        """P, Q and the approximation of every compressed matrix, batched by shape: the
        matrices of one (n, m, r, dtype) are stacked, and each orthonormalisation and (on a
        GPU) each of P = M Q and Q = M^T P is one operator for all of them. OLMo's blocks
        repeat four shapes, so OLMo-300M's 65 compressed matrices, were they in one call, are
        5 groups: 5 + 5 QRs per step instead of 65 + 65, each with its own solver launches on
        a GPU (DDP's 25 MB buckets hand the hook no two of one shape at 300M: results/benchmarks/README.md). P and Q
        travel in model order, as per-matrix products would lay them out, so the sums are the
        same; on the CPU the result is the one-matrix-at-a-time computation's bit for bit."""
        world = self.comm.world_size
        if self.use_error_feedback:
            with_error = [(matrix, self._error[name]) for name, matrix, _ in matrices if name in self._error]
            if with_error:
                torch._foreach_add_(*map(list, zip(*with_error, strict=True)))
        groups: dict[tuple, list[int]] = {}
        for index, (_, matrix, rank) in enumerate(matrices):
            groups.setdefault((*matrix.shape, rank, matrix.dtype, matrix.device), []).append(index)
        # per group: its matrices stacked (a copy: with error feedback, the input it keeps)
        stacked = {key: self._stacked([matrices[i] for i in members]) for key, members in groups.items()}
        starts = {}
        for key, members in groups.items():
            qs = []
            for i in members:
                name, matrix, rank = matrices[i]
                q = self._q.get(name) if self.warm_start else None
                qs.append(q if q is not None else
                          self.initial_q(name, matrix.shape[1], rank, matrix.dtype).to(matrix.device))
            starts[key] = orthogonalize_(torch.stack(qs), self.epsilon)

        # P = M Q of every matrix in one buffer; summed, not averaged: it is orthonormalised next.
        flat_p = self._in_model_order(groups, {key: batched_mm(stacked[key], starts[key]) for key in groups})
        self.comm.all_reduce(flat_p)
        ps = self._by_group(flat_p, groups, matrices, rows=True)
        for p in ps.values():
            orthogonalize_(p, self.epsilon)

        flat_q = self._in_model_order(groups, {key: batched_mm(stacked[key].mT, ps[key]) for key in groups})
        self.comm.all_reduce(flat_q)
        flat_q.div_(world)
        qs = self._by_group(flat_q, groups, matrices, rows=False)

        for key, members in groups.items():
            for j, i in enumerate(members):
                name, matrix, _ = matrices[i]
                # one product per matrix, straight into its gradient: a batched one would need
                # a group-sized temporary and a copy, for a product that is bound by memory
                torch.mm(ps[key][j], qs[key][j].T, out=matrix)
                if self.use_error_feedback:
                    # the stacked inputs become the remainders: each parameter's is a view
                    self._error[name] = stacked[key][j].sub_(matrix)
                if self.warm_start:
                    self._q[name] = qs[key][j]  # a view of this group's own stack, not of flat_q

    def _stacked(self, matrices: list[tuple[str, torch.Tensor, int]]) -> torch.Tensor:
        """A copy of equal-shape ``matrices``, stacked. With error feedback, in a buffer kept
        for them from step to step, which then holds their remainders (so the copy costs no
        fresh pages; last step's remainders, views of it, have been added to the gradients by
        now); without, a copy for this step only."""
        first = matrices[0][1]
        if not self.use_error_feedback:
            return torch.stack([matrix for _, matrix, _ in matrices])
        names = tuple(name for name, _, _ in matrices)
        buffer = self._inputs.get(names)
        if buffer is None or buffer.shape[1:] != first.shape or (buffer.dtype, buffer.device) != (first.dtype, first.device):
            # DDP regroups its buckets after the first step: a group it broke up is not kept
            for stale in [other for other in self._inputs if set(other) & set(names)]:
                del self._inputs[stale]
            buffer = self._inputs[names] = first.new_empty(len(matrices), *first.shape)
        torch._foreach_copy_(list(buffer.unbind()), [matrix for _, matrix, _ in matrices])
        return buffer

    @staticmethod
    def _in_model_order(groups: dict[tuple, list[int]], stacks: dict[tuple, torch.Tensor]) -> torch.Tensor:
        """One flat buffer of the groups' stacked n x r (or m x r) factors, matrix by matrix
        in model order."""
        pieces: list[torch.Tensor | None] = [None] * sum(map(len, groups.values()))
        for key, members in groups.items():
            for j, i in enumerate(members):
                pieces[i] = stacks[key][j].reshape(-1)
        return torch.cat(pieces)

    @staticmethod
    def _by_group(
        flat: torch.Tensor, groups: dict[tuple, list[int]],
        matrices: list[tuple[str, torch.Tensor, int]], *, rows: bool,
    ) -> dict[tuple, torch.Tensor]:
        """The factors of a flat model-order buffer (P: n x r each if ``rows``, else Q: m x
        r), stacked per group (a copy)."""
        shapes = [(matrix.shape[0] if rows else matrix.shape[1], rank) for _, matrix, rank in matrices]
        pieces = [piece.view(shape) for piece, shape in
                  zip(flat.split([rows_ * rank for rows_, rank in shapes]), shapes, strict=True)]
        return {key: torch.stack([pieces[i] for i in members]) for key, members in groups.items()}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This worker's state: the step count, its error-feedback buffers, the warm-start Qs."""
        # the remainders are copied: they are views of buffers the next step writes over (the
        # Qs are views of a stack each step makes afresh)
        return {"iteration": self.iteration, "error": {name: t.clone() for name, t in self._error.items()},
                "q": dict(self._q)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = (set(state["error"]) | set(state["q"])) - set(self._params)
        if unknown:
            raise ValueError(f"PowerSGD state names parameters this model does not have: {sorted(unknown)}")
        self.iteration = int(state["iteration"])
        self._error = {name: t.to(self._params[name].device) for name, t in state["error"].items()}
        self._q = {name: t.to(self._params[name].device) for name, t in state["q"].items()}
