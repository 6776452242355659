"""Error feedback: what a lossy codec drops this round is carried into the next one.

With accumulator E (one per tensor, owned by the caller so it lands in the caller's
``state_dict``), decay ``beta`` and codec C, each round with input x does (MuLoCo, Algorithm 1)::

    E <- beta * E + x
    D  = C(E)            # the payload sent
    E <- E - decode(D)

With beta = 1, after T rounds sum(decoded D) = sum(x) - E_T exactly (up to rounding): nothing
is lost, only delayed. beta < 1 forgets old residuals geometrically.
"""

from __future__ import annotations

import torch

from lowcomm.compress.base import Codec, Payload


class ErrorFeedback:
    """Compress through ``codec`` with an error-feedback accumulator decayed by ``beta``."""

    def __init__(self, codec: Codec, beta: float):
        if not 0 <= beta <= 1:
            raise ValueError(f"error feedback beta must be in [0, 1], got {beta}")
        self.codec = codec
        self.beta = beta

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r}, beta={self.beta})"

    @torch.no_grad()
    def accumulate(self, accumulator: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The first line, in place: ``E <- beta E + update``. (A caller whose collective encodes
        E itself and leaves the residual, such as the quantized all-reduce, stops here.)"""
        return accumulator.mul_(self.beta).add_(update)

    @torch.no_grad()
    def compress(self, accumulator: torch.Tensor, update: torch.Tensor) -> Payload:
        """Fold ``update`` into ``accumulator`` (in place), encode it, and keep the residual."""
        self.accumulate(accumulator, update)
        payload = self.codec.encode(accumulator)
        accumulator.sub_(self.codec.decode([payload]))
        return payload
