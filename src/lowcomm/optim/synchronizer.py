"""The rules of a synchronizer: a central outer optimizer that learners push to on their own
clocks, instead of meeting in a collective (issue 47: Decoupled DiLoCo, asynchronous DiLoCo).

A synchronous DiLoCo waits at each outer step for its slowest worker. Here each learner trains
at its own pace and sends what it has (parameters, or an outer gradient) to one synchronizer,
which holds the global parameters and the outer optimizer's state and sends merged parameters
back; no learner waits for another. This module holds the arithmetic alone, usable in anyone's
loop, with no transport: which merges happen and what they compute. Two papers, two rules:

**Decoupled DiLoCo** (Douillard et al. 2026, arXiv 2604.21428). The parameters are split into P
fragments (:func:`balanced_fragments`: whole tensors, largest first, each to the lightest
fragment); fragment p falls due every H steps at its own offset. When it does, the synchronizer
merges the fragment of every learner that has sent one since its last merge, once at least a
minimum quorum K of them has, and for a grace window after that (:func:`grace_window_s`). Each
learner m's outer gradient ``v_m = Theta_p - theta_{m,p}`` is weighted by its tokens since it
last received the fragment times its tokens per step (:func:`token_weight`), and the merge is a
radial-directional average (:func:`radial_directional_average`: the weighted mean norm along the
weighted mean direction; the embeddings' fragment takes the plain weighted mean, their outer
gradients not being near-orthogonal); the merged outer gradient takes an outer Nesterov SGD step
and the new global fragment goes back to every learner, which replaces its own with it.

**Asynchronous Local-SGD** (Liu et al. 2024, arXiv 2401.09135). A learner runs H_w inner steps
from the global parameters it last pulled, pushes ``g = theta_pulled - theta``, pulls the current
global parameters and goes on. The synchronizer applies each g as it arrives, with **delayed
Nesterov** momentum (:class:`DelayedNesterov`: plain 1/N-scaled steps in between, the momentum
updated once every N arrivals from their mean), and **dynamic local updates** give each learner
H_w in proportion to its speed (:func:`dynamic_local_steps`), so that all push at about the same
rate.

What the papers leave open and the choices here are in :data:`OPEN_CHOICES`, which the
provenance table quotes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Where the papers leave a detail open, what this module does (quoted by docs/methods.md).
OPEN_CHOICES = {
    "rda_granularity": "the radial-directional average is taken per tensor (not over a fragment's tensors at once)",
    "rda_degenerate": "where the weighted mean direction vanishes (opposite outer gradients), the plain weighted "
                      "mean is taken instead",
    "embeddings": "the tensors of the token embedding (tied to the output layer in OLMo) are merged by the plain "
                  "weighted mean, every other tensor by the radial-directional average",
    "weights": "token weights are normalised to sum to 1 over the merged learners before either mean",
    "grace_gamma": "gamma, the share of the slack the grace window takes, is a setting (the paper gives none)",
    "dn_momentum_activation": "delayed Nesterov's momentum activation c is 0 (the momentum applied at every N-th "
                              "arrival only)",
}


def seconds_field(seconds: float) -> str:
    """A time in a message's header, at a fixed width ("1.234567e-01"): a header's length, and so
    the bytes a run sends, does not then depend on how fast its steps happened to be."""
    return f"{max(0.0, seconds):.6e}"


def token_weight(tokens: int, steps: int) -> float:
    """Decoupled DiLoCo's weight of a learner's fragment: its tokens since it last received the
    fragment times its tokens per step (quantity times quality: a learner that lost devices
    trains fewer tokens a step); 0 for a learner that took no step."""
    if tokens < 0 or steps < 0:
        raise ValueError(f"tokens and steps are counts >= 0, got {tokens} and {steps}")
    return 0.0 if steps == 0 else tokens * (tokens / steps)


def _normalised(weights: Sequence[float]) -> list[float]:
    if len(weights) == 0:
        raise ValueError("nothing to merge")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights are finite and >= 0, got {list(weights)}")
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError(f"the weights sum to {total}: no learner contributed a step")
    return [w / total for w in weights]


def weighted_average(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_m w'_m v_m`` with the weights normalised to sum to 1, in float32."""
    shares = _normalised(weights)
    out = torch.zeros_like(deltas[0], dtype=torch.float32)
    for delta, share in zip(deltas, shares, strict=True):
        out.add_(delta.float(), alpha=share)
    return out


# A mean direction shorter than this (a weighted mean of unit vectors, in float32, whose rounding
# leaves ~1e-8 of directions that cancel) counts as none: the outer gradients cancel.
DEGENERATE_DIRECTION = 1e-6


def radial_directional_average(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Decoupled DiLoCo's merge of one tensor's outer gradients: ``(sum_m w'_m |v_m|) *
    unit(sum_m w'_m unit(v_m))``, the weighted mean norm along the weighted mean direction.

    The learners' outer gradients are nearly orthogonal, so their plain mean shrinks with their
    number (M unit vectors: norm 1/sqrt(M)) and the outer learning rate would have to follow M;
    this keeps the norm of a typical outer gradient whatever M is. A zero outer gradient has no
    direction and adds none; where the directions cancel, the plain weighted mean is taken."""
    shares = _normalised(weights)
    norm = 0.0
    direction = torch.zeros_like(deltas[0], dtype=torch.float32)
    for delta, share in zip(deltas, shares, strict=True):
        delta = delta.float()
        length = float(torch.linalg.vector_norm(delta))
        norm += share * length
        if length > 0:
            direction.add_(delta, alpha=share / length)
    length = float(torch.linalg.vector_norm(direction))
    if length <= DEGENERATE_DIRECTION:
        return weighted_average(deltas, weights)
    return direction.mul_(norm / length)


def balanced_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """The tensors (by index into ``sizes``, their element counts) of each of ``count``
    fragments: whole tensors, largest first, each to the fragment with the fewest elements so far
    (the first of those tied; greedy number partitioning, whose largest fragment is at most 4/3
    of the best split's). Each fragment lists its tensors in their order in ``sizes``."""
    if count < 1 or count > len(sizes):
        raise ValueError(f"{count} fragments of {len(sizes)} tensors: at least one tensor each")
    loads = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(count), key=lambda f: (loads[f], f))
        loads[lightest] += sizes[index]
        members[lightest].append(index)
    return [sorted(fragment) for fragment in members]


def grace_window_s(overlap_steps: int, step_s: float, quorum_s: float, sync_s: float, gamma: float) -> float:
    """How long after its quorum a merge still takes late learners (Decoupled DiLoCo's adaptive
    grace window): ``gamma`` of the slack the overlap leaves, ``tau * xi_step - (xi_quorum +
    xi_sync)``, so that waiting for one more learner never delays the merged fragment past the
    step the learners expect it at; 0 when there is no slack."""
    if not 0 <= gamma < 1:
        raise ValueError(f"the grace window's gamma is in [0, 1), got {gamma}")
    return gamma * max(0.0, overlap_steps * step_s - (quorum_s + sync_s))


def dynamic_local_steps(speeds: Sequence[float], base_steps: int) -> list[int]:
    """Asynchronous Local-SGD's dynamic local updates: learner w runs ``floor(v_w / max v * H)``
    inner steps (at least 1) between two pushes, ``v`` its measured steps per second, so the
    fastest runs H and every learner pushes at about the same rate."""
    if base_steps < 1:
        raise ValueError(f"H is >= 1, got {base_steps}")
    if not speeds or any(not math.isfinite(v) or v <= 0 for v in speeds):
        raise ValueError(f"speeds are > 0 steps per second, got {list(speeds)}")
    fastest = max(speeds)
    # (+1e-9: a speed ratio meant as exactly k / H must not floor to k - 1 by its rounding)
    return [max(1, math.floor(v / fastest * base_steps + 1e-9)) for v in speeds]


@dataclass
class DelayedNesterov:
    """The synchronizer's outer step in asynchronous Local-SGD: each arriving outer gradient g
    moves the global parameters at once by ``lr * g / N``; every N-th arrival also updates the
    momentum from the mean of the N gradients that arrived since the last update and applies
    ``lr * beta * m``. Over a block of N arrivals that is one Nesterov step on their mean
    (``m <- beta m + mean g``; ``theta -= lr (mean g + beta m)``), and with N = 1 it is Nesterov
    SGD itself; in between, a stale gradient moves the parameters without compounding in the
    momentum (Liu et al. 2024, Algorithm 3; momentum activation c = 0).

    State per parameter tensor: the momentum and the buffer of the block's gradients, and the
    arrivals counted; all of it in :meth:`state_dict`."""

    lr: float
    momentum: float
    period: int  # N
    arrivals: int = 0
    _momentum: list[torch.Tensor] = field(default_factory=list, repr=False)
    _buffer: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1 or self.period < 1:
            raise ValueError(f"delayed Nesterov needs lr > 0, momentum in [0, 1) and N >= 1; got lr {self.lr}, "
                             f"momentum {self.momentum}, N {self.period}")

    @torch.no_grad()
    def apply(self, parameters: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor]) -> None:
        """One arrival: ``parameters`` (the global ones, in place) take ``gradients`` (an outer
        gradient per tensor: pulled minus trained)."""
        if not self._momentum:
            self._momentum = [torch.zeros_like(p, dtype=torch.float32) for p in parameters]
            self._buffer = [torch.zeros_like(p, dtype=torch.float32) for p in parameters]
        self.arrivals += 1
        block_ends = self.arrivals % self.period == 0
        for param, grad, momentum, buffer in zip(parameters, gradients, self._momentum, self._buffer, strict=True):
            grad = grad.float()
            buffer.add_(grad)
            step = grad / self.period
            if block_ends:
                momentum.mul_(self.momentum).add_(buffer, alpha=1.0 / self.period)
                buffer.zero_()
                step.add_(momentum, alpha=self.momentum)
            param.sub_((self.lr * step).to(param.dtype))

    def state_dict(self) -> dict:
        return {"arrivals": self.arrivals, "momentum": [m.clone() for m in self._momentum],
                "buffer": [b.clone() for b in self._buffer]}

    def load_state_dict(self, state: dict) -> None:
        self.arrivals = int(state["arrivals"])
        self._momentum = [m.clone() for m in state["momentum"]]
        self._buffer = [b.clone() for b in state["buffer"]]
