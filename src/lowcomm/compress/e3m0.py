"""4-bit floating point with no mantissa (E3M0): Streaming DiLoCo's outer-gradient wire
(Douillard et al. 2025, arXiv 2501.18512, "4 bits ... E3M0"; the reduction is done in fp32).

Each entry becomes one sign bit and a 3-bit exponent code e relative to a per-tensor scale
s = max |x| (sent as one float32): e = 0 means 0, and e in 1..7 means sign * s * 2**(e - 7), i.e.
magnitudes s/64, s/32, ..., s/2, s. An entry is rounded to the nearest of those magnitudes (or
to 0 below s/128), deterministically, so the relative error of a kept magnitude is at most 1/3.
Codes are packed two to a byte (:func:`lowcomm.compress.quantize.pack_codes`): numel / 2 + 4
bytes per tensor. ``decode`` of several payloads is the mean of their dequantized tensors,
accumulated in float32.
"""

from __future__ import annotations

import math

import torch

from lowcomm.compress.base import Payload, mean_of_dequantized
from lowcomm.compress.quantize import pack_codes, unpack_codes
from lowcomm.compress.registry import register_codec

EXPONENTS = 7  # nonzero exponent codes 1..7


@register_codec("e3m0")
class E3M0:
    name = "e3m0"
    decodes_mean = True  # decode(W payloads): their mean (see Codec)
    bits = 4

    def __repr__(self) -> str:
        return "E3M0()"

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:  # noqa: ARG002
        return math.ceil(torch.Size(shape).numel() / 2) + 4

    @torch.no_grad()
    def encode(self, tensor: torch.Tensor) -> Payload:
        values = tensor.reshape(-1).float()
        scale = values.abs().max() if values.numel() else torch.zeros((), device=values.device)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        magnitude = values.abs() / safe  # in [0, 1]
        # nearest power of two 2**j (j in -6..0) in linear distance: 2**floor(log2 m) or twice it,
        # whichever is closer (the boundary between 2**j and 2**(j+1) is 1.5 * 2**j)
        low = torch.floor(torch.log2(magnitude.clamp(min=2.0**-30)))
        exponent = torch.where(magnitude >= 1.5 * torch.exp2(low), low + 1, low).clamp_(max=0)
        code = (exponent + EXPONENTS).clamp_(min=1)
        code = torch.where(magnitude < 2.0 ** -(EXPONENTS), torch.zeros_like(code), code)
        sign = (values < 0).to(torch.uint8) << 3
        codes = code.to(torch.uint8) | sign
        return Payload(tensors={"codes": pack_codes(codes, 4), "scale": scale.reshape(1).float()},
                       meta={"shape": tensor.shape, "dtype": tensor.dtype})

    def _dequantize(self, payload: Payload) -> torch.Tensor:
        codes = unpack_codes(payload.tensors["codes"], 4, payload.meta["shape"].numel()).long()
        exponent = codes & 0b111
        sign = 1.0 - 2.0 * (codes >> 3).float()
        value = torch.exp2(exponent.float() - EXPONENTS) * payload.tensors["scale"]
        return torch.where(exponent > 0, sign * value, torch.zeros_like(value))

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        return mean_of_dequantized(payloads, self._dequantize)
