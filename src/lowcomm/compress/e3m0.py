"""4-bit floating point with no mantissa (E3M0): Streaming DiLoCo's outer-gradient wire
(Douillard et al. 2025, arXiv 2501.18512, "4 bits ... E3M0"; the reduction is done in fp32).

Each entry becomes one sign bit and a 3-bit exponent code e relative to its row's scale
s = max |x| over the row (one float32 per row: a matrix's rows are its first dimension, a
vector is one row): e = 0 means 0, and e in 1..7 means sign * s * 2**(e - 7), i.e. magnitudes
s/64, s/32, ..., s/2, s. An entry is rounded to the nearest of those magnitudes (or to 0 below
s/128), deterministically, so the relative error of a kept magnitude is at most 1/3.

Why per row: the format's dynamic range is 2**6, so one scale for a whole heavy-tailed tensor
(a 51M-entry embedding whose rows differ by orders of magnitude) flushes most of its entries to
zero; torchft's quantized collectives scale per row for the same reason
(``benchmarks/e3m0_flush.py`` measures the flushed fraction on OLMo's shapes both ways).
``rowwise=False`` keeps the one per-tensor scale, for that comparison.

Codes are packed two to a byte (:func:`lowcomm.compress.quantize.pack_codes`):
ceil(numel / 2) + 4 x rows bytes per tensor. ``decode`` of several payloads is the mean of their
dequantized tensors, accumulated in float32.
"""

from __future__ import annotations

import math

import torch

from lowcomm.compress.base import Payload, mean_of_dequantized
from lowcomm.compress.quantize import pack_codes, unpack_codes
from lowcomm.compress.registry import register_codec

EXPONENTS = 7  # nonzero exponent codes 1..7


def scale_rows(shape: torch.Size | tuple[int, ...], rowwise: bool = True) -> int:
    """How many scales E3M0 sends for a tensor of ``shape``: one per row of a matrix (the first
    dimension), one for a vector, a scalar or a per-tensor scale."""
    shape = tuple(shape)
    return shape[0] if rowwise and len(shape) >= 2 else 1


@register_codec("e3m0")
class E3M0:
    name = "e3m0"
    decodes_mean = True  # decode(W payloads): their mean (see Codec)
    reducible = True  # every entry encoded: the quantized all-reduce applies
    bits = 4

    def __init__(self, rowwise: bool = True):
        self.rowwise = rowwise

    def __repr__(self) -> str:
        return f"E3M0(rowwise={self.rowwise})"

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:  # noqa: ARG002
        return math.ceil(torch.Size(shape).numel() / 2) + 4 * scale_rows(shape, self.rowwise)

    @torch.no_grad()
    def encode(self, tensor: torch.Tensor) -> Payload:
        return self._encode(tensor.reshape(scale_rows(tensor.shape, self.rowwise), -1), tensor)

    @torch.no_grad()
    def encode_stacked(self, chunks: torch.Tensor) -> Payload:
        """k tensors of one shape (their stack ``(k, *shape)``) encoded in one pass, each as
        :meth:`encode` encodes it: a payload whose tensors carry a leading dimension k."""
        rows = scale_rows(chunks.shape[1:], self.rowwise)
        return self._encode(chunks.reshape(chunks.shape[0], rows, -1), chunks[0])

    def _encode(self, values: torch.Tensor, like: torch.Tensor) -> Payload:
        """``values``: ``(..., rows, columns)``, one scale per row."""
        values = values.float()
        if values.numel():
            scale = values.abs().amax(dim=-1, keepdim=True)
        else:
            scale = values.new_zeros(*values.shape[:-1], 1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        magnitude = values.abs() / safe  # in [0, 1]
        # nearest power of two 2**j (j in -6..0) in linear distance: 2**floor(log2 m) or twice it,
        # whichever is closer (the boundary between 2**j and 2**(j+1) is 1.5 * 2**j)
        low = torch.floor(torch.log2(magnitude.clamp(min=2.0**-30)))
        exponent = torch.where(magnitude >= 1.5 * torch.exp2(low), low + 1, low).clamp_(max=0)
        code = (exponent + EXPONENTS).clamp_(min=1)
        code = torch.where(magnitude < 2.0 ** -(EXPONENTS), torch.zeros_like(code), code)
        sign = (values < 0).to(torch.uint8) << 3
        codes = (code.to(torch.uint8) | sign).flatten(-2)
        return Payload(tensors={"codes": pack_codes(codes, 4), "scale": scale.flatten(-2).float()},
                       meta={"shape": like.shape, "dtype": like.dtype})

    def dequantize(self, payload: Payload) -> torch.Tensor:
        """The payload's values in float32, flat; ``(W, numel)`` for W workers' payloads of one
        shape stacked (tensors with a leading dimension), in one pass."""
        scale = payload.tensors["scale"]
        codes = unpack_codes(payload.tensors["codes"], 4, payload.meta["shape"].numel()).long()
        lead = scale.shape[:-1]
        codes = codes.view(*lead, scale.shape[-1], -1)
        exponent = codes & 0b111
        sign = 1.0 - 2.0 * (codes >> 3).float()
        value = torch.exp2(exponent.float() - EXPONENTS) * scale.unsqueeze(-1)
        return torch.where(exponent > 0, sign * value, torch.zeros_like(value)).reshape(*lead, -1)

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        return mean_of_dequantized(payloads, self.dequantize)
