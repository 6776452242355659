"""The pieces of a quantized all-reduce that do not touch the network: how a tensor is cut into
one chunk per rank, how a chunk's encoded payload becomes bytes and back, and what the
collective costs. :meth:`lowcomm.comm.Communicator.all_reduce_quantized` issues it.

The algorithm is torchft's ``allreduce_quantized`` (torchft/collectives.py), which MuLoCo's
code simulates (``simulate_quantization_after_reduce``):

1. every rank cuts each tensor into W chunks (contiguous row ranges; a vector's entries) and
   encodes each chunk with the codec, its side data (a per-bin table, per-row scales) inside
   the chunk's own payload;
2. an all-to-all sends chunk j of every tensor to rank j;
3. rank j decodes the W payloads of its chunks, sums them in float32 (float64 for a float64
   tensor) in rank order and divides by W, then encodes the mean again;
4. an all-gather returns every rank's re-encoded chunks to every rank, which decodes them all
   (its own included, so every rank holds the same values).

Bytes per rank: the all-to-all sends the chunks meant for the W-1 other ranks, the all-gather
forwards W-1 reduced chunks: about 2 (W-1)/W x the encoded tensor, like a ring all-reduce and
unlike an all-gather of the whole payload ((W-1) x). Every chunk carries its own side data, so
the payload grows with W: by W-1 tables per tensor for the statistical quantizer; for per-row
scales only where a chunk splits what was one scale's range (a vector: W scales, not one).

Each chunk is quantized with its own statistics: what an implementation that sends rank j
only chunk j must do. MuLoCo's code, which simulates this exchange
(``simulate_quantization_after_reduce``), quantizes whole tensors both times, with one set of
statistics per tensor; lowcomm's per-chunk statistics are finer (a smaller error at large W).

The sum is taken in float32 (or the tensor's dtype if wider): each received chunk is decoded
straight to that precision, so a bf16 tensor's table values are not rounded to bf16 first.

A codec here is anything with ``encode(tensor) -> payload`` and ``decode([payload]) -> tensor``
whose payload has a ``tensors`` dict sized by the chunk's shape alone (the
:class:`lowcomm.compress.base.Codec` contract; this module does not import lowcomm.compress),
``encode_stacked(chunks)`` (k chunks of one shape, stacked, each encoded as ``encode`` would:
a payload whose tensors carry a leading dimension k) and ``dequantize(payload)`` (such a
payload's values as a ``(k, numel)`` float32 tensor): a tensor's W chunks are encoded, and
decoded, in a call or two, not W, so a rank's work at W = 64 is not 64 times a few operations
per tensor (``benchmarks/senders.py`` measures it).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from lowcomm.comm.meter import Traffic, WireBytes


def chunk_bounds(shape: torch.Size | Sequence[int], world_size: int) -> list[tuple[int, int]]:
    """W contiguous ``(start, stop)`` ranges over a tensor's rows (its first dimension; a
    vector's entries), as even as they can be: the first ``rows % W`` take one row more. A
    tensor with fewer rows than ranks leaves the last chunks empty."""
    rows = shape[0] if len(shape) else 1
    base, extra = divmod(rows, world_size)
    bounds, start = [], 0
    for j in range(world_size):
        stop = start + base + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_shapes(shape: torch.Size | Sequence[int], world_size: int) -> list[torch.Size | None]:
    """The shape of each rank's chunk of a tensor of ``shape`` (None: an empty chunk)."""
    shape = torch.Size(shape)
    if not len(shape):
        shape = torch.Size([1])
    return [torch.Size([stop - start, *shape[1:]]) if stop > start else None
            for start, stop in chunk_bounds(shape, world_size)]


def chunk_runs(shape: torch.Size | Sequence[int], world_size: int) -> list[tuple[range, int, int]]:
    """The non-empty chunks of a tensor of ``shape`` in runs of one shape (at most two: the
    first ``rows % W`` chunks have a row more): ``(ranks, first row, rows per chunk)``. A run's
    chunks lie end to end in the tensor, so a codec can take them as one stack."""
    runs: list[tuple[range, int, int]] = []
    for rank, (start, stop) in enumerate(chunk_bounds(shape, world_size)):
        if stop == start:
            break  # the empty chunks are the last ones
        if runs and runs[-1][2] == stop - start:
            ranks, first, size = runs[-1]
            runs[-1] = (range(ranks.start, rank + 1), first, size)
        else:
            runs.append((range(rank, rank + 1), start, stop - start))
    return runs


def stacked_chunks(tensor: torch.Tensor, run: tuple[range, int, int]) -> torch.Tensor:
    """A run's chunks of ``tensor`` (:func:`chunk_runs`) as a view ``(chunks, rows, ...)``."""
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
    ranks, first, size = run
    return rows[first:first + len(ranks) * size].view(len(ranks), size, *rows.shape[1:])


def payload_bytes(payload: Any) -> torch.Tensor:
    """A payload's tensors as one flat uint8 buffer, in the order of its ``tensors`` dict."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in payload.tensors.values()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def payload_size(payload: Any | None) -> int:
    if payload is None:
        return 0
    return sum(t.numel() * t.element_size() for t in payload.tensors.values())


def stacked_from_bytes(rows: torch.Tensor, template: Any) -> Any:
    """The payloads whose bytes are the rows of ``rows`` (``(k, bytes)``: k ranks' encodings of
    chunks of one shape), as one payload shaped as ``template`` whose tensors carry a leading
    dimension k: what a codec's ``dequantize`` reads in one pass."""
    payload = copy.copy(template)
    payload.tensors, offset = {}, 0
    for key, like in template.tensors.items():
        size = like.numel() * like.element_size()
        # a copy: a uint8 slice at an odd offset cannot be read as wider elements
        payload.tensors[key] = rows[:, offset:offset + size].clone(memory_format=torch.contiguous_format).view(like.dtype).view(
            rows.shape[0], *like.shape)
        offset += size
    return payload


def unstacked(stacked: Any, row: int) -> Any:
    """Row ``row`` of a payload whose tensors carry a leading dimension (a codec's
    ``encode_stacked``): one chunk's payload, its tensors views of the stack's."""
    payload = copy.copy(stacked)
    payload.tensors = {key: value[row] for key, value in stacked.tensors.items()}
    return payload


def quantized_all_reduce_traffic(chunk_bytes: Sequence[int], rank: int, world_size: int) -> Traffic:
    """What ``rank`` sends and receives in a quantized all-reduce whose chunk j is
    ``chunk_bytes[j]`` bytes encoded (the same on every rank; the re-encoded mean of a chunk
    has the same size): the all-to-all sends its chunks j != rank and receives W-1 copies of
    chunk ``rank``; the all-gather, padded to the largest chunk, moves W-1 of them each way.
    Summed over ranks tx equals rx."""
    if world_size <= 1:
        return Traffic(0, 0, 0, 0)
    padded = max(chunk_bytes)
    gathered = (world_size - 1) * padded
    tx = sum(chunk_bytes) - chunk_bytes[rank] + gathered
    rx = (world_size - 1) * chunk_bytes[rank] + gathered
    return Traffic(tx, rx, 2 * (world_size - 1), 2 * (world_size - 1))


def quantized_all_reduce_bytes(total: int, largest: int, world_size: int) -> WireBytes:
    """Payload, tx and rx per rank, averaged over the ranks, of a quantized all-reduce whose
    encoded chunks sum to ``total`` bytes per rank, the largest rank's chunks to ``largest``:
    :func:`quantized_all_reduce_traffic` summed over ranks in closed form. The all-to-all moves
    (W-1)/W of the total straight to its ranks (``direct``), the padded ring all-gather W-1
    largest chunks. What the comm table prints."""
    if world_size <= 1:
        return WireBytes(float(total), 0.0, 0.0)
    direct = (world_size - 1) * total / world_size
    tx = direct + (world_size - 1) * largest
    return WireBytes(float(total), tx, tx, direct)


def encoded_sizes(codec: Any, shapes: Sequence[torch.Size], world_size: int,
                  dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(every chunk's encoded bytes summed, the largest rank's chunks' bytes) for tensors of
    ``shapes`` cut into W chunks, from a chunk's two possible sizes (rank 0 always holds the
    larger): no loop over W, so the comm table can ask at any world size."""
    total = largest = 0
    for shape in shapes:
        shape = torch.Size(shape) if len(shape) else torch.Size([1])
        base, extra = divmod(shape[0], world_size)
        small = codec.payload_nbytes(torch.Size([base, *shape[1:]]), dtype) if base else 0
        big = codec.payload_nbytes(torch.Size([base + 1, *shape[1:]]), dtype) if extra else small
        total += extra * big + (world_size - extra) * small
        largest += big
    return total, largest
