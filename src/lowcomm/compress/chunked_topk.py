"""Chunked top-k with low-bit values: SparseLoCo's codec (Sarfi et al. 2025, arXiv 2508.15706).

A tensor is cut into blocks by DeMo's chunk rule (:class:`lowcomm.compress.dct.BlockLayout`:
``chunk x chunk`` for a matrix whose dimensions ``chunk`` divides, so at most 4,096 entries
for the default 64), with no transform: top-k runs on the entries themselves. Every block
keeps its ``k`` largest-magnitude entries, ``k = round(block_numel * topk / chunk**2)``
clamped to [1, block_numel] (so a block smaller than ``chunk x chunk`` keeps the same density).
The kept values of the whole tensor are quantized to ``bits`` bits by the reference's
statistical quantizer (:func:`lowcomm.compress.quantize.statistical_codes`, the one MuLoCo's
codec uses too: shift by the mean, step 2 r sigma / 2**bits with r = ``range_sigmas``, codes
centred on multiples of the step, decoded with a sent table of 2**bits float32 per-bin means);
``bits=None`` sends them in the tensor's dtype.

Wire formats (``wire``), per tensor, each named after who sends it:

- ``reference``: the tensors the SparseLoCo reference code hands to ``all_gather``: int64
  block-local indices (``torch.topk``'s) and one uint8 per code, plus the table: 9 bytes per
  kept entry. (Not the paper's accounting: that is the wire of a real deployment, below.)
- ``templar``: templar's production wire: block-local indices in 12 bits (two indices in three
  bytes) and one uint8 per code (its 2-bit codes are not bit-packed), plus the table: 2.5 bytes
  per kept entry.
- ``packed``: 12-bit indices and the codes bit-packed, ``8 // bits`` to a byte, plus the table:
  1.5 + bits/8 bytes per kept entry (1.75 for 2 bits).

A 12-bit index addresses at most 4,096 block entries, so ``templar`` and ``packed`` need
``chunk`` <= 64. These bytes are really packed: the payload tensors are the packed bytes.

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
from lowcomm.compress.block_topk import block_topk
from lowcomm.compress.dct import BlockLayout
from lowcomm.compress.dct_topk import ordered_index_add_
from lowcomm.compress.quantize import BITS, pack_codes, statistical_codes, unpack_codes
from lowcomm.compress.registry import register_codec

WIRES = ("reference", "templar", "packed")
TWELVE_BIT_WIRES = ("templar", "packed")  # block indices packed 12 bits each
MAX_PACKED_CHUNK = 64  # 64 x 64 = 4,096 block entries: the most a 12-bit index can address


def pack_uint12(values: torch.Tensor, *, checked: bool = True) -> torch.Tensor:
    """Pack integers in [0, 4096) 12 bits each: entries 2i and 2i+1 share three bytes (low byte
    of the first; its high nibble below the second's low nibble; the second's high byte). An
    odd count is padded with one zero. ``checked=False`` skips the range check, for a caller
    whose values are in range by construction: reading their minimum and maximum back makes the
    host wait for the device (on a GPU, twice per tensor)."""
    flat = values.reshape(-1).to(torch.int32)
    if checked and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 4096):
        raise ValueError("12-bit packing needs integers in [0, 4096)")
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    first, second = flat[0::2], flat[1::2]
    triples = torch.stack([first & 0xFF, (first >> 8) | ((second & 0x0F) << 4), second >> 4], dim=1)
    return triples.to(torch.uint8).reshape(-1)


def unpack_uint12(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint12`: the first ``count`` integers as int64; of each row, for
    packed bytes with a leading dimension (several workers' payloads, stacked)."""
    lead = packed.shape[:-1] if packed.dim() > 1 else ()
    triples = packed.reshape(*lead, -1, 3).to(torch.int64)
    first = triples[..., 0] | ((triples[..., 1] & 0x0F) << 8)
    second = (triples[..., 1] >> 4) | (triples[..., 2] << 4)
    return torch.stack([first, second], dim=-1).reshape(*lead, -1)[..., :count]


@register_codec("chunked_topk")
class ChunkedTopK:
    """Per-block top-k (``topk`` of every ``chunk x chunk`` block) with ``bits``-bit values."""

    name = "chunked_topk"
    decodes_mean = True  # decode(W payloads): their mean (see Codec)
    reducible = False  # supports differ per worker: all-gathered

    def __init__(self, chunk: int = 64, topk: int = 64, bits: int | None = 2, wire: str = "packed",
                 range_sigmas: float = 3.0):
        if chunk < 1 or topk < 1:
            raise ValueError(f"chunk and topk must be >= 1, got {chunk} and {topk}")
        if topk > chunk * chunk:
            raise ValueError(f"topk must be at most chunk**2 = {chunk * chunk}, got {topk}")
        if bits is not None and bits not in BITS:
            raise ValueError(f"bits must be null or one of {', '.join(map(str, BITS))}, got {bits}")
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")
        if wire in TWELVE_BIT_WIRES and chunk > MAX_PACKED_CHUNK:
            raise ValueError(f"wire={wire} sends 12-bit block indices, so chunk must be <= {MAX_PACKED_CHUNK}, "
                             f"got {chunk}")
        if not range_sigmas > 0:
            raise ValueError(f"range_sigmas must be > 0, got {range_sigmas}")
        self.chunk, self.topk, self.bits, self.wire = chunk, topk, bits, wire
        self.range_sigmas = range_sigmas

    def __repr__(self) -> str:
        return (f"ChunkedTopK(chunk={self.chunk}, topk={self.topk}, bits={self.bits}, wire={self.wire!r}, "
                f"range_sigmas={self.range_sigmas})")

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
        index_bytes = 3 * math.ceil(kept / 2) if self.wire in TWELVE_BIT_WIRES else 8 * kept
        if self.bits is None:
            return index_bytes + kept * dtype.itemsize
        code_bytes = math.ceil(kept * self.bits / 8) if self.wire == "packed" else kept
        return index_bytes + code_bytes + 4 * 2**self.bits

    @torch.no_grad()
    def encode(self, tensor: torch.Tensor) -> Payload:
        layout = self.layout(tensor.shape)
        indices, _, values = block_topk(tensor.reshape(layout.rows, layout.cols), layout, self.kept_per_block(layout))
        values = values.view(-1)
        if self.wire in TWELVE_BIT_WIRES:
            # block-local indices of blocks of at most 64 x 64 (the chunk <= 64 these wires need)
            tensors = {"indices": pack_uint12(indices, checked=False)}
        else:
            tensors = {"indices": indices}
        if self.bits is None:
            tensors["values"] = values
        else:
            codes, table = statistical_codes(values, self.bits, self.range_sigmas)
            tensors.update(codes=pack_codes(codes, self.bits) if self.wire == "packed" else codes, table=table)
        return Payload(tensors=tensors, meta={"shape": tensor.shape, "dtype": tensor.dtype, "layout": layout})

    def _sparse(self, payload: Payload, workers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, values in the tensor's dtype) of one payload's kept entries; with
        ``workers``, of that many workers' payloads stacked (each tensor with a leading
        dimension W, as :func:`~lowcomm.optim.diloco.all_gather_stacked` leaves them):
        ``(W, kept)`` each."""
        layout: BlockLayout = payload.meta["layout"]
        kept = layout.num_blocks * self.kept_per_block(layout)
        lead = () if workers is None else (workers,)
        if self.wire in TWELVE_BIT_WIRES:
            block_index = unpack_uint12(payload.tensors["indices"].reshape(*lead, -1), kept)
        else:
            block_index = payload.tensors["indices"].reshape(*lead, -1).long()
        positions = layout.global_index(block_index.view(*lead, layout.num_blocks, -1)).reshape(*lead, -1)
        if self.bits is None:
            values = payload.tensors["values"].reshape(*lead, -1)
        else:
            codes = payload.tensors["codes"].reshape(*lead, -1)
            codes = unpack_codes(codes, self.bits, kept) if self.wire == "packed" else codes
            values = torch.gather(payload.tensors["table"], -1, codes.long())
        return positions, values.to(payload.meta["dtype"])

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        """Each entry's mean over the payloads that carry it (one payload: its values):
        :meth:`decode_gathered` of the payloads stacked (one is a view, not a copy)."""
        tensors = {key: (payloads[0].tensors[key].unsqueeze(0) if len(payloads) == 1 else
                         torch.stack([payload.tensors[key] for payload in payloads]))
                   for key in payloads[0].tensors}
        return self.decode_gathered(Payload(tensors, payloads[0].meta))

    def decode_gathered(self, gathered: Payload) -> torch.Tensor:
        """:meth:`decode` of the W workers' payloads an all-gather left stacked (each tensor with
        a leading dimension W): unpacked, positioned and added in one pass for all W, not one
        per worker. Each entry's sum runs in worker order, as in :meth:`decode`, so the result
        is the same bit for bit."""
        meta, layout = gathered.meta, gathered.meta["layout"]
        workers = next(iter(gathered.tensors.values())).shape[0]
        positions, values = self._sparse(gathered, workers)
        dense = torch.zeros(meta["shape"].numel(), dtype=meta["dtype"], device=values.device)
        if workers > 1 and dense.device.type == "cpu":
            # block by block, each block's entries in worker order (one index_add_ runs in index
            # order on the CPU): every entry's sum still runs in worker order, and the dense
            # tensor is swept once, each block's rows in cache, instead of once per worker (at
            # OLMo-300M's shapes and W = 8, eight passes over 250 MB of random writes)
            positions = positions.view(workers, layout.num_blocks, -1).transpose(0, 1).reshape(-1)
            values = values.view(workers, layout.num_blocks, -1).transpose(0, 1).reshape(-1)
            dense.index_add_(0, positions, values)
        else:
            ordered_index_add_(dense, positions, values)
        if workers > 1:
            senders = torch.zeros_like(dense).index_add_(0, positions.view(-1), torch.ones_like(values).view(-1))
            dense.div_(senders.clamp_(min=1))
        return dense.view(meta["shape"])
