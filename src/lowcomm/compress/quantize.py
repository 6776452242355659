"""b-bit quantisation (b in 2, 4, 8) with the codes bit-packed into bytes.

Two schemes, as in MuLoCo (Thérien et al. 2025), each with statistics over the tensor it is
given: a whole tensor, or one rank's chunk of it in the quantized all-reduce
(:mod:`lowcomm.comm.quantized`, the default exchange of DiLoCo and MuLoCo):

``statistical``
    The reference code's quantizer (facebookresearch/MuLoCo, ``QuantizationCompressor._quantize``
    in torchtitan/components/quantized_outer_sgd.py; the same in SparseLoCo's code): shift by the
    tensor's mean, step s = 2 r sigma / 2**b (r = ``range_sigmas``, 3 by default, so s = 6 sigma / 4
    for 2 bits; sigma with Bessel's correction), code = round(x_centred / s + 2**(b-1)) clamped
    to [0, 2**b - 1]. Bins are centred on multiples of s around the mean: for 2 bits the codes
    mean "below -1.5 s", "about -s", "about 0", "above +0.5 s" (round half to even), so about 55 %
    of a Gaussian's entries land in the middle bin. Decoding looks up a sent table of 2**b
    float32 values, the mean of the entries that fell in each bin (the shift folded in: the
    reference sends the shift beside a table of centred means; the sum is the same float).
    :func:`statistical_codes` is that function; SparseLoCo's codec quantizes its kept values
    with it too.

``linear``
    Min-max: codes round((x - min) / scale) with scale = (max - min) / (2**b - 1); send min
    and scale (two float32). Error at most scale / 2.

Wire format, per tensor: ``codes`` (uint8, ceil(numel * b / 8) bytes; code j of a byte sits
at bits [j*b, (j+1)*b)) and ``table`` (2**b float32) or ``range`` ([min, scale], float32).
"""

from __future__ import annotations

import math

import torch

from lowcomm.compress.base import Payload, mean_of_dequantized
from lowcomm.compress.registry import register_codec

BITS = (2, 4, 8)
METHODS = ("statistical", "linear")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of ``bits``-bit codes, 8 // bits codes per byte (zero-padded);
    of each row, for codes with leading dimensions (each row padded on its own, so row i's
    bytes are what packing row i alone gives)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    padded = torch.nn.functional.pad(codes, (0, -codes.shape[-1] % per_byte))
    groups = padded.view(*codes.shape[:-1], -1, per_byte)
    packed = groups[..., 0].clone()
    for slot in range(1, per_byte):
        packed.bitwise_or_(groups[..., slot] << (slot * bits))
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as a flat uint8 tensor; of each
    row, for packed codes with leading dimensions (several workers' payloads, stacked)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[..., :numel]
    mask = (1 << bits) - 1
    slots = [(packed >> (slot * bits)) & mask for slot in range(per_byte)]
    return torch.stack(slots, dim=-1).flatten(-2)[..., :numel]


def statistical_codes(values: torch.Tensor, bits: int, range_sigmas: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's statistical quantizer (see the module doc) on a tensor read flat: (one
    uint8 code per entry, unpacked; the table of 2**bits float32 per-bin means, shift included).
    Computed in float32 in the reference's order of operations, so codes and table equal its.
    A 2-D ``values`` ``(k, n)`` is k tensors, each quantized with its own statistics, in one
    pass: codes ``(k, n)``, tables ``(k, 2**bits)``. Row i is what row i alone gives, except
    that a row's mean and variance are reduced on one thread, where torch splits a flat
    reduction of 32K+ entries across threads: the last bits of the statistics may differ."""
    rows = values.shape[:-1] if values.dim() == 2 else ()
    values = values.reshape(*rows, -1).float()
    bins, count = 2**bits, values.shape[-1]
    shift = values.mean(dim=-1, keepdim=True) if count else values.new_zeros(*rows, 1)
    centred = values - shift
    sigma = centred.var(dim=-1, correction=1, keepdim=True).sqrt() if count > 1 else centred.new_zeros(*rows, 1)
    step = (2 * range_sigmas) * sigma / bins
    # no spread (a constant or a single value): every entry lands in the middle bin, exactly
    step = torch.where((step > 0) & step.isfinite(), step, torch.ones_like(step))
    codes = (centred / step + bins // 2).round_().clamp_(0, bins - 1).to(torch.uint8)
    # per-bin sums and counts as bincount makes them (the same adds in the same order on the
    # CPU), without its wait for the device on a GPU, where it reads the largest code back;
    # row i's bins at i * bins, so one index_add_ serves every row
    where = codes.long()
    if rows:
        where = where + torch.arange(0, rows[0] * bins, bins, device=where.device).unsqueeze(1)
    sums = centred.new_zeros(*rows, bins).view(-1).index_add_(0, where.view(-1), centred.reshape(-1))
    counts = torch.zeros(sums.numel(), dtype=torch.long, device=where.device).index_add_(
        0, where.view(-1), torch.ones_like(where).view(-1))
    return codes, (sums / counts.float().clamp_(min=1)).view(*rows, bins) + shift


@register_codec("quantize")
class Quantize:
    """``bits``-bit quantisation of the tensor it is given, ``method`` ``statistical`` or ``linear``.

    ``decode`` of several payloads returns the mean of their dequantised tensors.
    """

    name = "quantize"
    decodes_mean = True  # decode(W payloads): their mean (see Codec)
    reducible = True  # every entry encoded: the quantized all-reduce applies

    def __init__(self, bits: int = 2, method: str = "statistical", range_sigmas: float = 3.0):
        if bits not in BITS:
            raise ValueError(f"compression.bits must be one of {', '.join(map(str, BITS))}, got {bits}")
        if method not in METHODS:
            raise ValueError(f"compression.method must be one of {', '.join(METHODS)}, got {method!r}")
        if not range_sigmas > 0:
            raise ValueError(f"compression.range_sigmas must be > 0, got {range_sigmas}")
        self.bits = bits
        self.method = method
        self.range_sigmas = range_sigmas
        self.num_bins = 2**bits

    def __repr__(self) -> str:
        return f"Quantize(bits={self.bits}, method={self.method!r}, range_sigmas={self.range_sigmas})"

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:  # noqa: ARG002
        """Bytes :meth:`encode` puts on the wire for a tensor of this shape (any dtype)."""
        code_bytes = math.ceil(torch.Size(shape).numel() * self.bits / 8)
        side_floats = self.num_bins if self.method == "statistical" else 2
        return code_bytes + 4 * side_floats

    def encode(self, tensor: torch.Tensor) -> Payload:
        return self._encode(tensor.reshape(-1), tensor)

    def encode_stacked(self, chunks: torch.Tensor) -> Payload:
        """k tensors of one shape (``chunks``, their stack ``(k, *shape)``), each encoded with its
        own statistics as :meth:`encode` would, in one pass: a payload whose tensors carry a
        leading dimension k (row i: :meth:`encode` of ``chunks[i]``; with the statistical
        method, up to the last bits of a large row's statistics, see :func:`statistical_codes`)."""
        return self._encode(chunks.reshape(chunks.shape[0], -1), chunks[0])

    def _encode(self, values: torch.Tensor, like: torch.Tensor) -> Payload:
        values = values.float()
        if self.method == "statistical":
            codes, side = statistical_codes(values, self.bits, self.range_sigmas)
            side_key = "table"
        else:
            low, high = values.amin(dim=-1, keepdim=True), values.amax(dim=-1, keepdim=True)
            scale = (high - low) / (self.num_bins - 1)
            safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = ((values - low) / safe_scale).round_().clamp_(0, self.num_bins - 1).to(torch.uint8)
            side, side_key = torch.cat([low, scale], dim=-1), "range"
        return Payload(
            tensors={"codes": pack_codes(codes, self.bits), side_key: side},
            meta={"shape": like.shape, "dtype": like.dtype},
        )

    def dequantize(self, payload: Payload) -> torch.Tensor:
        """The payload's values in float32, flat; for a payload whose tensors carry leading
        dimensions (W workers' payloads of one shape, stacked), ``(W, numel)``: one pass for all."""
        numel = payload.meta["shape"].numel()
        codes = unpack_codes(payload.tensors["codes"], self.bits, numel).long()
        if self.method == "statistical":
            return torch.gather(payload.tensors["table"], -1, codes)
        side = payload.tensors["range"]
        return side[..., 0:1] + codes.float() * side[..., 1:2]

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        return mean_of_dequantized(payloads, self.dequantize)
