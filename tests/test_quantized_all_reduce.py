"""The quantized all-reduce (Communicator.all_reduce_quantized) on real gloo workers: a W = 3
case worked out by hand, error bounds at W = 4 and 7, its bytes (conservation, and about
2 (W-1)/W of the payload against an all-gather's W-1), and the error-feedback residual.

The hand-worked case, E3M0 (per-row scale s = max |x| of the row, magnitudes s * 2**-k, ties to
the nearer in linear distance), one 3 x 2 tensor per rank, one row per rank's chunk:

    rank 0: [[4, 1], [-2, 0.5], [1, 1]]
    rank 1: [[4, 2], [-2, 0.5], [2, 2]]
    rank 2: [[4, -0.5], [-2, -0.25], [4, 4]]

Every entry is exact in E3M0 (a power of two of its row's maximum), so the first quantization
loses nothing; the row means are

    row 0: [4, 2.5/3 = 0.8333]   row 1: [-2, 0.75/3 = 0.25]   row 2: [7/3, 7/3]

and re-quantizing them (rank j re-quantizes row j) gives
    row 0: 0.8333 / 4 = 0.2083 lies between 1/8 and 1/4, above the midpoint 0.1875: 1/4 -> 1.0
    row 1: 0.25 / 2 = 1/8 exactly: 0.25
    row 2: both entries equal the row's scale: 7/3 exactly (in float32)
so every rank ends with [[4, 1], [-2, 0.25], [7/3, 7/3]] where the fp32 all-reduce gives
[[4, 0.8333], [-2, 0.25], [7/3, 7/3]].

Bytes, per rank: each chunk is one row of two 4-bit codes (1 byte) and one float32 scale: 5
bytes, 15 per rank. The all-to-all sends the two chunks for the other ranks (10 bytes), the
all-gather forwards the other two reduced chunks (10 bytes): tx = rx = 20 = 2 (W-1)/W x 15,
against 30 for an all-gather of the whole payload.
"""

from __future__ import annotations

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.quantized import (
    chunk_bounds,
    chunk_shapes,
    encoded_sizes,
    quantized_all_reduce_bytes,
)
from lowcomm.comm.spawn import spawn_workers
from lowcomm.compress.e3m0 import E3M0
from lowcomm.compress.quantize import Quantize

HAND = {
    0: [[4.0, 1.0], [-2.0, 0.5], [1.0, 1.0]],
    1: [[4.0, 2.0], [-2.0, 0.5], [2.0, 2.0]],
    2: [[4.0, -0.5], [-2.0, -0.25], [4.0, 4.0]],
}


# ------------------------------------------------------------------------------ chunking
def test_chunks_are_row_ranges_the_first_ones_a_row_longer():
    assert chunk_bounds((5, 6), 2) == [(0, 3), (3, 5)]
    assert chunk_bounds((7,), 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds((2, 4), 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # fewer rows than ranks
    assert chunk_shapes((2, 4), 4) == [torch.Size([1, 4]), torch.Size([1, 4]), None, None]
    assert chunk_shapes((), 2) == [torch.Size([1]), None]


def test_closed_form_sizes_equal_the_chunks_counted_one_by_one():
    codec = Quantize(bits=2)
    shapes = [torch.Size([50304, 64]), torch.Size([192, 64]), torch.Size([64]), torch.Size([3, 5])]
    for world in (1, 2, 7, 64, 1000):
        per_rank = [0] * world
        for shape in shapes:
            for j, chunk in enumerate(chunk_shapes(shape, world)):
                per_rank[j] += codec.payload_nbytes(chunk, torch.float32) if chunk is not None else 0
        assert encoded_sizes(codec, shapes, world) == (sum(per_rank), max(per_rank))


# ------------------------------------------------------------------------------ on workers
def _hand(rank: int, world: int) -> dict:  # noqa: ARG001 - spawn_workers' signature
    comm = Communicator()
    tensor = torch.tensor(HAND[rank])
    exact = tensor.clone()
    comm.all_reduce(exact, op="avg")
    comm.meter.end_step()
    comm.all_reduce_quantized([tensor], E3M0())
    return {"result": tensor, "exact": exact, "bytes": comm.meter.breakdown(cumulative=False)}


@pytest.mark.slow
def test_hand_worked_case_at_three_workers():
    results = spawn_workers(_hand, 3)
    expected = torch.tensor([[4.0, 1.0], [-2.0, 0.25], [7 / 3, 7 / 3]])
    exact = torch.tensor([[4.0, 2.5 / 3], [-2.0, 0.25], [7 / 3, 7 / 3]])
    for out in results:
        assert torch.equal(out["result"], expected)
        torch.testing.assert_close(out["exact"], exact)
        assert out["bytes"]["data/world/all_reduce_quantized"] == {
            "calls": 1, "payload": 15, "tx": 20, "rx": 20, "messages": 4}


def _bounded(rank: int, world: int) -> dict:  # noqa: ARG001 - spawn_workers' signature
    """4-bit statistical quantization of uniform data (no entry beyond the outer bins), three
    tensors of awkward shapes (rows not divisible by W, fewer rows than W, a vector)."""
    generator = torch.Generator().manual_seed(100 + rank)
    tensors = [torch.rand(13, 9, generator=generator) * 2 - 1, torch.rand(3, 40, generator=generator),
               torch.rand(101, generator=generator) - 0.5]
    inputs = [t.clone() for t in tensors]
    exact = [t.clone() for t in tensors]
    comm = Communicator()
    for tensor in exact:
        comm.all_reduce(tensor, op="avg")
    comm.meter.end_step()
    work = comm.all_reduce_quantized(tensors, Quantize(bits=4), async_op=True)
    work.wait()
    traffic = comm.meter.breakdown(cumulative=False)["data/world/all_reduce_quantized"]
    return {"inputs": inputs, "result": tensors, "exact": exact, "traffic": traffic}


def _step(values: torch.Tensor) -> float:
    """The statistical quantizer's step for these values: 6 sigma / 2**4 (sigma with Bessel's
    correction); 1 for a single value (it is then exact)."""
    return 6 * values.std(correction=1).item() / 16 if values.numel() > 1 else 0.0


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 7])
def test_result_is_within_two_steps_of_the_exact_mean_and_the_same_on_every_rank(world):
    """Bound: each worker's entry is decoded to its bin's mean, within one step s_i of its chunk
    (interior bins are one step wide and uniform data stays inside them), so the mean of the
    decodings is within max_i s_i of the exact mean; re-quantizing the mean adds at most one step
    s' of the mean chunk. |result - exact| <= max_i s_i + s'."""
    results = spawn_workers(_bounded, world)
    for index in range(3):
        result, exact = results[0]["result"][index], results[0]["exact"][index]
        for out in results[1:]:
            assert torch.equal(out["result"][index], result)  # every rank applies the same values
        for start, stop in chunk_bounds(result.shape, world):
            if stop == start:
                continue
            first = max(_step(out["inputs"][index][start:stop].reshape(-1)) for out in results)
            second = _step(exact[start:stop].reshape(-1))
            error = (result[start:stop] - exact[start:stop]).abs().max().item()
            assert error <= (first + second) * (1 + 1e-5) + 1e-7, (index, start, error, first, second)
        assert (result - exact).abs().max() > 0  # quantized, not a disguised exact all-reduce
    # bytes: what is sent is received; about 2 (W-1)/W of the payload, far below an all-gather's W-1
    assert sum(out["traffic"]["tx"] for out in results) == sum(out["traffic"]["rx"] for out in results)
    payload = results[0]["traffic"]["payload"]
    assert all(out["traffic"]["payload"] == payload for out in results)
    mean_tx = sum(out["traffic"]["tx"] for out in results) / world
    assert 2 * (world - 1) / world * payload <= mean_tx <= 2 * (world - 1) / world * payload * 1.35
    assert mean_tx < (world - 1) * payload  # what an all-gather of the payload sends
    sizes = encoded_sizes(Quantize(bits=4), [torch.Size([13, 9]), torch.Size([3, 40]), torch.Size([101])], world)
    wire = quantized_all_reduce_bytes(*sizes, world)
    assert wire[:3] == pytest.approx((payload, mean_tx, mean_tx), rel=1e-12)
    # the all-to-all's part, sent straight to each rank: (W-1)/W of the payload
    assert wire.direct == pytest.approx((world - 1) / world * payload, rel=1e-12)


def _residual(rank: int, world: int) -> dict:  # noqa: ARG001
    generator = torch.Generator().manual_seed(7 + rank)
    source = torch.randn(10, 6, generator=generator, dtype=torch.float64)
    original = source.clone()
    out = torch.empty_like(source)
    Communicator().all_reduce_quantized([source], Quantize(bits=2), out=[out], residual=True)
    return {"original": original, "residual": source}


@pytest.mark.slow
def test_residual_is_what_the_own_quantization_dropped():
    """With residual=True each input keeps input - decode(its own chunk's payload): what error
    feedback carries to the next round. Chunks are rows 0-4 and 5-9 at W = 2."""
    codec = Quantize(bits=2)
    for out in spawn_workers(_residual, 2):
        for start, stop in ((0, 5), (5, 10)):
            chunk = out["original"][start:stop]
            dropped = chunk - codec.decode([codec.encode(chunk)])
            assert torch.equal(out["residual"][start:stop], dropped)
        assert out["residual"].abs().sum() > 0


def test_one_process_is_one_encode_and_decode_with_no_bytes():
    comm = Communicator()
    tensor = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    codec = Quantize(bits=2)
    expected = codec.decode([codec.encode(tensor)])
    comm.all_reduce_quantized([tensor], codec)
    assert torch.equal(tensor, expected)
    assert comm.meter.breakdown()["data/world/all_reduce_quantized"] == {
        "calls": 1, "payload": codec.payload_nbytes(tensor.shape, tensor.dtype), "tx": 0, "rx": 0, "messages": 0}


def test_one_process_passes_an_empty_tensor_through():
    """An empty tensor (a parameter with no rows here) has no chunk to encode or decode, at
    W = 1 as at any W: the others are reduced as if it were not there."""
    codec = Quantize(bits=2)
    empty, tensor = torch.empty(0, 4), torch.randn(6, 5, generator=torch.Generator().manual_seed(4))
    expected = codec.decode([codec.encode(tensor)])
    Communicator().all_reduce_quantized([empty, tensor], codec)
    assert empty.shape == (0, 4) and torch.equal(tensor, expected)
