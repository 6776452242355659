"""Block orthonormal transforms: DeMo's chunked DCT-II, a random orthonormal alternative, and
the chunk rule that cuts a parameter into blocks.

Every tensor is seen as a matrix ``rows x cols``: a 2-D parameter as it is, a 1-D one as a
single row (``1 x n``; its blocks are 1-D chunks), and one with more dimensions as its first
dimension by the product of the rest (a conv kernel ``(out, in, kh, kw)`` becomes
``out x (in*kh*kw)``). The matrix is cut into blocks of ``chunk_rows x chunk_cols`` and each
block B is transformed separately, ``B -> L B R^T``, with orthonormal bases L and R.

Coefficients are kept in **block-in-place layout**: coefficient ``(k, l)`` of block ``(a, b)``
sits at ``[a*chunk_rows + k, b*chunk_cols + l]``, where the block itself sat. In that layout a
transform is two large matrix products and no permutation (``x.view(-1, chunk_cols) @ R^T``,
then ``L`` applied to every ``chunk_rows``-row slab at once), and with identity bases the
coefficients *are* the tensor. Only top-k selection needs each block contiguous; it gathers
the blocks once (:meth:`BlockLayout.blocked`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowcomm.compress import cpu_kernels


def chunk_size(size: int, target: int) -> int:
    """DeMo's chunk for one dimension of ``size`` entries: ``target`` if it divides ``size``,
    else the largest divisor of ``size`` below ``target``; ``size`` itself when it is at most
    ``target``. A prime ``size > target`` gets 1 (that axis is not compressed)."""
    if size < 1 or target < 1:
        raise ValueError(f"chunk_size needs positive size and target, got {size} and {target}")
    if size <= target:
        return size
    return next(c for c in range(target, 0, -1) if size % c == 0)


def matrix_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The ``rows x cols`` matrix a tensor of ``shape`` is transformed as (see the module doc)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class BlockLayout:
    """How a tensor of ``shape`` is cut into ``chunk_rows x chunk_cols`` blocks."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    chunk_rows: int
    chunk_cols: int

    @classmethod
    def for_shape(cls, shape: tuple[int, ...] | torch.Size, target_chunk: int) -> BlockLayout:
        """Apply :func:`chunk_size` to both matrix dimensions; warn when a dimension longer
        than ``target_chunk`` degenerates to chunk 1."""
        rows, cols = matrix_shape(tuple(shape))
        chunks = []
        for size in (rows, cols):
            chunk = chunk_size(size, target_chunk)
            if chunk == 1 and size > 1:
                warnings.warn(
                    f"a dimension of size {size} (tensor shape {tuple(shape)}) has no divisor in "
                    f"[2, {target_chunk}], so its DCT chunk is 1: blocks are 1 wide along it and "
                    "top-k compresses that axis not at all",
                    stacklevel=3,
                )
            chunks.append(chunk)
        return cls(tuple(shape), rows, cols, chunks[0], chunks[1])

    @property
    def blocks_rows(self) -> int:
        return self.rows // self.chunk_rows

    @property
    def blocks_cols(self) -> int:
        return self.cols // self.chunk_cols

    @property
    def num_blocks(self) -> int:
        return self.blocks_rows * self.blocks_cols

    @property
    def block_numel(self) -> int:
        return self.chunk_rows * self.chunk_cols

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def blocked(self, matrix: torch.Tensor) -> torch.Tensor:
        """A ``(blocks_rows, blocks_cols, chunk_rows, chunk_cols)`` view of a ``rows x cols``
        tensor (not contiguous: copy it to make each block's entries adjacent)."""
        return matrix.view(self.blocks_rows, self.chunk_rows, self.blocks_cols, self.chunk_cols).transpose(
            1, 2
        )

    def global_index(self, block_index: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Flat positions in the ``rows x cols`` tensor of the entries ``block_index[i, j]``
        (row-major within block i; blocks numbered row-major), plus ``start`` (where the
        tensor begins in a larger buffer). ``block_index`` may have leading dimensions (one
        per worker) before its ``(num_blocks, k)``."""
        origin, offset = _index_tables(self, block_index.device)
        # the large index tensor meets one gather and one add (no integer division on it)
        positions = origin + offset.take(block_index)
        return positions.add_(start) if start else positions


@functools.cache  # never evicted: DeMo's captured step (CUDA graphs) reads them by address
def _index_tables(layout: BlockLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`BlockLayout.global_index`'s small tables, built once per layout and device (a
    step asks for them once per parameter stack, and on a GPU each build is eight kernel launches):
    each block's first flat position, ``(num_blocks, 1)``, and each in-block offset's distance
    from it, ``(block_numel,)``. Read-only."""
    origin_rows = torch.arange(layout.blocks_rows, device=device) * (layout.chunk_rows * layout.cols)
    origin_cols = torch.arange(layout.blocks_cols, device=device) * layout.chunk_cols
    origin = (origin_rows.unsqueeze(1) + origin_cols).view(-1, 1)
    within = torch.arange(layout.block_numel, device=device)
    offset = (within // layout.chunk_cols) * layout.cols + within % layout.chunk_cols
    return origin, offset


@functools.lru_cache(maxsize=64)
def dct_basis(
    size: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The orthonormal DCT-II matrix C (``size x size``): ``(C x)_k`` is the k-th coefficient
    of x, ``C[k, i] = s_k cos(pi (2i + 1) k / (2 size))`` with ``s_0 = sqrt(1/size)`` and
    ``s_k = sqrt(2/size)``; ``C C^T = I``. Built in float64, cached per (size, device, dtype);
    treat the result as read-only."""
    k = torch.arange(size, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(size, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(device=device, dtype=dtype)


def random_orthonormal_basis(
    size: int, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """An orthonormal ``size x size`` matrix drawn from the Haar distribution: a N(0, 1) matrix
    orthonormalised by QR (Gram-Schmidt, done stably), with the signs of R's diagonal folded in
    so the result does not depend on the QR routine's sign convention. Drawn on the CPU in
    float64 from ``seed`` alone, so every worker that passes the same seed gets the same basis
    whatever its device."""
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(size, size, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q *= torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.T.contiguous().to(device=device, dtype=dtype)


def block_transform(
    matrix: torch.Tensor | Sequence[torch.Tensor],
    layout: BlockLayout,
    left: torch.Tensor | None,
    right: torch.Tensor | None,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    beta: float = 0.0,
    alpha: float = 1.0,
) -> torch.Tensor:
    """Transform every block of a ``rows x cols`` tensor: ``B -> left B right^T`` (forward) or
    ``C -> left^T C right`` (``inverse``), in block-in-place layout.

    ``left`` (``chunk_rows`` square) and ``right`` (``chunk_cols`` square) are orthonormal
    bases; None stands for the identity (a 1-D tensor has ``left=None``). ``out`` receives
    ``beta * out + alpha * T(matrix)`` as in BLAS (with ``beta=0`` its old contents are not
    read), so an accumulation costs no extra pass; ``scratch`` holds the intermediate product.
    Each has ``numel`` entries (any shape), is allocated when omitted, and must not overlap
    ``matrix`` or the other.

    ``matrix`` may also be a sequence of tensors, the row blocks of the ``rows x cols`` matrix
    from top to bottom (each a whole number of block rows: several parameters of one block
    geometry, stacked as :class:`~lowcomm.optim.DeMo` stacks them). They are never copied
    together: the first product is taken part by part, the second once for all of them.
    """
    parts = [matrix] if isinstance(matrix, torch.Tensor) else list(matrix)
    if out is None:
        out = parts[0].new_empty(layout.rows, layout.cols)
    # Each part's rows, and each part and target seen as (rows * blocks_cols, chunk_cols): one
    # view per part and target, and one transposed basis per call (a step transforms every
    # parameter, and on a GPU each Python-level operator costs host time).
    rows_view = (-1, layout.chunk_cols)
    spans = _row_spans(parts, layout)
    right_t = None if right is None else (right if inverse else right.T)
    if left is None:  # one product (or scaled copy) per part, straight into its rows of ``out``
        out_rows = out.view(rows_view)
        for part, (start, stop) in zip(parts, spans, strict=True):
            target, source = out_rows[start:stop], part.reshape(rows_view)
            if right_t is None:
                if beta:
                    target.mul_(beta).add_(source, alpha=alpha)
                else:
                    torch.mul(source, alpha, out=target)
            else:
                # one (rows * blocks_cols, chunk_cols) x (chunk_cols, chunk_cols) product
                target.addmm_(source, right_t, beta=beta, alpha=alpha)
        return out.view(layout.rows, layout.cols)
    if right_t is not None or len(parts) > 1:
        stacked = scratch if scratch is not None else torch.empty_like(out)
        stacked_rows = stacked.view(rows_view)
        for part, (start, stop) in zip(parts, spans, strict=True):
            if right_t is None:
                stacked_rows[start:stop].copy_(part.reshape(rows_view))
            else:
                torch.mm(part.reshape(rows_view), right_t, out=stacked_rows[start:stop])
        matrix = stacked
    else:
        matrix = parts[0]
    # chunk_rows x chunk_rows times each of the blocks_rows slabs of chunk_rows x cols
    slabs = (layout.blocks_rows, layout.chunk_rows, layout.cols)
    basis = (left.T if inverse else left).expand(layout.blocks_rows, -1, -1)
    out.view(slabs).baddbmm_(basis, matrix.reshape(slabs), beta=beta, alpha=alpha)
    return out.view(layout.rows, layout.cols)


def _row_spans(parts: Sequence[torch.Tensor], layout: BlockLayout) -> list[tuple[int, int]]:
    """Where each part lies in the ``(rows * blocks_cols, chunk_cols)`` view of the stacked
    matrix: ``[start, stop)`` in its rows."""
    spans, start = [], 0
    for part in parts:
        stop = start + part.numel() // layout.chunk_cols
        spans.append((start, stop))
        start = stop
    return spans


def dct_bases(
    layout: BlockLayout, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (left, right) DCT-II bases of ``layout``'s blocks; None where a chunk is 1 (the identity)."""
    return tuple(dct_basis(size, device, dtype) if size > 1 else None for size in (layout.chunk_rows, layout.chunk_cols))


def mark_written(*tensors: torch.Tensor) -> None:
    """Bump the autograd version counters of tensors a CPU kernel wrote in place, as torch's own
    in-place operators do (the kernels are registered for the CPU alone, so the dispatcher does
    not)."""
    for tensor in tensors:
        torch.autograd.graph.increment_version(tensor)


def dct_kernels(tensors: Sequence[torch.Tensor]) -> Any | None:
    """lowcomm's CPU kernels (``torch.ops.lowcomm``) when they can transform these tensors: on the
    CPU, float32 or float64, contiguous, built; else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in (torch.float32, torch.float64):
        return None
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return None
    return cpu_kernels.ops()


def dct_transform(
    matrix: torch.Tensor | Sequence[torch.Tensor],
    layout: BlockLayout,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    beta: float = 0.0,
    alpha: float = 1.0,
) -> torch.Tensor:
    """:func:`block_transform` with DCT-II bases on both axes (:func:`dct_bases`), with its
    arguments and result.

    On the CPU, in float32 or float64, with lowcomm's kernels built
    (:mod:`lowcomm.compress.cpu_kernels`), it is one kernel that reads each block once and writes
    it once, and transforms it in cache: down the rows by the even/odd recursion of the DCT
    (1,365 multiply-adds per 64 entries instead of 4,096), along the rows by the even/odd
    halves (half the multiply-adds), and an inverse whose block holds few nonzero coefficients
    (an aggregate of a few senders' top-k) as one product over them. Elsewhere, and for tensors
    that are not contiguous, it is :func:`block_transform`'s matrix products. The two agree to
    rounding: the kernel adds in another order (measured: within 4e-6 of the largest
    coefficient of a unit-normal float32 block, ``tests/test_dct_kernel.py``). The kernel's result
    has no autograd history: it serves optimizers, under ``no_grad``.
    """
    parts = [matrix] if isinstance(matrix, torch.Tensor) else list(matrix)
    if out is None:
        out = parts[0].new_empty(layout.rows, layout.cols)
    kernels = dct_kernels([*parts, out])
    if kernels is not None:
        kernels.dct_blocks(parts, [out], layout.cols, layout.chunk_rows, layout.chunk_cols, inverse, beta, alpha)
        mark_written(out)
        return out.view(layout.rows, layout.cols)
    bases = dct_bases(layout, parts[0].device, parts[0].dtype)
    return block_transform(parts, layout, *bases, inverse=inverse, out=out, scratch=scratch, beta=beta, alpha=alpha)
