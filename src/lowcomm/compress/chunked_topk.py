"""Chunked top-k with low-bit values: SparseLoCo's codec (Sarfi et al. 2025, arXiv 2508.15706).

A tensor is cut into blocks by DeMo's chunk rule (:class:`lowcomm.compress.dct.BlockLayout`:
``chunk x chunk`` for a matrix whose dimensions ``chunk`` divides, so at most 4,096 entries
for the default 64), with no transform: top-k runs on the entries themselves. Every block
keeps its ``k`` largest-magnitude entries, ``k = round(block_numel * topk / chunk**2)``
clamped to [1, block_numel] (so a block smaller than ``chunk x chunk`` keeps the same density).
The kept values of the whole tensor are quantized to ``bits`` bits against a sent table of
2**bits float32 per-bin means; ``bits=None`` sends them in the tensor's dtype. Two binnings,
both with nominal range mean +- r sigma (r = ``range_sigmas``):

- ``reference`` (the SparseLoCo / templar code): shift by the mean, step s = 2 r sigma / 2**bits
  (sigma with Bessel's correction), code = round(x / s + 2**(bits-1)) clamped to the codes, so
  bins are centred on multiples of s (for 2 bits: one bin for everything above s/2);
- ``symmetric``: MuLoCo's statistical quantizer (:class:`lowcomm.compress.quantize.Quantize`):
  2**bits equal bins with edges at mean - r sigma + j 2 r sigma / 2**bits.

Wire formats (``wire``), per tensor:

- ``paper``: what the reference implementation hands to ``all_gather``: int64 block-local
  indices (``torch.topk``'s) and one uint8 code per kept value (unpacked), plus the table.
- ``packed``: block-local indices in 12 bits (two indices in three bytes; a block has at most
  4,096 entries, so ``chunk`` must be <= 64) and the codes bit-packed, ``8 // bits`` to a byte,
  plus the table: 1.5 + bits/8 bytes per kept entry (1.75 for 2 bits; 2.5 for 8 bits, templar's
  production wire). These bytes are really packed: the payload tensors are the packed bytes.

``decode`` of one payload is that worker's sparse reconstruction. ``decode`` of several (an
all-gather's W payloads) gives each entry the **mean over the workers that sent it** (the
reference's ``scatter_reduce(reduce="mean", include_self=False)``); an entry nobody sent is 0.
SparseLoCo's Algorithm 1 instead averages over all W workers; the optimizer chooses (see
:mod:`lowcomm.optim.sparseloco`).
"""

from __future__ import annotations

import math

import torch

from lowcomm.compress.base import Payload
from lowcomm.compress.dct import BlockLayout
from lowcomm.compress.quantize import BITS, Quantize, pack_codes, unpack_codes
from lowcomm.compress.registry import register_codec

WIRES = ("paper", "packed")
BINNINGS = ("reference", "symmetric")
MAX_PACKED_CHUNK = 64  # 64 x 64 = 4,096 block entries: the most a 12-bit index can address


def pack_uint12(values: torch.Tensor) -> torch.Tensor:
    """Pack integers in [0, 4096) 12 bits each: entries 2i and 2i+1 share three bytes (low byte
    of the first; its high nibble below the second's low nibble; the second's high byte). An
    odd count is padded with one zero."""
    flat = values.reshape(-1).to(torch.int32)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 4096):
        raise ValueError("12-bit packing needs integers in [0, 4096)")
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    first, second = flat[0::2], flat[1::2]
    triples = torch.stack([first & 0xFF, (first >> 8) | ((second & 0x0F) << 4), second >> 4], dim=1)
    return triples.to(torch.uint8).reshape(-1)


def unpack_uint12(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint12`: the first ``count`` integers as int64."""
    triples = packed.reshape(-1, 3).to(torch.int64)
    first = triples[:, 0] | ((triples[:, 1] & 0x0F) << 8)
    second = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack([first, second], dim=1).reshape(-1)[:count]


@register_codec("chunked_topk")
class ChunkedTopK:
    """Per-block top-k (``topk`` of every ``chunk x chunk`` block) with ``bits``-bit values."""

    name = "chunked_topk"
    decodes_mean = True  # decode(W payloads): their mean (see Codec)

    def __init__(self, chunk: int = 64, topk: int = 64, bits: int | None = 2, wire: str = "packed",
                 range_sigmas: float = 3.0, binning: str = "reference"):
        if chunk < 1 or topk < 1:
            raise ValueError(f"chunk and topk must be >= 1, got {chunk} and {topk}")
        if topk > chunk * chunk:
            raise ValueError(f"topk must be at most chunk**2 = {chunk * chunk}, got {topk}")
        if bits is not None and bits not in BITS:
            raise ValueError(f"bits must be null or one of {', '.join(map(str, BITS))}, got {bits}")
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")
        if wire == "packed" and chunk > MAX_PACKED_CHUNK:
            raise ValueError(f"wire=packed sends 12-bit block indices, so chunk must be <= {MAX_PACKED_CHUNK}, "
                             f"got {chunk}")
        if binning not in BINNINGS:
            raise ValueError(f"binning must be one of {', '.join(BINNINGS)}, got {binning!r}")
        self.chunk, self.topk, self.bits, self.wire = chunk, topk, bits, wire
        self.range_sigmas, self.binning = range_sigmas, binning
        self.quantizer = Quantize(bits, "statistical", range_sigmas) if bits is not None else None

    def __repr__(self) -> str:
        return (f"ChunkedTopK(chunk={self.chunk}, topk={self.topk}, bits={self.bits}, wire={self.wire!r}, "
                f"binning={self.binning!r})")

    @property
    def density(self) -> float:
        """Kept fraction of a full ``chunk x chunk`` block."""
        return self.topk / self.chunk**2

    def layout(self, shape: torch.Size | tuple[int, ...]) -> BlockLayout:
        return BlockLayout.for_shape(tuple(shape), self.chunk)

    def kept_per_block(self, layout: BlockLayout) -> int:
        return min(layout.block_numel, max(1, round(layout.block_numel * self.topk / self.chunk**2)))

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes :meth:`encode` puts on the wire for a tensor of this shape and dtype."""
        layout = self.layout(shape)
        kept = layout.num_blocks * self.kept_per_block(layout)
        index_bytes = 3 * math.ceil(kept / 2) if self.wire == "packed" else 8 * kept
        if self.quantizer is None:
            return index_bytes + kept * dtype.itemsize
        code_bytes = math.ceil(kept * self.bits / 8) if self.wire == "packed" else kept
        return index_bytes + code_bytes + 4 * self.quantizer.num_bins

    @torch.no_grad()
    def encode(self, tensor: torch.Tensor) -> Payload:
        layout = self.layout(tensor.shape)
        blocks = layout.blocked(tensor.reshape(layout.rows, layout.cols)).reshape(layout.num_blocks, -1)
        indices = blocks.abs().topk(self.kept_per_block(layout), dim=1, sorted=False).indices
        values = blocks.gather(1, indices).reshape(-1)
        if self.wire == "packed":
            tensors = {"indices": pack_uint12(indices)}
        else:
            tensors = {"indices": indices}
        if self.quantizer is None:
            tensors["values"] = values
        else:
            if self.binning == "reference":
                codes, table = self._quantize_reference(values)
                if self.wire == "packed":
                    codes = pack_codes(codes, self.bits)
            else:
                quantized = self.quantizer.encode(values)
                codes, table = quantized.tensors["codes"], quantized.tensors["table"]
                if self.wire == "paper":
                    codes = unpack_codes(codes, self.bits, values.numel())
            tensors.update(codes=codes, table=table)
        return Payload(tensors=tensors, meta={"shape": tensor.shape, "dtype": tensor.dtype, "layout": layout})

    def _quantize_reference(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(one uint8 code per value, table of per-bin means) with the reference's binning; the
        mean shift is folded into the table, so decoding is a lookup."""
        values = values.float()
        bins = 2**self.bits
        shift = values.mean()
        centred = values - shift
        sigma = (centred.norm() / math.sqrt(centred.numel() - 1) if centred.numel() > 1
                 else torch.zeros((), device=values.device))
        step = 2 * self.range_sigmas * sigma / bins
        # a constant (or single) value has no spread: every value lands in the middle bin
        step = torch.where(step > 0, step, torch.ones_like(step))
        codes = (centred / step + bins // 2).round_().clamp_(0, bins - 1).to(torch.uint8)
        sums = torch.zeros(bins, device=values.device).index_add_(0, codes.long(), centred)
        counts = torch.bincount(codes.long(), minlength=bins).clamp_(min=1)
        return codes, sums / counts + shift

    def _sparse(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, values in the tensor's dtype) of one payload's kept entries."""
        layout: BlockLayout = payload.meta["layout"]
        kept = layout.num_blocks * self.kept_per_block(layout)
        if self.wire == "packed":
            block_index = unpack_uint12(payload.tensors["indices"], kept)
        else:
            block_index = payload.tensors["indices"].reshape(-1).long()
        positions = layout.global_index(block_index.view(layout.num_blocks, -1)).reshape(-1)
        if self.quantizer is None:
            values = payload.tensors["values"].reshape(-1)
        else:
            codes = payload.tensors["codes"]
            codes = unpack_codes(codes, self.bits, kept) if self.wire == "packed" else codes.reshape(-1)
            values = payload.tensors["table"][codes.long()]
        return positions, values.to(payload.meta["dtype"])

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        meta = payloads[0].meta
        numel = meta["shape"].numel()
        device = next(iter(payloads[0].tensors.values())).device
        dense = torch.zeros(numel, dtype=meta["dtype"], device=device)
        senders = torch.zeros(numel, dtype=meta["dtype"], device=device) if len(payloads) > 1 else None
        for payload in payloads:
            positions, values = self._sparse(payload)
            # positions are unique within one payload, so each index_add_ is deterministic
            dense.index_add_(0, positions, values)
            if senders is not None:
                senders.index_add_(0, positions, torch.ones_like(values))
        if senders is not None:
            dense.div_(senders.clamp_(min=1))
        return dense.view(meta["shape"])
