"""Top-k sparsification: send the largest-magnitude fraction of a tensor's entries.

Wire format, per tensor: ``values`` (k entries in the tensor's dtype) and ``indices`` (k flat
positions). Indices are int32 by default: every parameter of the OLMo models has fewer than
2**31 entries (the largest, OLMo-1B's embedding, has about 1e8), so int64 would only double the
index bytes; ``index_dtype="int64"`` is kept for byte-for-byte comparison with implementations
that send what ``torch.topk`` returns. k depends only on the tensor's size, so every worker's
payload has the same shapes and payloads can be all-gathered.
"""

from __future__ import annotations

import torch

from lowcomm.compress.base import Payload
from lowcomm.compress.registry import register_codec

_INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}


@register_codec("topk")
class TopK:
    """Keep ``k = max(1, floor(fraction * numel))`` entries of largest magnitude.

    ``decode`` of several payloads returns the mean of their dense reconstructions (an entry
    no worker sent counts as zero for every worker), i.e. the plain average a compressed
    all-reduce would give.
    """

    name = "topk"
    decodes_mean = True  # decode(W payloads): their mean (see Codec)
    reducible = False  # supports differ per worker: all-gathered

    def __init__(self, fraction: float = 0.01, index_dtype: str = "int32"):
        if not 0 < fraction <= 1:
            raise ValueError(f"compression.fraction must be in (0, 1], got {fraction}")
        if index_dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"compression.index_dtype must be one of {sorted(_INDEX_DTYPES)}, got {index_dtype!r}"
            )
        self.fraction = fraction
        self.index_dtype = _INDEX_DTYPES[index_dtype]

    def __repr__(self) -> str:
        return f"TopK(fraction={self.fraction}, index_dtype={self.index_dtype})"

    def num_kept(self, numel: int) -> int:
        return max(1, int(self.fraction * numel))

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes :meth:`encode` puts on the wire for a tensor of this shape and dtype."""
        kept = self.num_kept(torch.Size(shape).numel())
        return kept * (dtype.itemsize + self.index_dtype.itemsize)

    def encode(self, tensor: torch.Tensor) -> Payload:
        if tensor.numel() >= 2**31 and self.index_dtype == torch.int32:
            raise ValueError(f"a tensor of {tensor.numel()} entries needs compression.index_dtype=int64")
        flat = tensor.reshape(-1)
        indices = flat.abs().topk(self.num_kept(flat.numel()), sorted=False).indices
        return Payload(
            tensors={"values": flat[indices], "indices": indices.to(self.index_dtype)},
            meta={"shape": tensor.shape, "dtype": tensor.dtype},
        )

    def decode(self, payloads: list[Payload]) -> torch.Tensor:
        meta = payloads[0].meta
        values = payloads[0].tensors["values"]
        dense = torch.zeros(meta["shape"].numel(), dtype=meta["dtype"], device=values.device)
        for payload in payloads:
            # indices are unique within one payload, so each index_add_ is deterministic
            dense.index_add_(0, payload.tensors["indices"].long(), payload.tensors["values"])
        if len(payloads) > 1:
            dense.div_(len(payloads))
        return dense.view(meta["shape"])
