"""DCT top-k: DeMo's codec. Cut a tensor into blocks (chunk rule of :mod:`lowcomm.compress.dct`),
DCT-II each block, keep the k largest-magnitude coefficients of every block.

Wire formats (``wire``), per block of k kept coefficients:

- ``paper``: int64 block-local indices (what ``torch.topk`` returns) and values in the
  tensor's dtype: 12 bytes per coefficient for fp32, as the DeMo reference sends.
- ``compact``: 16-bit indices (a block has at most 256 x 256 = 65536 coefficients) and bf16
  values: 4 bytes per coefficient.
- ``sign``: 16-bit indices, one bit per coefficient for its sign (packed 8 to a byte over the
  whole tensor) and one bf16 scale per block, the mean |value| of the block's kept
  coefficients. Given the signs, that scale is the least-squares choice (it minimises
  sum_i (|v_i| - s)^2) and it keeps the block's L1 mass: 2 + 1/8 bytes per coefficient plus
  2 per block.
- ``signbit``: DisTrO's wire as Psyche sends it with ``quantize_1bit`` (PsycheFoundation/psyche,
  ``shared/modeling/src/distro.rs``): block-local indices in the narrowest of 8, 16 or 32 bits
  that holds the block (at most 256, 65536 or 2^32 coefficients: one byte each for a 16 x 16
  block, two for 64 x 64) and one sign bit per coefficient, packed 8 to a byte over the whole
  tensor, with no scale: a receiver decodes +1 or -1 (Psyche's ``signbit``, so a zero is +1).
  The values carry a direction only, so a sender removes from its momentum what it selected,
  not what receivers decode (:attr:`DCTTopK.decodes_magnitudes`).

16-bit indices travel as two uint8 bytes (low, high): neither gloo nor NCCL has an int16 type,
and bytes need no endianness agreement. The bytes the meter counts are the bytes in the
payload, whatever their dtype.

``decode`` of several payloads (the W payloads of an all-gather) gives each coefficient the
**mean over the workers that sent it** (DeMo's ``scatter_reduce(reduce="mean",
include_self=False)``), not the sum divided by W; a coefficient nobody sent is zero. Workers
are summed in payload order, one ``index_add_`` each (indices are unique within a payload), so
the result is deterministic and identical on every worker, on CUDA too.
"""

from __future__ import annotations

import functools
import math

import torch

from lowcomm.compress import cpu_kernels
from lowcomm.compress.base import Payload
from lowcomm.compress.block_topk import block_topk, kernel_group_rows, selection_kernels
from lowcomm.compress.dct import BlockLayout, dct_bases, dct_kernels, dct_transform, mark_written
from lowcomm.compress.registry import register_codec

WIRES = ("paper", "compact", "sign", "signbit")
_MAX_16BIT_BLOCK = 1 << 16
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def topk_block_errors(chunk: int, topk: int, topk_key: str, chunk_key: str) -> list[str]:
    """A top-k that is not smaller than the block (chunk x chunk coefficients) compresses
    nothing: the codec would clamp it and send the whole block in the paper's 12 bytes per
    coefficient, three times a dense fp32 gradient. A config asking for it is an error (the
    codec itself clamps, for tensors smaller than the target block)."""
    if topk >= chunk * chunk:
        return [f"{topk_key}={topk} is not smaller than the {chunk} x {chunk} block ({chunk_key}={chunk}: "
                f"{chunk * chunk} coefficients): it would send every coefficient; choose "
                f"{topk_key} < {chunk * chunk}"]
    return []


def index_width(block_numel: int) -> int:
    """Bytes of a block-local index under ``signbit``: the narrowest of 1, 2 or 4 that holds
    ``block_numel`` positions (Psyche's ``compress_idx``: uint8 up to 256, uint16 up to 65536)."""
    return next(width for width in (1, 2, 4) if block_numel <= 1 << (8 * width))


def _to_bytes(index: torch.Tensor, width: int) -> torch.Tensor:
    """Indices -> uint8 (..., k, width), least significant byte first (no endianness to agree on)."""
    return torch.stack([(index >> (8 * byte)) & 0xFF for byte in range(width)], dim=-1).to(torch.uint8)


def _from_bytes(packed: torch.Tensor) -> torch.Tensor:
    wide = packed.to(torch.int64)
    index = wide[..., 0]
    for byte in range(1, packed.shape[-1]):
        index = index | (wide[..., byte] << (8 * byte))
    return index


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A bool tensor -> uint8 (ceil(n / 8),), bit j of byte i = ``bits.flatten()[8 i + j]``."""
    flat = bits.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    return (flat.view(-1, 8) * _bit_weights(bits.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of each row of ``packed`` (..., bytes) -> bool (..., count)."""
    return (packed.unsqueeze(-1) & _bit_weights(packed.device)).ne(0).flatten(-2)[..., :count]


@functools.cache  # never evicted: a captured step reads it by address
def _bit_weights(device: torch.device) -> torch.Tensor:
    """Each bit's value in a byte, on ``device``: made once (a copy from the host inside a
    captured CUDA graph is not allowed). Read-only."""
    return torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)


def ordered_index_add_(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``target[positions[w, i]] += values[w, i]`` for the rows w in order, the positions of one
    row distinct (one worker's payload): a position's sum is rounded the same way on every
    worker, as adding the workers' payloads one after another. On the CPU one ``index_add_`` of
    the rows end to end runs in index order. On CUDA ``index_add_`` adds atomically, in an order
    that varies from run to run where a position repeats; within one row none does (each
    position gets one addition), so one ``index_add_`` per row is deterministic, and sorts
    nothing, as the accumulating ``index_put_`` would."""
    if target.device.type == "cpu":
        return target.index_add_(0, positions.reshape(-1), values.reshape(-1))
    return rowwise_index_add_(target, positions, values)


def rowwise_index_add_(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """:func:`ordered_index_add_`'s CUDA path (any device): one ``index_add_`` per row."""
    rows = positions.shape[0]
    for where, added in zip(positions.reshape(rows, -1), values.reshape(rows, -1), strict=True):
        target.index_add_(0, where, added)
    return target


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (W x blocks x k) as it is where each worker's row is contiguous, else a copy."""
    rows_ok = (tensor.shape[2] < 2 or tensor.stride(2) == 1) and (tensor.shape[1] < 2 or
                                                                   tensor.stride(1) == tensor.shape[2])
    return tensor if rows_ok else tensor.contiguous()


@register_codec("dct_topk")
class DCTTopK:
    """Per-block DCT top-k with an explicit wire format (see the module doc).

    Besides the :class:`~lowcomm.compress.base.Codec` protocol (``encode`` / ``decode`` of
    whole tensors in the DCT basis), it exposes the coefficient-domain steps so an optimizer
    can choose its own basis or keep its state in the transformed domain (DeMo does both):
    :meth:`select`, :meth:`pack`, :meth:`unpack`, :meth:`aggregate`.
    """

    name = "dct_topk"
    decodes_mean = True  # decode(W payloads): their mean (see Codec)
    reducible = False  # supports differ per worker: all-gathered

    def __init__(self, chunk: int = 64, topk: int = 32, wire: str = "paper"):
        if chunk < 1:
            raise ValueError(f"compression.chunk must be >= 1, got {chunk}")
        if topk < 1:
            raise ValueError(f"compression.topk must be >= 1, got {topk}")
        if wire not in WIRES:
            raise ValueError(f"compression.wire must be one of {', '.join(WIRES)}, got {wire!r}")
        if wire in ("compact", "sign") and chunk * chunk > _MAX_16BIT_BLOCK:
            raise ValueError(
                f"compression.wire={wire!r} sends 16-bit indices, so blocks must have at most "
                f"{_MAX_16BIT_BLOCK} coefficients (chunk <= 256); got chunk={chunk}"
            )
        self.chunk = chunk
        self.topk = topk
        self.wire = wire
        self._layouts: dict[tuple[int, ...], BlockLayout] = {}

    @staticmethod
    def config_errors(chunk: int, topk: int, **_other_fields) -> list[str]:
        """A config's ``topk`` must compress the target block (see :func:`topk_block_errors`)."""
        return topk_block_errors(chunk, topk, "compression.topk", "compression.chunk")

    def __repr__(self) -> str:
        return f"DCTTopK(chunk={self.chunk}, topk={self.topk}, wire={self.wire!r})"

    # ------------------------------------------------------------------ geometry
    def layout(self, shape: tuple[int, ...] | torch.Size) -> BlockLayout:
        """The block layout of a tensor of ``shape`` (cached, so a degenerate chunk warns once)."""
        shape = tuple(shape)
        if shape not in self._layouts:
            self._layouts[shape] = BlockLayout.for_shape(shape, self.chunk)
        return self._layouts[shape]

    @property
    def decodes_magnitudes(self) -> bool:
        """Do receivers decode an estimate of each sent value (its magnitude included)? Then a
        sender removes what they decode from its momentum, rounding and all. ``signbit`` decodes
        +-1, a direction with no magnitude: the sender removes the values it selected (Psyche
        subtracts its own unquantized result)."""
        return self.wire != "signbit"

    def removed(self, values: torch.Tensor) -> torch.Tensor:
        """What a sender removes from its momentum for the selected ``values``: what receivers
        decode of them where they decode magnitudes (:meth:`received`), else the values."""
        return self.received(values) if self.decodes_magnitudes else values

    @property
    def removes_selected_values(self) -> bool:
        """Is :meth:`removed` the selected values themselves, whatever they are? The paper wire
        sends them as they are and ``signbit`` removes them; the other wires round them first."""
        return self.wire == "paper" or not self.decodes_magnitudes

    def kept_per_block(self, layout: BlockLayout) -> int:
        """k, clamped to [1, coefficients per block]."""
        return min(self.topk, layout.block_numel)

    def payload_nbytes(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> int:
        """Bytes :meth:`encode` puts on the wire for a tensor of ``shape`` and ``dtype``
        (computed from the format, not by encoding)."""
        layout = self.layout(shape)
        blocks = layout.num_blocks
        kept = blocks * self.kept_per_block(layout)
        if self.wire == "paper":
            return kept * (torch.int64.itemsize + dtype.itemsize)
        if self.wire == "compact":
            return kept * (2 + 2)
        if self.wire == "signbit":
            return kept * index_width(layout.block_numel) + math.ceil(kept / 8)
        return kept * 2 + math.ceil(kept / 8) + blocks * 2

    # ------------------------------------------------------- coefficient domain
    def select(
        self, coefficients: torch.Tensor, layout: BlockLayout, *, scratch: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The k largest-magnitude coefficients of every block of ``coefficients`` (block-in-
        place layout, ``rows x cols``). Returns their block-local indices ``(num_blocks, k)``
        (int64, row-major within the block), their flat positions in ``coefficients`` and their
        signed values. The selection is :func:`~lowcomm.compress.block_topk.block_topk`'s (exact;
        among equal magnitudes at the k-th place its choice is unspecified, as torch.topk's is).
        ``scratch`` (``numel`` entries of the coefficients' dtype) is its work space."""
        return block_topk(coefficients, layout, self.kept_per_block(layout), scratch=scratch)

    def transform_select(
        self, parts: list[torch.Tensor], layout: BlockLayout, momentum: torch.Tensor, *, beta: float, alpha: float,
        subtract: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``momentum = beta * momentum + alpha * P(parts)`` (P the block DCT-II,
        :func:`~lowcomm.compress.dct.dct_transform`; ``parts`` the row blocks of the ``rows x
        cols`` matrix, top to bottom) and :meth:`select` of the new momentum, as one CPU kernel
        that selects each tile of blocks while it is in cache from its transform, so the
        selection reads no memory the transform did not just write. Unless ``subtract`` is 0,
        ``subtract`` times the selected values then leave the momentum at their positions, in
        the same pass (DeMo's subtraction of what it sends, where what it sends is the values
        themselves). Same results as the calls it replaces (the last
        ``momentum.view(-1).index_add_(0, positions, values, alpha=-subtract)``), bit for bit.
        None, with nothing done, where that kernel cannot run (another device or dtype, a
        tensor that is not contiguous, the kernels or their selection turned off)."""
        kernels = dct_kernels([*parts, momentum])
        if kernels is None or selection_kernels(momentum) is None:
            return None
        k = self.kept_per_block(layout)
        selected = kernels.dct_blocks_topk(parts, momentum.view(layout.rows, layout.cols), layout.chunk_rows,
                                           layout.chunk_cols, beta, alpha, k, kernel_group_rows(layout, k),
                                           subtract)
        mark_written(momentum)
        return selected

    def pack(self, index: torch.Tensor, values: torch.Tensor, layout: BlockLayout) -> Payload:
        """The payload for the ``index`` and ``values`` from :meth:`select`, in this codec's
        wire format."""
        meta = {"shape": layout.shape, "dtype": values.dtype}
        if self.wire == "paper":
            return Payload({"index": index, "values": values}, meta)
        if self.wire == "signbit":
            return Payload({"index": _to_bytes(index, index_width(layout.block_numel)),
                            "signs": _pack_bits(torch.signbit(values))}, meta)
        index16 = _to_bytes(index, 2)
        if self.wire == "compact":
            return Payload({"index": index16, "values": values.to(torch.bfloat16)}, meta)
        return Payload(
            {
                "index": index16,
                "signs": _pack_bits(values < 0),
                "scale": values.abs().mean(dim=1).to(torch.bfloat16),
            },
            meta,
        )

    def stackable(self, layouts: list[BlockLayout]) -> bool:
        """Can the payloads of tensors with these layouts, laid end to end, be read as the
        payload of their stacked matrix? Yes unless sign bits are packed (``sign``,
        ``signbit``) and a tensor before the last ends inside a byte: each payload pads its
        bits to a whole byte."""
        if self.wire not in ("sign", "signbit"):
            return True
        return all(layout.num_blocks * self.kept_per_block(layout) % 8 == 0 for layout in layouts[:-1])

    def received(self, values: torch.Tensor) -> torch.Tensor:
        """What receivers decode for the selected ``values`` (``(num_blocks, k)``), computed
        without packing: ``unpack(pack(index, values, layout))[1]``, for any number of blocks
        (those of several tensors at once)."""
        if self.wire == "paper":
            return values
        if self.wire == "compact":
            return values.to(torch.bfloat16).to(values.dtype)
        if self.wire == "signbit":
            ones = torch.ones((), dtype=values.dtype, device=values.device)
            return torch.where(torch.signbit(values), -ones, ones)
        scale = values.abs().mean(dim=1).to(torch.bfloat16).to(values.dtype).unsqueeze(-1).expand(values.shape)
        return torch.where(values < 0, -scale, scale)

    def unpack(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """Block-local indices ``(num_blocks, k)`` int64 and the values a receiver decodes
        (what was sent, in the original dtype: exact for ``paper``, rounded otherwise). The
        payload's tensors may carry a leading dimension of workers (a gathered buffer); the
        results then do too."""
        tensors, dtype = payload.tensors, payload.meta["dtype"]
        if self.wire == "paper":
            return tensors["index"], tensors["values"]
        index = _from_bytes(tensors["index"])
        if self.wire == "signbit":
            negative = _unpack_bits(tensors["signs"], index.shape[-2] * index.shape[-1]).reshape(index.shape)
            ones = torch.ones((), dtype=dtype, device=index.device)
            return index, torch.where(negative, -ones, ones)
        if self.wire == "compact":
            return index, tensors["values"].to(dtype)
        per_payload = index.shape[-2] * index.shape[-1]
        negative = _unpack_bits(tensors["signs"], per_payload).reshape(index.shape)
        scale = tensors["scale"].to(dtype).unsqueeze(-1).expand(index.shape)
        return index, torch.where(negative, -scale, scale)

    def aggregate(
        self,
        payloads: list[Payload],
        layout: BlockLayout,
        *,
        out: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Dense ``rows x cols`` coefficients (block-in-place layout): for each coefficient the
        mean over the payloads that carry it, zero where none does. ``out`` and ``counts``
        (``numel`` entries each, the values' dtype) are work space, allocated when omitted;
        only the positions the payloads touch are read from ``counts``."""
        unpacked = [self.unpack(payload) for payload in payloads]
        dtype, device = unpacked[0][1].dtype, unpacked[0][1].device
        sums = (out if out is not None else torch.empty(layout.numel, dtype=dtype, device=device)).view(-1)
        sums.zero_()
        positions = [layout.global_index(index).view(-1) for index, _ in unpacked]
        for where, (_, values) in zip(positions, unpacked, strict=True):
            sums.index_add_(0, where, values.reshape(-1))  # distinct positions: deterministic on CUDA too
        if len(payloads) > 1:
            tally = (counts if counts is not None else torch.empty_like(sums)).view(-1)
            touched = torch.cat(positions)
            tally[touched] = 0
            for where in positions:
                tally.index_add_(0, where, torch.ones_like(where, dtype=dtype))
            # a position appears once per sender; every duplicate writes the same quotient
            sums[touched] = sums[touched] / tally[touched]
        return sums.view(layout.rows, layout.cols)

    def aggregate_gathered(
        self,
        gathered: list[Payload],
        layouts: list[BlockLayout],
        offsets: list[int],
        *,
        out: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`aggregate` of many tensors and workers at once: ``gathered[i]`` holds tensor
        i's payloads of all W workers (each payload tensor with a leading dimension W, as an
        all-gather into one buffer leaves them) and ``offsets[i]`` where its coefficients start
        in ``out``. Every position gets the mean over the workers that sent it, summed in
        worker order as :meth:`aggregate` does, so the result is bit-identical to it; the
        kernels per call are a few per tensor (unpack, positions, adds) plus a few in all,
        instead of a few per tensor and worker. ``counts`` (as large as ``out``) is work space."""
        unpacked = [self.unpack(payload) for payload in gathered]
        workers = unpacked[0][0].shape[0]
        sums = out.view(-1).zero_()
        tally = counts.view(-1).zero_() if workers > 1 else None
        ones = torch.ones(1, dtype=sums.dtype, device=sums.device)
        for (index, sent), layout, offset in zip(unpacked, layouts, offsets, strict=True):
            # worker-major: each worker's positions are distinct, and the tensors' positions
            # disjoint, so a position's contributions arrive in worker order, as in
            # aggregate()'s one index_add_ per worker. One call per tensor on the CPU (per tensor
            # and worker on CUDA: ordered_index_add_), not one over their concatenation: at
            # W = 64 the copies of a concatenation cost as much as the adds.
            where = layout.global_index(index, offset).view(workers, -1)
            ordered_index_add_(sums, where, sent.reshape(workers, -1))
            if tally is not None:  # small integers: exact in any order
                tally.index_add_(0, where.view(-1), ones.expand(where.numel()))
        if tally is not None:
            # the mean as one dense division by max(count, 1): a position nobody sent holds
            # 0 / 1 = 0, every other the same quotient as a division at the sent positions
            # only, so the result is bit-identical to aggregate(). Dividing at the W x k x blocks
            # sent positions costs a few gathers and scatters each, which at W = 2 already take
            # longer than three passes over the buffer, and at W = 64 five times longer.
            sums.div_(tally.clamp_(min=1))
        return sums

    def decode_add(
        self, gathered: Payload, layout: BlockLayout, targets: list[torch.Tensor], *, alpha: float, sign: bool
    ) -> bool:
        """``targets += alpha * f(P^-1(Q))`` in one pass with lowcomm's CPU kernels: Q the
        aggregate of a gathered payload (tensors with a leading dimension of W workers), each
        coefficient the mean over the workers that sent it, bit for bit as
        :meth:`aggregate_gathered` makes it; P^-1 the inverse block DCT; f the sign (``sign``)
        or nothing; ``targets`` the row blocks of ``layout``'s ``rows x cols`` matrix, top to
        bottom (DeMo's update of a stack of parameters). Each tile of 64-row blocks gathers its
        coefficients in cache, so no ``rows x cols`` buffer is zeroed, filled or read; from a
        few senders (up to three of DeMo's top-32) their payloads' ascending lists, merged, are
        the coefficients and no tile is gathered at all. Returns
        False, with nothing done, where the kernels cannot (:func:`~lowcomm.compress.dct.dct_kernels`)."""
        if not self.decodes_into(gathered, targets):
            return False
        index, values = self.unpack(gathered)
        shape = (index.shape[0], layout.num_blocks, -1)
        # read where the all-gather left them: each worker's row is contiguous, the rows are
        # the W x n buffer's (a copy of W x the run's payload would cost as much as the decode)
        cpu_kernels.ops().dct_gathered_update(_rows_contiguous(index.reshape(shape)),
                                              _rows_contiguous(values.reshape(shape)), targets, layout.cols,
                                              layout.chunk_rows, layout.chunk_cols, alpha, sign)
        mark_written(*targets)
        return True

    def decodes_into(self, gathered: Payload, targets: list[torch.Tensor]) -> bool:
        """Would :meth:`decode_add` take these (the kernels built, targets they take, values of
        the targets' dtype)? A caller with several to apply asks first, so that none is applied
        unless all are."""
        return (dct_kernels(targets) is not None and gathered.meta["dtype"] == targets[0].dtype
                and all(tensor.device == targets[0].device for tensor in gathered.tensors.values()))

    # ------------------------------------------------------------- whole tensors
    def bases(
        self, layout: BlockLayout, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (left, right) DCT bases of ``layout``; None where a chunk is 1 (the identity)."""
        return dct_bases(layout, device, dtype)

    def encode(self, tensor: torch.Tensor) -> Payload:
        layout = self.layout(tensor.shape)
        coefficients = dct_transform(tensor.contiguous(), layout)
        index, _, values = self.select(coefficients, layout)
        return self.pack(index, values, layout)

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        layout = self.layout(payloads[0].meta["shape"])
        coefficients = self.aggregate(payloads, layout)
        return dct_transform(coefficients, layout, inverse=True).view(layout.shape)
