"""The block DCT's CPU kernel (``torch.ops.lowcomm.dct_blocks``, through
lowcomm.compress.dct.dct_transform and dct_inverse_add) against the DCT written out from its
definition (tests/dct_reference.py: Kronecker products of the cosine matrix, in float64), on
every path the kernel takes: the even/odd recursion down the rows (even sizes above 8, odd
sizes and small ones dense), the halves along the rows (widths that are whole vectors) or the
whole product (others), the inverse of a block with few nonzero coefficients as one product, the
accumulation into the target, DeMo's encode (the transform with its top-k) and decode (gathered
payloads into its parameters, with their sign), and the fallbacks to the matrix products."""

from __future__ import annotations

import pytest
import torch

from dct_reference import F64, dense_dct
from lowcomm.compress import cpu_kernels
from lowcomm.compress.base import Payload
from lowcomm.compress.dct import BlockLayout, block_transform, dct_bases, dct_transform
from lowcomm.compress.dct_topk import WIRES, DCTTopK, _rows_contiguous

# (shape, chunk): the block geometry each exercises
GEOMETRIES = [
    ((128, 192), 64),  # 64 x 64: three levels of the recursion, the halves along the rows
    ((96, 40), 64),  # 48 x 40: recursion to 12 then 6 dense; a width of 40 is no whole number of vectors
    ((50, 70), 64),  # 50 x 35: 50 -> 25 odd (dense); odd width
    ((24, 48), 16),  # 12 x 16: 12 -> 6; the halves of 16 are not whole float vectors
    ((64, 64), 8),  # 8 x 8: dense both ways
    ((3, 128), 64),  # 3 x 64
    ((1, 256), 64),  # a 1-D tensor: blocks one row high, nothing down the rows
    ((256, 7), 64),  # 64 x 7
    ((64, 704), 64),  # 11 blocks along a row: a tile of 8, then one of 3
]


@pytest.fixture(autouse=True)
def _kernels_built():
    assert cpu_kernels.available(), "lowcomm's CPU kernels did not build (see the warning)"


def _layout(shape, chunk) -> BlockLayout:
    return BlockLayout.for_shape(shape, chunk)


def _sparse(shape, per_block_density: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=F64)
    keep = torch.rand(shape, generator=generator, dtype=F64) < per_block_density
    return (values * keep).to(dtype)


@pytest.mark.parametrize(("shape", "chunk"), GEOMETRIES)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("density", [1.0, 0.01, 0.0])
def test_matches_the_definition_in_float64(shape, chunk, inverse, density):
    matrix = _sparse(shape, density, seed=1, dtype=F64) if density < 1 else torch.randn(shape, dtype=F64)
    layout = _layout(shape, chunk)
    got = dct_transform(matrix, layout, inverse=inverse)
    want = dense_dct(matrix, chunk, inverse=inverse)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("shape", "chunk"), GEOMETRIES)
@pytest.mark.parametrize("inverse", [False, True])
def test_float32_agrees_with_the_matrix_products_to_rounding(shape, chunk, inverse):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    layout = _layout(shape, chunk)
    got = dct_transform(matrix, layout, inverse=inverse)
    products = block_transform(matrix, layout, *dct_bases(layout, "cpu", torch.float32), inverse=inverse)
    truth = dense_dct(matrix.to(F64), chunk, inverse=inverse)
    # both within a few float32 ulps of the largest coefficient of the exact result
    tolerance = 4e-6 * truth.abs().max().item()
    assert (got.to(F64) - truth).abs().max().item() <= tolerance
    assert (products.to(F64) - truth).abs().max().item() <= tolerance


@pytest.mark.parametrize("count", [0, 1, 31, 96, 97, 300])
def test_an_inverse_of_few_coefficients_per_block_is_exact_on_either_side_of_the_switch(count):
    """A 64 x 64 block with at most 96 nonzero coefficients is inverted as one product over them,
    one with more by the two directions: both must give the definition's result. Counts per
    block are exact here (the same positions in every block)."""
    layout = _layout((128, 128), 64)
    generator = torch.Generator().manual_seed(count)
    matrix = torch.zeros(128, 128, dtype=F64)
    chosen = torch.randperm(4096, generator=generator)[:count]
    for block_row in range(2):
        for block_col in range(2):
            block = matrix[block_row * 64 : (block_row + 1) * 64, block_col * 64 : (block_col + 1) * 64]
            block[chosen // 64, chosen % 64] = torch.randn(count, generator=generator, dtype=F64)
    matrix[0, 1] = -0.0 if count == 0 else matrix[0, 1]  # a negative zero adds nothing
    torch.testing.assert_close(dct_transform(matrix, layout, inverse=True), dense_dct(matrix, 64, inverse=True),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("inverse", [False, True])
def test_accumulates_into_the_target_and_reads_it_only_with_beta(inverse):
    shape, chunk = (192, 128), 64
    layout = _layout(shape, chunk)
    matrix = torch.randn(shape, dtype=F64)
    transformed = dense_dct(matrix, chunk, inverse=inverse)
    before = torch.randn(shape, dtype=F64)
    out = before.clone()
    dct_transform(matrix, layout, inverse=inverse, out=out, beta=0.9, alpha=-0.25)
    torch.testing.assert_close(out, 0.9 * before - 0.25 * transformed, rtol=0, atol=1e-12)
    stale = torch.full(shape, float("nan"), dtype=F64)  # beta = 0: never read, as in BLAS
    dct_transform(matrix, layout, inverse=inverse, out=stale, alpha=2.0)
    torch.testing.assert_close(stale, 2.0 * transformed, rtol=0, atol=1e-12)


def test_stacked_parts_transform_as_their_concatenation_and_may_be_the_target():
    layout = BlockLayout((320, 128), 320, 128, 64, 64)
    parts = [torch.randn(192, 128, dtype=F64), torch.randn(64, 128, dtype=F64), torch.randn(64, 128, dtype=F64)]
    want = dense_dct(torch.cat(parts), 64)
    torch.testing.assert_close(dct_transform(parts, layout), want, rtol=0, atol=1e-12)
    whole = torch.cat(parts)  # in place: each tile is read whole before it is written
    dct_transform(whole, layout, out=whole)
    torch.testing.assert_close(whole, want, rtol=0, atol=1e-12)


def _gathered(workers: int, layout: BlockLayout, k: int, seed: int, dtype=F64) -> Payload:
    """W workers' paper-wire payloads as an all-gather leaves them: distinct block-local indices
    per block and worker (ascending, as the codec selects them), random values."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.stack([torch.randperm(layout.block_numel, generator=generator)[:k].sort().values
                                      for _ in range(layout.num_blocks)]) for _ in range(workers)])
    values = torch.randn(workers, layout.num_blocks, k, generator=generator, dtype=dtype)
    return Payload({"index": index, "values": values}, {"shape": layout.shape, "dtype": dtype})


@pytest.mark.parametrize("sign", [False, True])
@pytest.mark.parametrize(("workers", "k"), [(1, 32), (2, 32), (3, 40), (8, 32), (1, 2000), (2, 200)])
def test_decoding_into_the_targets_is_the_aggregate_then_the_inverse_then_the_step(workers, k, sign):
    """DeMo's decode and update in one pass: targets (a stack of parameters, row blocks) +=
    alpha f(P^-1 Q), Q the mean over senders of the gathered payloads. Against the codec's own
    aggregate and the inverse from the DCT's definition. (1 and 2 senders of 32 take the
    one-product inverse of few coefficients; 3 of 40 and 8 of 32, and 2,000 of one, do not.)"""
    codec = DCTTopK(chunk=64, topk=k, wire="paper")
    layout = BlockLayout((320, 128), 320, 128, 64, 64)
    gathered = _gathered(workers, layout, k, seed=workers)
    aggregate = codec.aggregate_gathered([gathered], [layout], [0], out=torch.empty(layout.numel, dtype=F64),
                                         counts=torch.empty(layout.numel, dtype=F64))
    params = [torch.randn(192, 128, dtype=F64), torch.randn(128, 128, dtype=F64)]
    before = torch.cat(params)
    assert codec.decode_add(gathered, layout, params, alpha=-0.01, sign=sign)
    update = dense_dct(aggregate.view(320, 128), 64, inverse=True)
    if sign:
        assert (update.abs() > 1e-9).all()  # no sign here is within rounding of zero
        update = update.sign()
    torch.testing.assert_close(torch.cat(params), before - 0.01 * update, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("sign", [False, True])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize(("shape", "chunk", "k"), [((320, 1024), 64, 32), ((128, 96), 16, 3), ((96, 40), 64, 4)])
def test_a_few_senders_payloads_decode_from_their_lists_as_from_the_gathered_tile(shape, chunk, k, workers, sign,
                                                                                  dtype):
    """With W senders of k coefficients a block, W x k at most the one-product inverse's limit,
    blocks whose indices ascend (as both top-k paths return them) are inverted from the
    payloads' merged lists, with no tile gathered and scanned; payloads whose indices do not
    ascend go the gathered way. The two agree bit for bit: coefficients sent by several workers
    (their mean), a mean of exactly zero, zeros of either sign and a NaN included."""
    codec = DCTTopK(chunk=chunk, topk=k, wire="paper")
    layout = codec.layout(shape)
    ascending = _gathered(workers, layout, k, seed=21 + workers, dtype=dtype)
    index, values = ascending.tensors["index"], ascending.tensors["values"]
    values[0, 0, 0], values[-1, -1, -1], values[0, -1, 1] = 0.0, -0.0, float("nan")
    if workers > 1:  # block 0 sent alike by the first two, one of its means exactly zero
        index[1, 0] = index[0, 0]
        values[1, 0, 1] = -values[0, 0, 1]
    order = torch.arange(k - 1, -1, -1).expand(workers, layout.num_blocks, k)  # every block's entries descending
    shuffled = Payload({"index": index.gather(2, order), "values": values.gather(2, order)}, ascending.meta)
    start = torch.randn(layout.rows, layout.cols, dtype=dtype, generator=torch.Generator().manual_seed(22))
    listed, gathered = start.clone(), start.clone()
    assert codec.decode_add(ascending, layout, [listed], alpha=-0.5, sign=sign)
    assert codec.decode_add(shuffled, layout, [gathered], alpha=-0.5, sign=sign)
    assert torch.equal(listed.nan_to_num(7.0), gathered.nan_to_num(7.0))
    assert not torch.equal(listed.nan_to_num(7.0), start.nan_to_num(7.0))


@pytest.mark.parametrize(("shape", "chunk", "k"), [((96, 40), 64, 4), ((1, 256), 64, 8), ((256, 7), 64, 3),
                                                  ((128, 704), 64, 32), ((24, 48), 16, 5)])
def test_decoding_into_the_targets_on_every_block_geometry(shape, chunk, k):
    """decode_add on blocks of 48 x 40, one row high, one column wide, 12 x 16, and a block row
    of 11 blocks (a tile of 8 and one of 3), against the aggregate and the definition."""
    codec = DCTTopK(chunk=chunk, topk=k, wire="paper")
    layout = codec.layout(shape)
    gathered = _gathered(2, layout, k, seed=11)
    aggregate = codec.aggregate_gathered([gathered], [layout], [0], out=torch.empty(layout.numel, dtype=F64),
                                         counts=torch.empty(layout.numel, dtype=F64))
    param = torch.randn(layout.rows, layout.cols, dtype=F64)
    want = param - 0.5 * dense_dct(aggregate.view(layout.rows, layout.cols), chunk, inverse=True)
    assert codec.decode_add(gathered, layout, [param], alpha=-0.5, sign=False)
    torch.testing.assert_close(param, want, rtol=0, atol=1e-12)


def test_a_block_inverse_does_not_depend_on_its_neighbours():
    """A block of few coefficients beside one of many is inverted as one product all the same:
    bit for bit what it gives alone (the choice is per block, not per tile)."""
    layout = BlockLayout((64, 128), 64, 128, 64, 64)
    sparse = _sparse((64, 64), 0.005, seed=12, dtype=torch.float32)
    beside = torch.cat([sparse, torch.randn(64, 64)], dim=1)
    alone = torch.cat([sparse, torch.zeros(64, 64)], dim=1)
    on_the_left = dct_transform(beside.contiguous(), layout, inverse=True)[:, :64]
    assert torch.equal(on_the_left, dct_transform(alone.contiguous(), layout, inverse=True)[:, :64])


def test_a_wide_blocks_inverse_by_rows_leaves_the_next_blocks_list_alone():
    """Blocks of 16 x 64: the one-product inverse takes up to 24 coefficients, the inverse by
    rows a block of up to 128. A block with one whole row of 64 (by rows: its row lists 32
    coefficients of each half) before one of 10 (one product), in one tile: each against the
    definition."""
    layout = BlockLayout((16, 128), 16, 128, 16, 64)
    generator = torch.Generator().manual_seed(31)
    first = torch.zeros(16, 64, dtype=F64)
    first[5] = torch.randn(64, generator=generator, dtype=F64)
    second = torch.zeros(16 * 64, dtype=F64)
    second[torch.randperm(16 * 64, generator=generator)[:10]] = torch.randn(10, generator=generator, dtype=F64)
    blocks = [first, second.view(16, 64)]
    want = torch.cat([dense_dct(block, 64, inverse=True) for block in blocks], dim=1)
    got = dct_transform(torch.cat(blocks, dim=1), layout, inverse=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_nan_in_the_aggregate_moves_no_parameter_on_the_sign_base_as_on_the_torch_path():
    """torch.sign(nan) is 0: the separate steps leave an entry whose update is NaN where it was,
    and so does the kernel."""
    codec = DCTTopK(chunk=64, topk=4, wire="paper")
    layout = BlockLayout((64, 128), 64, 128, 64, 64)
    gathered = _gathered(1, layout, 4, seed=13, dtype=torch.float32)
    gathered.tensors["values"][0, 0, 1] = float("nan")  # all of block 0's update is NaN
    param = torch.randn(64, 128)
    aggregate = codec.aggregate_gathered([gathered], [layout], [0], out=torch.empty(layout.numel),
                                         counts=torch.empty(layout.numel))
    want = param - 0.5 * torch.sign(dct_transform(aggregate.view(64, 128), layout, inverse=True))
    assert codec.decode_add(gathered, layout, [param], alpha=-0.5, sign=True)
    assert torch.equal(param, want)
    assert not param.isnan().any()


def test_the_kernels_mark_what_they_write_for_autograd():
    """Their targets' version counters move, as torch's in-place operators move them."""
    codec = DCTTopK(chunk=64, topk=4, wire="paper")
    layout = BlockLayout((64, 128), 64, 128, 64, 64)
    param, momentum, out = torch.zeros(64, 128), torch.zeros(64, 128), torch.zeros(64, 128)
    versions = [param._version, momentum._version, out._version]
    assert codec.decode_add(_gathered(1, layout, 4, seed=14, dtype=torch.float32), layout, [param], alpha=1.0,
                            sign=True)
    assert codec.transform_select([torch.randn(64, 128)], layout, momentum, beta=0.5, alpha=1.0) is not None
    dct_transform(torch.randn(64, 128), layout, out=out)
    assert [param._version, momentum._version, out._version] == [version + 1 for version in versions]


def test_decoding_into_the_targets_is_bit_for_bit_the_aggregate_then_the_kernels_inverse():
    """float32, 4 senders: the coefficients gathered in cache are the aggregate's exactly."""
    codec = DCTTopK(chunk=64, topk=32, wire="paper")
    layout = BlockLayout((256, 192), 256, 192, 64, 64)
    gathered = _gathered(4, layout, 32, seed=5, dtype=torch.float32)
    aggregate = codec.aggregate_gathered([gathered], [layout], [0], out=torch.empty(layout.numel),
                                         counts=torch.empty(layout.numel))
    inverse = dct_transform(aggregate.view(256, 192), layout, inverse=True)
    param = torch.randn(256, 192)
    want = param - 0.5 * inverse.sign()
    assert codec.decode_add(gathered, layout, [param], alpha=-0.5, sign=True)
    assert torch.equal(param, want)


def test_decoding_reads_each_workers_row_where_the_all_gather_left_it():
    """The payloads as views of a W x n all-gather buffer (each worker's row contiguous, the
    rows a whole buffer's length apart, as DeMo hands a run's) decode as their contiguous copy
    does, bit for bit, without copying them; a corrupt index in the last worker's row, read
    through the same strides, is refused before anything is written."""
    codec = DCTTopK(chunk=64, topk=32, wire="paper")
    layout = BlockLayout((256, 192), 256, 192, 64, 64)
    gathered = _gathered(8, layout, 32, seed=9, dtype=torch.float32)
    index, values = gathered.tensors["index"], gathered.tensors["values"]
    # each tensor inside a wider buffer, after another run's 100 entries per worker
    wide = {key: torch.zeros(8, 100 + tensor[0].numel() + 37, dtype=tensor.dtype) for key, tensor in
            (("index", index), ("values", values))}
    strided = {}
    for key, tensor in (("index", index), ("values", values)):
        wide[key][:, 100:100 + tensor[0].numel()] = tensor.reshape(8, -1)
        strided[key] = wide[key][:, 100:100 + tensor[0].numel()].view(tensor.shape)
    assert not strided["index"].is_contiguous()
    assert _rows_contiguous(strided["index"]) is strided["index"]  # handed to the kernel as it is
    param = torch.randn(256, 192)
    want = param.clone()
    assert codec.decode_add(gathered, layout, [want], alpha=-0.5, sign=True)
    assert codec.decode_add(Payload(strided, gathered.meta), layout, [param], alpha=-0.5, sign=True)
    assert torch.equal(param, want)
    wide["index"][7, 100 + 5] = 64 * 64  # one past the block, in the last worker's row
    before = param.clone()
    with pytest.raises(RuntimeError, match="block-local index 4096 outside a block of 4096"):
        codec.decode_add(Payload(strided, gathered.meta), layout, [param], alpha=-0.5, sign=True)
    assert torch.equal(param, before)


def test_decoding_into_the_targets_leaves_what_the_kernels_cannot_do_to_the_caller(monkeypatch):
    codec = DCTTopK(chunk=64, topk=4, wire="paper")
    layout = BlockLayout((64, 128), 64, 128, 64, 64)
    for target in (torch.zeros(128, 64).T, torch.zeros(64, 128, dtype=torch.bfloat16)):
        gathered = _gathered(1, layout, 4, seed=6, dtype=target.dtype)
        kept = target.clone()
        assert not codec.decode_add(gathered, layout, [target], alpha=1.0, sign=True)
        assert torch.equal(target, kept)
    monkeypatch.setattr(cpu_kernels, "ops", lambda: None)
    assert not codec.decode_add(_gathered(1, layout, 4, seed=6), layout, [torch.zeros(64, 128, dtype=F64)],
                                alpha=1.0, sign=True)


@pytest.mark.parametrize("bad", [4096, -1])
def test_a_corrupt_index_is_refused_before_anything_is_written(bad):
    """Two block rows of three tiles: an index outside its block in the last block leaves every
    tile of the target as it was (all are checked before any is written)."""
    codec = DCTTopK(chunk=64, topk=4, wire="paper")
    layout = BlockLayout((128, 1280), 128, 1280, 64, 64)
    gathered = _gathered(2, layout, 4, seed=7)
    gathered.tensors["index"][1, -1, 2] = bad
    target = torch.randn(128, 1280, dtype=F64)
    before = target.clone()
    with pytest.raises(RuntimeError, match=f"index {bad} outside a block of 4096"):
        codec.decode_add(gathered, layout, [target], alpha=1.0, sign=False)
    assert torch.equal(target, before)


def test_without_the_kernels_it_is_the_matrix_products_bit_for_bit(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "ops", lambda: None)
    layout = _layout((128, 192), 64)
    matrix = torch.randn(128, 192)
    for inverse in (False, True):
        products = block_transform(matrix, layout, *dct_bases(layout, "cpu", torch.float32), inverse=inverse)
        assert torch.equal(dct_transform(matrix, layout, inverse=inverse), products)
    strided = torch.randn(192, 128).T  # not contiguous: the products, with the kernels or without
    monkeypatch.undo()
    products = block_transform(strided, layout, *dct_bases(layout, "cpu", torch.float32))
    assert torch.equal(dct_transform(strided, layout), products)


def test_the_kernel_checks_its_arguments():
    kernel = cpu_kernels.ops().dct_blocks
    with pytest.raises(RuntimeError, match="float32 or float64"):
        kernel([torch.zeros(64, 64, dtype=torch.bfloat16)], [torch.zeros(64, 64, dtype=torch.bfloat16)], 64, 64, 64,
               False, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="whole number of block rows"):
        kernel([torch.zeros(32, 64)], [torch.zeros(32, 64)], 64, 64, 64, False, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="the targets"):
        kernel([torch.zeros(128, 64)], [torch.zeros(64, 64)], 64, 64, 64, False, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="do not tile"):
        kernel([torch.zeros(64, 64)], [torch.zeros(64, 64)], 64, 64, 48, False, 0.0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("subtract", [0.0, 1.0, 0.37])
@pytest.mark.parametrize(("shape", "chunk", "k"), [((320, 1024), 64, 32), ((96, 40), 64, 8), ((128, 96), 16, 3)])
def test_transform_and_select_in_one_pass_is_the_transform_then_the_selection(shape, chunk, k, subtract, dtype):
    """DeMo's encode on the CPU kernels: the momentum accumulated by the transform, the top-k
    of each tile taken while it is in cache and the selected values subtracted there are bit for
    bit dct_transform, block_topk, then index_add_ of the values times -subtract."""
    codec = DCTTopK(chunk=chunk, topk=k, wire="paper")
    layout = codec.layout(shape)
    generator = torch.Generator().manual_seed(9)
    parts = list(torch.randn(shape, generator=generator, dtype=dtype).split(layout.chunk_rows * 2))
    parts = [part.contiguous() for part in parts]
    momentum = torch.randn(layout.rows, layout.cols, generator=generator, dtype=dtype)
    expected_momentum = dct_transform(parts, layout, out=momentum.clone(), beta=0.9, alpha=0.01)
    expected = codec.select(expected_momentum, layout)
    if subtract:
        _, positions, values = expected
        expected_momentum.view(-1).index_add_(0, positions.view(-1), values.view(-1), alpha=-subtract)
    selected = codec.transform_select(parts, layout, momentum, beta=0.9, alpha=0.01, subtract=subtract)
    assert torch.equal(momentum, expected_momentum)
    for got, want in zip(selected, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("wire", WIRES)
def test_a_wire_removes_the_selected_values_where_what_it_subtracts_is_them(wire):
    """removed and removes_selected_values (which lets DeMo's encode subtract in its kernel's
    pass) against what a sender subtracts: what receivers decode where they decode magnitudes,
    else the values."""
    codec = DCTTopK(chunk=8, topk=4, wire=wire)
    values = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    subtracted = codec.received(values) if codec.decodes_magnitudes else values
    assert torch.equal(codec.removed(values), subtracted)
    assert codec.removes_selected_values == torch.equal(subtracted, values)


def test_transform_and_select_gives_way_where_its_kernel_cannot_run(monkeypatch):
    codec = DCTTopK(chunk=64, topk=4, wire="paper")
    layout = codec.layout((64, 128))
    momentum = torch.zeros(64, 128)
    assert codec.transform_select([torch.randn(128, 64).T], layout, momentum, beta=0.5, alpha=1.0) is None
    assert codec.transform_select([torch.randn(64, 128, dtype=torch.bfloat16)], layout,
                                  momentum.to(torch.bfloat16), beta=0.5, alpha=1.0) is None
    monkeypatch.setattr(cpu_kernels, "ops", lambda: None)
    assert codec.transform_select([torch.randn(64, 128)], layout, momentum, beta=0.5, alpha=1.0) is None
    assert torch.equal(momentum, torch.zeros(64, 128))
