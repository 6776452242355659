"""Dense re-derivations of the DCT top-k codec, written out from their definitions: the DCT-II
entry by entry, block transforms as products with block-diagonal (Kronecker) matrices, and
top-k by sorting each block. The codec's tests (test_dct_codec) and DeMo's and FlexDeMo's
compare lowcomm against them; a helper module, not a test itself."""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def dct_definition(size: int) -> torch.Tensor:
    """DCT-II with orthonormal scaling, entry by entry from its definition."""
    matrix = torch.empty(size, size, dtype=F64)
    for k in range(size):
        scale = math.sqrt((1.0 if k == 0 else 2.0) / size)
        for i in range(size):
            matrix[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * size))
    return matrix


def chunk_by_search(size: int, target: int) -> int:
    return size if size <= target else max(d for d in range(1, target + 1) if size % d == 0)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 1:
        return tensor.reshape(1, -1)
    return tensor.reshape(tensor.shape[0], -1)


def block_diagonal(basis: torch.Tensor, blocks: int) -> torch.Tensor:
    return torch.kron(torch.eye(blocks, dtype=basis.dtype), basis)


def dense_dct(matrix: torch.Tensor, chunk: int, inverse: bool = False) -> torch.Tensor:
    rows, cols = matrix.shape
    c0, c1 = chunk_by_search(rows, chunk), chunk_by_search(cols, chunk)
    left = block_diagonal(dct_definition(c0), rows // c0)
    right = block_diagonal(dct_definition(c1), cols // c1)
    return left.T @ matrix @ right if inverse else left @ matrix @ right.T


def dense_topk(
    coefficients: torch.Tensor, chunk: int, k: int, wire: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the receiver decodes (dense, zero where not sent) and the mask of sent entries."""
    rows, cols = coefficients.shape
    c0, c1 = chunk_by_search(rows, chunk), chunk_by_search(cols, chunk)
    k = min(k, c0 * c1)
    sent = torch.zeros_like(coefficients)
    mask = torch.zeros_like(coefficients, dtype=torch.bool)
    for a in range(rows // c0):
        for b in range(cols // c1):
            block = coefficients[a * c0 : (a + 1) * c0, b * c1 : (b + 1) * c1].reshape(-1)
            order = torch.argsort(block.abs(), descending=True)[:k]
            values = block[order]
            if wire == "compact":
                values = values.to(torch.bfloat16).to(F64)
            elif wire == "sign":
                scale = values.abs().mean().to(torch.bfloat16).to(F64)
                values = torch.where(values < 0, -scale, scale)
            elif wire == "signbit":  # Psyche's 1-bit values: the sign alone
                values = torch.where(values < 0, -1.0, 1.0).to(F64)
            for position, value in zip(order.tolist(), values, strict=True):
                row, col = a * c0 + position // c1, b * c1 + position % c1
                sent[row, col] = value
                mask[row, col] = True
    return sent, mask
