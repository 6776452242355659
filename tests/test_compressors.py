"""Top-k and quantisation codecs, bit packing, and error feedback.

Expectations are re-derived densely here (masks, bin edges, per-bin means) rather than read
back from the codecs.
"""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.compress.error_feedback import ErrorFeedback
from lowcomm.compress.quantize import Quantize, pack_codes, unpack_codes
from lowcomm.compress.registry import CODECS, build_codec
from lowcomm.compress.topk import TopK


def _heavy_tailed(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=generator)
    return base * torch.rand(shape, generator=generator).pow(-0.5) + 0.3  # a few far outliers, nonzero mean


# ---------------------------------------------------------------------------------- packing
def test_pack_codes_layout_and_roundtrip():
    # code j of a byte sits at bits [j*b, (j+1)*b): [1, 2, 3, 0] -> 1 + 2*4 + 3*16 + 0*64 = 57
    assert pack_codes(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [57]
    assert pack_codes(torch.tensor([0xA, 0x5, 0x3], dtype=torch.uint8), 4).tolist() == [0x5A, 0x03]
    generator = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        for numel in (1, 7, 64, 1001):
            codes = torch.randint(0, 2**bits, (numel,), generator=generator).to(torch.uint8)
            packed = pack_codes(codes, bits)
            assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel * bits / 8)
            assert torch.equal(unpack_codes(packed, bits, numel), codes)


# ---------------------------------------------------------------------------- quantisation
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_statistical_error_within_one_bin_width(bits):
    # Uniform data has max |x - mean| = sqrt(3) sigma: inside the outer bins' edges for 4 and 8
    # bits; for 2 bits the top bin (above 0.75 sigma) spans less than one step of data.
    values = torch.rand(40, 25, generator=torch.Generator().manual_seed(bits)) * 4 - 1
    codec = Quantize(bits=bits, method="statistical")
    decoded = codec.decode([codec.encode(values)])
    bin_width = 6 * values.std(correction=1) / 2**bits
    assert decoded.shape == values.shape and decoded.dtype == values.dtype
    assert (decoded - values).abs().max() <= bin_width * (1 + 1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_statistical_decodes_to_per_bin_means(bits):
    values = _heavy_tailed((33, 17), seed=bits)
    codec = Quantize(bits=bits, method="statistical")
    payload = codec.encode(values)
    # the wire: packed codes and a 2**bits float32 table, nothing else
    assert set(payload.tensors) == {"codes", "table"}
    assert payload.nbytes == math.ceil(values.numel() * bits / 8) + 4 * 2**bits
    assert payload.nbytes == codec.payload_nbytes(values.shape, values.dtype)

    flat = values.flatten().double()
    mean, sigma = flat.mean(), flat.std(correction=1)
    # bins centred on multiples of the step 6 sigma / 2**bits around the mean; outliers clamp to the edge bins
    bins = ((flat - mean) / (6 * sigma / 2**bits) + 2 ** (bits - 1)).round().clamp(0, 2**bits - 1)
    expected = torch.empty_like(flat)
    for index in bins.unique():
        members = bins == index
        expected[members] = flat[members].mean()
    torch.testing.assert_close(codec.decode([payload]).flatten().double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_linear_error_within_half_step(bits):
    values = _heavy_tailed((20, 30), seed=10 + bits)
    codec = Quantize(bits=bits, method="linear")
    payload = codec.encode(values)
    assert set(payload.tensors) == {"codes", "range"}
    assert (
        payload.nbytes
        == math.ceil(values.numel() * bits / 8) + 8
        == codec.payload_nbytes(values.shape, values.dtype)
    )
    decoded = codec.decode([payload])
    step = (values.max() - values.min()) / (2**bits - 1)
    assert (decoded - values).abs().max() <= step / 2 * (1 + 1e-4)
    assert decoded.min() == values.min()


@pytest.mark.parametrize("method", ["statistical", "linear"])
def test_quantize_constant_tensor_is_exact(method):
    values = torch.full((5, 3), -1.25)
    codec = Quantize(bits=2, method=method)
    assert torch.equal(codec.decode([codec.encode(values)]), values)


def _reference_statistical(val: torch.Tensor, n_bins: int, range_in_sigmas: float):
    """The MuLoCo / SparseLoCo reference quantizer transcribed from its description
    (facebookresearch/MuLoCo torchtitan/components/quantized_outer_sgd.py,
    QuantizationCompressor._quantize and _dequantize): its names, its order of operations."""
    offset = n_bins // 2
    shift = val.mean()
    centered_val = val - shift
    std_unbiased = torch.sqrt(centered_val.var(unbiased=True))
    scale = range_in_sigmas * std_unbiased / n_bins
    quantized = torch.clamp(torch.round(centered_val / scale + offset), 0, n_bins - 1).to(torch.uint8)
    bin_counts = torch.bincount(quantized.flatten().long(), minlength=n_bins).float()
    bin_sums = torch.bincount(quantized.flatten().long(), weights=centered_val.flatten().float(), minlength=n_bins)
    lookup = bin_sums / torch.clamp(bin_counts, min=1e-8)
    return quantized, lookup[quantized.long()] + shift


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_statistical_is_bit_exact_with_the_reference_quantizer(bits):
    """lowcomm's range_sigmas 3 is half the reference's quantization_range 6."""
    values = _heavy_tailed((64, 48), seed=20 + bits).flatten()
    codes, decoded = _reference_statistical(values, 2**bits, 6)
    codec = Quantize(bits=bits, method="statistical")
    payload = codec.encode(values)
    assert torch.equal(unpack_codes(payload.tensors["codes"], bits, values.numel()), codes)
    assert torch.equal(codec.decode([payload]), decoded)


def test_two_bit_statistical_decodes_about_55_percent_of_gaussian_entries_to_the_mean():
    """Step 1.5 sigma, the middle code covers |x - mean| < 0.75 sigma: P = erf(0.75 / sqrt 2) = 0.547."""
    values = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0)) + 0.3
    codes = unpack_codes(Quantize(bits=2).encode(values).tensors["codes"], 2, values.numel())
    share = (codes == 2).float().mean().item()
    assert abs(share - math.erf(0.75 / math.sqrt(2))) < 0.002, share


def test_quantize_decode_of_many_is_the_mean():
    codec = Quantize(bits=4, method="statistical")
    tensors = [_heavy_tailed((9, 9), seed=s) for s in range(3)]
    payloads = [codec.encode(t) for t in tensors]
    singles = torch.stack([codec.decode([p]) for p in payloads])
    torch.testing.assert_close(codec.decode(payloads), singles.mean(0))


# ----------------------------------------------------------------------------------- top-k
@pytest.mark.parametrize(("index_dtype", "index_bytes"), [("int32", 4), ("int64", 8)])
def test_topk_keeps_the_largest_entries(index_dtype, index_bytes):
    values = torch.randn(12, 10, generator=torch.Generator().manual_seed(3))
    codec = TopK(fraction=0.15, index_dtype=index_dtype)
    payload = codec.encode(values)
    kept = 18  # floor(0.15 * 120)
    assert payload.nbytes == kept * (4 + index_bytes) == codec.payload_nbytes(values.shape, values.dtype)
    threshold = values.abs().flatten().sort(descending=True).values[kept - 1]
    expected = torch.where(values.abs() >= threshold, values, torch.zeros_like(values))
    assert torch.equal(codec.decode([payload]), expected)


def test_topk_decode_of_many_is_the_mean():
    codec = TopK(fraction=0.2)
    tensors = [torch.randn(50, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    dense = []
    for tensor in tensors:
        threshold = tensor.abs().sort(descending=True).values[9]
        dense.append(torch.where(tensor.abs() >= threshold, tensor, torch.zeros_like(tensor)))
    torch.testing.assert_close(codec.decode([codec.encode(t) for t in tensors]), torch.stack(dense).mean(0))


def test_registry_builds_and_validates():
    assert {"topk", "quantize"} <= set(CODECS)
    assert build_codec({"name": "none"}) is None
    codec = build_codec({"name": "quantize", "bits": 4, "method": "linear", "range_sigmas": 3.0})
    assert isinstance(codec, Quantize) and codec.bits == 4 and codec.method == "linear"
    with pytest.raises(ValueError, match="compression.bits"):
        build_codec({"name": "quantize", "bits": 3})
    with pytest.raises(ValueError, match="compression.fraction"):
        build_codec({"name": "topk", "fraction": 0.0})


# -------------------------------------------------------------------------- error feedback
@pytest.mark.parametrize("codec", [TopK(fraction=0.05), Quantize(bits=2)], ids=["topk", "quantize"])
@pytest.mark.parametrize("beta", [1.0, 0.7])
def test_error_feedback_sent_plus_residual_is_the_input(codec, beta):
    # E_T = sum_t beta^(T-t) (x_t - sent_t), so discounted sums of sent and input differ by E_T.
    feedback = ErrorFeedback(codec, beta)
    generator = torch.Generator().manual_seed(7)
    accumulator = torch.zeros(8, 16, dtype=torch.float64)
    discounted_input = torch.zeros_like(accumulator)
    discounted_sent = torch.zeros_like(accumulator)
    for _ in range(60):
        update = torch.randn(8, 16, generator=generator, dtype=torch.float64)
        sent = codec.decode([feedback.compress(accumulator, update)])
        discounted_input = beta * discounted_input + update
        discounted_sent = beta * discounted_sent + sent
    torch.testing.assert_close(discounted_sent + accumulator, discounted_input, rtol=0, atol=1e-9)
    assert accumulator.abs().max() > 0  # the codec did drop something


def test_error_feedback_eventually_sends_what_was_dropped():
    # A constant input, one entry (of 40) sent per round: with error feedback the average sent
    # converges to the input; without it, the same single largest entry is sent forever.
    update = torch.linspace(0.1, 1.0, 40)
    codec = TopK(fraction=1 / 40)
    rounds = 2000
    for beta, expect_converged in ((1.0, True), (0.0, False)):
        feedback = ErrorFeedback(codec, beta)
        accumulator = torch.zeros(40)
        cumulative_sent = torch.zeros(40)
        for _ in range(rounds):
            cumulative_sent += codec.decode([feedback.compress(accumulator, update)])
        error = (cumulative_sent / rounds - update).abs().max()
        assert (error < 0.02) == expect_converged, (beta, error)
