"""The block transforms and the DCT top-k codec, against dense re-derivations written out in
dct_reference: the DCT-II from its definition, block transforms as products with block-diagonal
(Kronecker) matrices, top-k by sorting each block; and the mean over contributors by explicit
counting, here."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dct_reference import F64, as_matrix, dct_definition, dense_dct, dense_topk
from lowcomm.compress.base import Payload
from lowcomm.compress.dct import (
    BlockLayout,
    block_transform,
    chunk_size,
    dct_basis,
    random_orthonormal_basis,
)
from lowcomm.compress.dct_topk import WIRES, DCTTopK, ordered_index_add_, rowwise_index_add_
from lowcomm.compress.registry import build_codec
from lowcomm.optim.demo import stacked_layout


# ------------------------------------------------------------------- chunk rule
@pytest.mark.parametrize(
    ("size", "target", "expected"),
    [
        (1024, 64, 64),
        (3072, 64, 64),
        (50304, 64, 64),
        (96, 64, 48),
        (100, 64, 50),
        (130, 64, 26),
        (48, 64, 48),
        (64, 64, 64),
        (1, 64, 1),
        (67, 64, 1),
        (7, 4, 1),
        (6, 4, 3),
    ],
)
def test_chunk_rule(size, target, expected):
    assert chunk_size(size, target) == expected


def test_degenerate_dimension_warns_once_per_layout():
    with pytest.warns(UserWarning, match="size 67 .* chunk is 1"):
        layout = BlockLayout.for_shape((67, 128), 64)
    assert (layout.chunk_rows, layout.chunk_cols) == (1, 64)
    codec = DCTTopK(chunk=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        codec.layout((128, 67))
        codec.layout((128, 67))
        BlockLayout.for_shape((1, 64), 64)
        BlockLayout.for_shape((48,), 64)
    assert len(caught) == 1


def test_layout_views_tensors_as_matrices():
    assert BlockLayout.for_shape((24,), 4) == BlockLayout((24,), 1, 24, 1, 4)
    assert BlockLayout.for_shape((4, 3, 8), 4) == BlockLayout((4, 3, 8), 4, 24, 4, 4)
    layout = BlockLayout.for_shape((10, 6), 4)
    assert (layout.chunk_rows, layout.chunk_cols, layout.num_blocks, layout.block_numel) == (2, 3, 10, 6)


def test_global_index_points_into_the_right_block():
    layout = BlockLayout.for_shape((6, 8), 4)  # chunks 3 x 4, blocks 2 x 2
    matrix = torch.arange(48).reshape(6, 8)
    block_index = torch.tensor([[0, 11], [1, 4], [5, 6], [3, 8]])
    expected = torch.tensor(
        [
            [matrix[0, 0], matrix[2, 3]],
            [matrix[0, 5], matrix[1, 4]],
            [matrix[4, 1], matrix[4, 2]],
            [matrix[3, 7], matrix[5, 4]],
        ]
    )
    assert torch.equal(matrix.reshape(-1)[layout.global_index(block_index)], expected)
    # its tables are built once per layout (and device) and kept: a start, a second call, a
    # leading worker dimension and another start leave them as they were
    within = layout.global_index(block_index)
    assert torch.equal(layout.global_index(block_index, 100), within + 100)
    assert torch.equal(layout.global_index(block_index), within)
    assert torch.equal(layout.global_index(torch.stack([block_index, block_index]), 7), torch.stack([within] * 2) + 7)
    assert torch.equal(layout.global_index(block_index), within)


# ------------------------------------------------------------------------ bases
@pytest.mark.parametrize("size", [1, 2, 3, 8, 64])
def test_dct_basis_matches_definition_and_is_orthonormal(size):
    basis = dct_basis(size, "cpu", F64)
    torch.testing.assert_close(basis, dct_definition(size), rtol=0, atol=1e-13)
    torch.testing.assert_close(basis @ basis.T, torch.eye(size, dtype=F64), rtol=0, atol=1e-13)
    single = dct_basis(size, "cpu", torch.float32)
    torch.testing.assert_close(single @ single.T, torch.eye(size), rtol=0, atol=1e-5)


def test_dct_of_a_cosine_is_one_coefficient():
    size, frequency = 16, 5
    wave = torch.tensor(
        [math.cos(math.pi * frequency * (2 * i + 1) / (2 * size)) for i in range(size)], dtype=F64
    )
    coefficients = dct_basis(size, "cpu", F64) @ wave
    expected = torch.zeros(size, dtype=F64)
    expected[frequency] = wave.norm()
    torch.testing.assert_close(coefficients, expected, rtol=0, atol=1e-12)


def test_random_basis_is_orthonormal_and_seeded():
    basis = random_orthonormal_basis(32, seed=7, dtype=F64)
    torch.testing.assert_close(basis @ basis.T, torch.eye(32, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(basis.T @ basis, torch.eye(32, dtype=F64), rtol=0, atol=1e-12)
    assert torch.equal(basis, random_orthonormal_basis(32, seed=7, dtype=F64))
    assert not torch.allclose(basis, random_orthonormal_basis(32, seed=8, dtype=F64))
    assert random_orthonormal_basis(32, seed=7).dtype == torch.float32


# ------------------------------------------------------------- block transforms
@pytest.mark.filterwarnings("ignore:a dimension of size")  # the prime sizes degenerate to chunk 1
@pytest.mark.parametrize("shape", [(12, 20), (10, 6), (24,), (4, 3, 8), (8, 7), (7, 8), (7, 11)])
def test_block_transform_equals_block_diagonal_products(shape):
    layout = BlockLayout.for_shape(shape, 4)
    bases = [dct_basis(c, "cpu", F64) if c > 1 else None for c in (layout.chunk_rows, layout.chunk_cols)]
    tensor = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    expected = dense_dct(as_matrix(tensor), 4)

    forward = block_transform(tensor, layout, *bases)
    torch.testing.assert_close(forward, expected, rtol=0, atol=1e-12)
    back = block_transform(forward, layout, *bases, inverse=True, out=torch.full_like(forward, math.nan))
    torch.testing.assert_close(back, as_matrix(tensor), rtol=0, atol=1e-12)

    accumulator = torch.ones(layout.rows, layout.cols, dtype=F64)
    scratch = torch.empty(layout.numel, dtype=F64)
    block_transform(tensor, layout, *bases, out=accumulator, scratch=scratch, beta=0.5, alpha=3.0)
    torch.testing.assert_close(accumulator, 0.5 + 3.0 * expected, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------- codec
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize(("shape", "topk"), [((16, 24), 5), ((10, 6), 4), ((40,), 3), ((6, 2, 4), 20)])
def test_encode_decode_matches_dense_topk(wire, shape, topk):
    codec = DCTTopK(chunk=4, topk=topk, wire=wire)
    tensor = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    sent, _ = dense_topk(dense_dct(as_matrix(tensor), 4), 4, topk, wire)
    expected = dense_dct(sent, 4, inverse=True).reshape(shape)

    payload = codec.encode(tensor)
    decoded = codec.decode([payload])
    assert decoded.shape == tensor.shape and decoded.dtype == F64
    torch.testing.assert_close(decoded, expected, rtol=0, atol=1e-12)
    assert payload.nbytes == codec.payload_nbytes(shape, F64)


@pytest.mark.parametrize("wire", WIRES)
def test_decode_averages_over_the_workers_that_sent_each_coefficient(wire):
    codec = DCTTopK(chunk=4, topk=3, wire=wire)
    generator = torch.Generator().manual_seed(2)
    tensors = [torch.randn(8, 12, dtype=F64, generator=generator) for _ in range(3)]
    tensors[1][:4, :4] = tensors[0][:4, :4]  # workers 0 and 1 pick the same coefficients in one block

    sums = torch.zeros(8, 12, dtype=F64)
    counts = torch.zeros(8, 12, dtype=F64)
    for tensor in tensors:
        sent, mask = dense_topk(dense_dct(tensor, 4), 4, 3, wire)
        sums += sent
        counts += mask
    assert counts.max() >= 2  # the test exercises overlaps
    expected = dense_dct(sums / counts.clamp(min=1), 4, inverse=True)

    decoded = codec.decode([codec.encode(tensor) for tensor in tensors])
    torch.testing.assert_close(decoded, expected, rtol=0, atol=1e-12)


def test_wire_sizes():
    shape = (64, 128)  # 2 x 4 blocks of 32 x 32
    blocks, k = 8, 9
    sizes = {wire: DCTTopK(chunk=32, topk=k, wire=wire).encode(torch.randn(shape)) for wire in WIRES}
    assert sizes["paper"].nbytes == blocks * k * (8 + 4)
    assert sizes["compact"].nbytes == blocks * k * (2 + 2)
    assert sizes["sign"].nbytes == blocks * k * 2 + math.ceil(blocks * k / 8) + blocks * 2
    # 32 x 32 = 1024 positions: two-byte indices, one bit per value, no scale (Psyche's 1-bit)
    assert sizes["signbit"].nbytes == blocks * k * 2 + math.ceil(blocks * k / 8)
    assert {name: t.dtype for name, t in sizes["sign"].tensors.items()} == {
        "index": torch.uint8,
        "signs": torch.uint8,
        "scale": torch.bfloat16,
    }
    assert (
        DCTTopK(chunk=32, topk=k).encode(torch.randn(shape, dtype=torch.bfloat16)).nbytes == blocks * k * 10
    )


@pytest.mark.parametrize("wire", ["compact", "sign", "signbit"])
def test_sixteen_bit_indices_cover_a_256_x_256_block(wire):
    codec = DCTTopK(chunk=256, topk=2, wire=wire)
    coefficients = torch.zeros(256, 256, dtype=F64)
    coefficients[255, 255] = 3.0  # block-local index 65535
    coefficients[156, 64] = -2.0  # 40000
    tensor = dense_dct(coefficients, 256, inverse=True)
    index, values = codec.unpack(codec.encode(tensor))
    signs = {
        i: math.copysign(1, v) for i, v in zip(index.view(-1).tolist(), values.view(-1).tolist(), strict=True)
    }
    assert signs == {65535: 1.0, 40000: -1.0}


def test_sign_bits_pack_across_blocks():
    codec = DCTTopK(chunk=4, topk=3, wire="sign")  # 3 blocks x 3 kept = 9 bits -> 2 bytes
    layout = codec.layout((12,))
    index = torch.tensor([[0, 1, 2], [3, 0, 1], [2, 3, 0]])
    values = torch.tensor([[1.0, -2.0, 3.0], [-1.0, -1.0, -4.0], [2.0, 2.0, -2.0]])
    payload = codec.pack(index, values, layout)
    assert payload.tensors["signs"].numel() == 2
    decoded_index, decoded = codec.unpack(Payload(payload.tensors, payload.meta))
    assert torch.equal(decoded_index, index)
    scale = values.abs().mean(dim=1, keepdim=True).to(torch.bfloat16).float()
    assert torch.equal(decoded, torch.where(values < 0, -scale, scale))


def test_registered_and_validated():
    codec = build_codec({"name": "dct_topk", "chunk": 32, "topk": 8, "wire": "compact"})
    assert isinstance(codec, DCTTopK) and (codec.chunk, codec.topk, codec.wire) == (32, 8, "compact")
    for bad in ({"wire": "int8"}, {"chunk": 0}, {"topk": 0}, {"chunk": 512, "wire": "sign"}):
        with pytest.raises(ValueError, match="compression"):
            DCTTopK(**bad)
    DCTTopK(chunk=512, wire="paper")  # int64 indices: any block size


@pytest.mark.filterwarnings("ignore:a dimension of size")
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("world", [2, 4])
def test_aggregating_gathered_buffers_is_bit_identical_to_per_worker_aggregation(wire, world):
    # DeMo's bucketed exchange: all workers' payloads of several tensors, as one all-gather
    # into a W x n buffer leaves them, decoded in one pass (its mean over senders is one dense
    # division; aggregate() divides at the sent positions only)
    codec = DCTTopK(chunk=4, topk=3, wire=wire)
    shapes = [(8, 12), (10, 6), (24,), (4, 3, 8), (8, 7)]
    generator = torch.Generator().manual_seed(3)
    payloads = [[codec.encode(torch.randn(shape, generator=generator)) for shape in shapes] for _ in range(world)]
    layouts = [codec.layout(shape) for shape in shapes]
    offsets = [sum(layout.numel for layout in layouts[:i]) for i in range(len(layouts))]
    stacked = [
        Payload({key: torch.stack([payloads[w][i].tensors[key] for w in range(world)]) for key in payloads[0][i].tensors},
                payloads[0][i].meta)
        for i in range(len(shapes))
    ]
    total = sum(layout.numel for layout in layouts)
    together = codec.aggregate_gathered(stacked, layouts, offsets, out=torch.empty(total), counts=torch.empty(total))
    for i, layout in enumerate(layouts):
        alone = codec.aggregate([payloads[w][i] for w in range(world)], layout).view(-1)
        assert torch.equal(together[offsets[i] : offsets[i] + layout.numel], alone), shapes[i]
    overlap = sum(int(c) > 1 for c in torch.bincount(torch.cat(
        [layouts[0].global_index(codec.unpack(payloads[w][0])[0]).view(-1) for w in range(world)])))
    assert overlap > 0  # workers chose some of the same coefficients: the mean-over-senders path ran


@pytest.mark.parametrize("add", [ordered_index_add_, rowwise_index_add_], ids=["cpu_path", "cuda_path"])
def test_workers_payloads_are_added_in_worker_order_on_either_path(add):
    """Position 2 gets 1e8, then 1, then -1e8: in float32, worker order gives (1e8 + 1) - 1e8 = 0
    (1e8 + 1 rounds to 1e8); any other order that adds the 1 last gives 1. CUDA's path (one
    index_add_ per worker, runnable on the CPU) must round as the CPU's one index_add_ does."""
    positions = torch.tensor([[0, 1, 2], [2, 0, 4], [1, 2, 3]])
    values = torch.tensor([[1.0, 2.0, 1e8], [1.0, 3.0, 5.0], [4.0, -1e8, 6.0]])
    target = add(torch.zeros(5), positions, values)
    assert target.tolist() == [4.0, 6.0, 0.0, 6.0, 5.0]


@pytest.mark.parametrize("wire", WIRES)
def test_what_receivers_decode_is_known_without_packing(wire):
    """DeMo subtracts from a whole stack's momentum what receivers will decode: ``received``
    must equal unpacking the packed payload, for every wire."""
    codec = DCTTopK(chunk=8, topk=5, wire=wire)
    tensor = torch.randn(16, 24, generator=torch.Generator().manual_seed(5))
    layout = codec.layout(tensor.shape)
    index, _, values = codec.select(block_transform(tensor, layout, *codec.bases(layout, "cpu", torch.float32)),
                                    layout)
    assert torch.equal(codec.received(values), codec.unpack(codec.pack(index, values, layout))[1])


def test_payloads_laid_end_to_end_read_as_one_unless_a_sign_byte_is_split():
    """6 blocks x k = 4 is 24 sign bits (three whole bytes); 3 blocks x 4 = 12 bits ends inside a
    byte, which its payload pads: only the last tensor may do that."""
    whole, split = BlockLayout.for_shape((8, 12), 4), BlockLayout.for_shape((4, 12), 4)
    assert (whole.num_blocks, split.num_blocks) == (6, 3)
    for wire in ("sign", "signbit"):
        codec = DCTTopK(chunk=4, topk=4, wire=wire)
        assert codec.stackable([whole, split]) and not codec.stackable([split, whole])
    for wire in ("paper", "compact"):
        assert DCTTopK(chunk=4, topk=4, wire=wire).stackable([split, whole])


@pytest.mark.filterwarnings("ignore:a dimension of size")
@pytest.mark.parametrize(("shapes", "bases"), [
    ([(8, 12), (4, 12), (12, 12)], "dct"),  # both bases
    ([(1, 24), (1, 24)], "dct"),  # 1-D: no left basis
    ([(8, 7), (4, 7)], "dct"),  # 7 is prime: no right basis
    ([(8, 12), (4, 12)], "identity"),
])
@pytest.mark.parametrize(("inverse", "beta"), [(False, 0.0), (False, 0.9), (True, 0.0)])
def test_a_stack_of_row_blocks_transforms_bit_for_bit_as_their_concatenation(shapes, bases, inverse, beta):
    generator = torch.Generator().manual_seed(6)
    parts = [torch.randn(shape, generator=generator) for shape in shapes]
    stacked = torch.cat(parts)
    layout = stacked_layout([BlockLayout.for_shape(shape, 4) for shape in shapes])
    assert layout.rows == stacked.shape[0]
    left, right = DCTTopK(chunk=4).bases(layout, "cpu", torch.float32) if bases == "dct" else (None, None)
    start = torch.randn(stacked.shape, generator=generator)
    whole, pieces = start.clone(), start.clone()
    block_transform(stacked, layout, left, right, inverse=inverse, out=whole, beta=beta, alpha=0.5)
    block_transform(parts, layout, left, right, inverse=inverse, out=pieces, beta=beta, alpha=0.5)
    assert torch.equal(pieces, whole)
