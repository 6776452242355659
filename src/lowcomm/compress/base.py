"""What a codec is: a pure transform between a tensor and the tensors that go on the wire.

A codec never talks to the network. ``encode`` returns a :class:`Payload` whose ``tensors`` are
exactly what an optimizer hands to the Communicator, so the meter counts real bytes, never a
formula. ``decode`` turns one or more payloads (e.g. the W payloads of an all-gather) back into
a dense tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Payload:
    """The tensors a codec puts on the wire, plus metadata every rank can rebuild locally
    (shapes, chunk sizes: derived from the parameter, so never sent)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Codec(Protocol):
    """``name``: its ``compression`` config name. ``decodes_mean``: whether ``decode`` of the W
    workers' payloads is the workers' mean (or the mean over the workers that sent each
    entry): the property an optimizer that averages a tensor over workers needs of a codec
    (DiLoCo's ``accepts_codec``); a codec whose decode is, say, a majority vote is not one.
    ``reducible``: see below."""

    name: str
    decodes_mean: bool
    # Whether a payload encodes every entry (a quantizer), so the mean of decoded payloads can be
    # encoded again and reduced where it lands: the quantized all-reduce
    # (lowcomm.comm.Communicator.all_reduce_quantized). A sparsifier's supports differ per
    # worker, so its payloads are all-gathered (the references do the same). Absent: False.
    reducible: bool

    def encode(self, tensor: torch.Tensor) -> Payload: ...

    def decode(self, payloads: list[Payload]) -> torch.Tensor: ...

    def payload_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes ``encode`` puts on the wire for a tensor of this shape and dtype (for comm tables)."""
        ...


def mean_of_dequantized(payloads: list[Payload], dequantize: Callable[[Payload], torch.Tensor]) -> torch.Tensor:
    """The mean of the workers' dequantized payloads (fp32, summed in worker order), in the
    original dtype and shape: how a quantizing codec decodes what an all-gather brought back."""
    meta = payloads[0].meta
    dense = dequantize(payloads[0])
    for payload in payloads[1:]:
        dense += dequantize(payload)
    if len(payloads) > 1:
        dense /= len(payloads)
    return dense.to(meta["dtype"]).view(meta["shape"])
