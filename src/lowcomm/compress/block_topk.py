"""Exact per-block top-k by magnitude, in two rounds: first the groups, then their entries.

``torch.topk`` over every ``chunk x chunk`` block costs a selection pass over all of the
block's entries with their indices; on the CPU it was the largest phase of a DeMo step (311 ms
of 680 for 117M parameters, 64 x 64 blocks, k = 32). Here each block is cut into ``g x 1`` groups (``g``
consecutive rows of one column), and:

1. each group's largest magnitude is found by two reductions across rows (``amax`` and
   ``amin`` over the ``g`` rows: the tensor is read twice, never written, and the reduction
   runs along memory, unlike one over the ``g`` entries of a group);
2. per block, the k groups with the largest maxima are kept (a top-k over ``1/g`` of the
   entries);
3. the final top-k runs over those k groups' ``k g`` entries alone.

**Why it is exact.** Let ``v`` be the block's k-th largest magnitude and ``m`` the k-th largest
group maximum. The k chosen groups hold k distinct entries at least ``m``, so ``v >= m``. A
group holding an entry above ``v`` has a maximum above ``m`` and is chosen; so every entry
above ``v`` is a candidate. If ``m = v``, each chosen group holds an entry at least ``v``; if
``m < v``, every group holding an entry at least ``v`` is chosen: either way at least k
candidates are at least ``v``. The candidates' top-k therefore has the same magnitudes as the
block's. Only among equal magnitudes at the k-th place may it pick other entries than
``torch.topk`` (which leaves that choice unspecified too, and makes it differently on CPU and
CUDA); with distinct magnitudes it picks the same set.

The rounds pay when ``k g`` is well below the block's size; otherwise (and for blocks one row
high, whose groups would be single entries) it is ``torch.topk`` on the gathered blocks.

**On the CPU** the same selection runs as one C++ kernel (:mod:`lowcomm.compress.cpu_kernels`:
one pass along memory, one selection per block while it sits in cache; 57 ms against 280-360 for
the rounds above on 117M parameters; in DeMo's encode it runs inside the transform's kernel,
:meth:`~lowcomm.compress.dct_topk.DCTTopK.transform_select`), when it is built; the rounds are
the path on every other device and without it (:func:`selection_kernels` says which). Both return each block's entries in ascending block-local index, so
where the magnitudes are distinct the payloads, and every sum over them (the ``sign`` wire's
mean magnitude, SparseLoCo's code tables), are the same on either path. At a tie for the k-th
place (exact ties are rare in float32, common in bf16) the kernel keeps the lower index and the
rounds either one.
"""

from __future__ import annotations

from typing import Any

import torch

from lowcomm.compress import cpu_kernels
from lowcomm.compress.dct import BlockLayout

__all__ = ["block_topk", "group_rows", "kernel_group_rows", "selection_kernels"]

_MAX_GROUP = 8  # the candidates' top-k grows with g, the groups' shrinks: 8 measured fastest for
# 64 x 64 blocks and k = 32 on the CPU (235 ms against 16's 265 and 4's 357; one round: 390)


def group_rows(layout: BlockLayout, k: int) -> int:
    """Rows per group for blocks of ``layout`` and top-``k``: the largest divisor ``g <= 8``
    of the block's height that leaves at least ``k`` groups per block and ``k g`` at most a
    quarter of the block; 1 (a single round, ``torch.topk``) when there is none."""
    for g in range(min(_MAX_GROUP, layout.chunk_rows), 1, -1):
        groups = layout.block_numel // g
        if layout.chunk_rows % g == 0 and groups >= k and 4 * k * g <= layout.block_numel:
            return g
    return 1


def kernel_group_rows(layout: BlockLayout, k: int) -> int:
    """Rows per group for the CPU kernel: the largest divisor ``g <= 16`` of the block's height
    that leaves at least ``2 k`` groups per block (1 when there is none). Its cost hardly depends
    on ``g`` (87 ms at 16, 90 at 8 on 117M parameters); fewer groups make its selection cheaper."""
    for g in range(min(16, layout.chunk_rows), 1, -1):
        if layout.chunk_rows % g == 0 and (layout.chunk_rows // g) * layout.chunk_cols >= 2 * k:
            return g
    return 1


def selection_kernels(matrix: torch.Tensor) -> Any | None:
    """lowcomm's CPU kernels (``torch.ops.lowcomm``) where the selection runs on them: a CPU
    tensor, kernels built; else None (the torch rounds)."""
    return cpu_kernels.ops() if matrix.device.type == "cpu" else None


def block_topk(
    matrix: torch.Tensor, layout: BlockLayout, k: int, *, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude entries of every block of ``matrix`` (``rows x cols``,
    blocks in place, as :class:`~lowcomm.compress.dct.BlockLayout` cuts it). Returns their
    block-local indices ``(num_blocks, k)`` (int64, row-major within the block, ascending in
    each block), their flat positions in ``matrix`` and their values. ``scratch`` (``numel``
    entries of the matrix's dtype) is work space for the torch single-round path, allocated
    when omitted."""
    matrix = matrix.view(layout.rows, layout.cols)
    kernels = selection_kernels(matrix)
    if kernels is not None:  # (a view with strides is copied: the kernel reads rows along memory)
        return kernels.block_topk(matrix.contiguous(), layout.chunk_rows, layout.chunk_cols, k,
                                  kernel_group_rows(layout, k))
    index, positions = _rounds(matrix, layout, k, scratch)
    # ascending within each block, as the kernel returns them (torch.topk's order is unspecified)
    index, order = index.sort(dim=1)
    positions = positions.gather(1, order)
    return index, positions, matrix.reshape(-1).index_select(0, positions.view(-1)).view(positions.shape)


def _rounds(
    matrix: torch.Tensor, layout: BlockLayout, k: int, scratch: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection in torch operators (the module doc): block-local indices and positions."""
    g = group_rows(layout, k)
    if g == 1:
        shape = (layout.blocks_rows, layout.blocks_cols, layout.chunk_rows, layout.chunk_cols)
        magnitudes = scratch.view(shape) if scratch is not None else matrix.new_empty(shape)
        torch.abs(layout.blocked(matrix), out=magnitudes)
        index = torch.topk(magnitudes.view(layout.num_blocks, layout.block_numel), k, dim=1, sorted=False).indices
        return index, layout.global_index(index)

    # 1. each group's largest magnitude, read along memory: (blocks_rows, groups per column, cols)
    by_group = matrix.view(layout.blocks_rows, layout.chunk_rows // g, g, layout.cols)
    largest = torch.maximum(by_group.amax(dim=2), by_group.amin(dim=2).neg_())
    # per block: (num_blocks, chunk_rows // g * chunk_cols), group (r, c) at r * chunk_cols + c
    largest = largest.view(layout.blocks_rows, -1, layout.blocks_cols, layout.chunk_cols).transpose(1, 2)
    largest = largest.reshape(layout.num_blocks, -1)
    # 2. the k groups with the largest maxima
    group = torch.topk(largest, k, dim=1, sorted=False).indices
    # a group's first entry, block-local and in the matrix; its others follow every row
    first = (group // layout.chunk_cols) * (g * layout.chunk_cols) + group % layout.chunk_cols
    first_at = layout.global_index(first)
    rows = torch.arange(g, device=group.device)
    where = (first_at.unsqueeze(-1) + layout.cols * rows).view(layout.num_blocks, k * g)
    # 3. the top k of the k g candidates (candidate i: group i // g, row i % g of it)
    values = matrix.reshape(-1).index_select(0, where.view(-1)).view(layout.num_blocks, k * g)
    chosen = torch.topk(values.abs_(), k, dim=1, sorted=False).indices
    in_group, row = chosen // g, chosen % g
    return (first.gather(1, in_group) + layout.chunk_cols * row,
            first_at.gather(1, in_group) + layout.cols * row)
