"""The two-round per-block top-k (lowcomm.compress.block_topk) against torch.topk of every
block gathered, and against hand-placed values."""

from __future__ import annotations

import pytest
import torch

from lowcomm.compress.block_topk import block_topk, group_rows
from lowcomm.compress.dct import BlockLayout


def reference(matrix: torch.Tensor, layout: BlockLayout, k: int) -> torch.Tensor:
    """torch.topk of each gathered block: block-local indices, sorted per block."""
    blocks = layout.blocked(matrix.view(layout.rows, layout.cols)).abs().reshape(layout.num_blocks, -1)
    return torch.topk(blocks, k, dim=1).indices.sort(dim=1).values


@pytest.mark.parametrize(
    ("shape", "chunk", "k", "rows_per_group"),
    [
        ((3072, 1024), 64, 32, 8),  # OLMo-300M's att_proj, DeMo's settings
        ((1024, 4096), 64, 64, 8),  # ff_out, SparseLoCo's k
        ((256, 192), 32, 4, 8),
        ((96, 40), 16, 8, 4),  # 16 x 10 blocks: at g = 8, k g = 64 is above a quarter of 160
        ((100, 37), 64, 32, 5),  # 50 x 37 blocks: 5 is the largest divisor of 50 up to 8
        ((64, 64), 64, 300, 2),  # 4 k g <= 4096 only at g = 2
        ((64, 64), 64, 600, 1),  # k g above a quarter of the block at every g
        ((5000,), 64, 32, 1),  # one row high: a group would be one entry
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selects_what_torch_topk_selects(shape, chunk, k, rows_per_group, dtype):
    layout = BlockLayout.for_shape(shape, chunk)
    k = min(k, layout.block_numel)
    assert group_rows(layout, k) == rows_per_group
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    index, positions = block_topk(matrix, layout, k)
    assert index.shape == positions.shape == (layout.num_blocks, k)
    if dtype == torch.float32:  # distinct magnitudes: the same entries
        assert torch.equal(index.sort(dim=1).values, reference(matrix, layout, k))
    else:  # bf16 rounds into ties: the same magnitudes
        blocks = layout.blocked(matrix.view(layout.rows, layout.cols)).abs().reshape(layout.num_blocks, -1)
        chosen = matrix.view(-1)[positions].abs().sort(dim=1).values
        assert torch.equal(chosen, torch.topk(blocks, k, dim=1).values.sort(dim=1).values)
    # positions are the indices placed in the matrix, and unique
    assert torch.equal(positions, layout.global_index(index))
    assert positions.unique().numel() == positions.numel()


def test_two_winners_in_one_group_are_both_kept():
    """An 8 x 8 block, k = 2: groups are whole columns (8 rows); the two largest magnitudes sit
    in column 3, so one candidate per group would lose one. Hand-placed values."""
    matrix = torch.zeros(8, 8)
    matrix[1, 3], matrix[6, 3], matrix[2, 5], matrix[0, 0] = 5.0, -4.0, 3.0, 2.5
    layout = BlockLayout.for_shape(matrix.shape, 8)
    assert group_rows(layout, 2) == 8
    index, positions = block_topk(matrix, layout, 2)
    assert sorted(index.view(-1).tolist()) == [1 * 8 + 3, 6 * 8 + 3]
    assert sorted(positions.view(-1).tolist()) == [11, 51]


def test_ties_keep_the_magnitudes_of_the_true_top_k():
    """Equal magnitudes (a zero block, repeated values, +x and -x): the entries chosen may
    differ from torch.topk's, their magnitudes may not."""
    generator = torch.Generator().manual_seed(3)
    matrix = torch.randint(-3, 4, (128, 128), generator=generator).float()
    matrix[:64, :64] = 0  # one block of zeros
    layout = BlockLayout.for_shape(matrix.shape, 64)
    assert group_rows(layout, 32) == 8
    index, positions = block_topk(matrix, layout, 32)
    chosen = matrix.view(-1)[positions].abs().sort(dim=1).values
    blocks = layout.blocked(matrix).abs().reshape(layout.num_blocks, -1)
    assert torch.equal(chosen, torch.topk(blocks, 32, dim=1).values.sort(dim=1).values)
    assert all(row.unique().numel() == 32 for row in index)


def test_nan_is_selected_as_torch_topk_selects_it():
    """A NaN counts as the largest magnitude, as in torch.topk (so a diverged run sends it)."""
    matrix = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    matrix[10, 20] = float("nan")
    layout = BlockLayout.for_shape(matrix.shape, 64)
    index, _ = block_topk(matrix, layout, 32)
    assert 10 * 64 + 20 in index.view(-1).tolist()
