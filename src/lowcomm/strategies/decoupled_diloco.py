"""Decoupled DiLoCo as a strategy: learners on their own clocks (an AdamW inner optimizer each)
send parameter fragments to a synchronizer process, which merges what has arrived once its
quorum is met and its grace window has passed, weighting each learner by the tokens it trained
(:mod:`lowcomm.optim.decoupled_diloco`; the harness's side: :mod:`lowcomm.strategies.learners`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.optim.decoupled_diloco import (
    GLOBAL,
    OFFER,
    DecoupledDiLoCoArgs,
    DecoupledLearner,
    FragmentSynchronizer,
    serve,
)
from lowcomm.optim.grouping import AdamWArgs, adamw
from lowcomm.optim.synchronizer import balanced_fragments, seconds_field
from lowcomm.strategies.base import Cycle, Display, Point, Row, StrategyConfig, register, trainable_parameters
from lowcomm.strategies.learners import LearnerStrategy, embedding_indices, frame_bytes


@dataclass(kw_only=True)
class DecoupledDiLoCoConfig(StrategyConfig, AdamWArgs, DecoupledDiLoCoArgs):
    """``configs/optimizer/decoupled_diloco.yaml`` (its comments give the sources): inner AdamW
    (``lr`` is the inner, scheduled lr) and the synchronizer's fragments, quorum, grace window
    and outer Nesterov SGD."""

    config_name: ClassVar[str] = "decoupled_diloco"


def fragment_indices(model: torch.nn.Module, count: int) -> list[list[int]]:
    """The trainable tensors (indices) of each of ``count`` fragments of balanced size: the same
    on every learner and on the synchronizer."""
    return balanced_fragments([p.numel() for p in trainable_parameters(model)], count)


class FragmentServer:
    """The synchronizer's side as :mod:`lowcomm.train.synchronizer` runs it."""

    def __init__(self, cfg: DecoupledDiLoCoConfig, model: torch.nn.Module):
        self.cfg = cfg
        self.state = FragmentSynchronizer(
            [p.detach() for p in trainable_parameters(model)], fragment_indices(model, cfg.num_fragments),
            outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum, nesterov=cfg.nesterov, quorum=cfg.quorum,
            embeddings=embedding_indices(model))

    def serve(self, hub, *, learners: int, before: Callable[[int], None], idle_timeout_s: float) -> None:
        serve(hub, self.state, learners=learners, overlap_steps=self.cfg.overlap, gamma=self.cfg.grace,
              idle_timeout_s=idle_timeout_s, before_merge=before)

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)


@register
class DecoupledDiLoCoStrategy(LearnerStrategy):
    """Decoupled DiLoCo with an AdamW inner optimizer per learner."""

    name = "decoupled_diloco"
    Config = DecoupledDiLoCoConfig
    display = Display("Decoupled DiLoCo", marker="8", color="crimson")
    # Streaming DiLoCo's quickstart schedule (H=10, P=2, the same lr), merged by the synchronizer
    quickstart = (Point("Decoupled DiLoCo H=10 P=2", "optimizer.lr=6e-3", "optimizer.sync_every=10",
                        "optimizer.num_fragments=2"),)
    table1_tiny = quickstart
    comm_table = (Row("Decoupled DiLoCo H=24 P=4"),
                  Row("Decoupled DiLoCo H=10 P=2", "optimizer.sync_every=10", "optimizer.num_fragments=2"))
    # quorum of every learner, each waiting for its merges: the run that resumes bit for bit
    mid_period = ("optimizer.sync_every=4", "optimizer.quorum=0", "optimizer.wait=true")
    cycle = Cycle(4, "optimizer.sync_every=4", "optimizer.num_fragments=2", "optimizer.quorum=0",
                  "optimizer.wait=true")

    @classmethod
    def waits_for_slowest(cls, cfg: DecoupledDiLoCoConfig) -> bool:
        """Only where a learner waits for merges that wait for every learner (``wait`` under
        ``quorum: 0``)."""
        return cfg.wait and cfg.quorum == 0

    @classmethod
    def comm_overlap(cls, cfg: DecoupledDiLoCoConfig, parameters: int, compression=None) -> float:  # noqa: ARG003
        """All of it without ``wait`` (offers sent, merges received by threads of their own);
        with it, a fragment's round trip runs behind the ``overlap`` steps before its wait (as
        Streaming DiLoCo's)."""
        return min(1.0, cfg.overlap * cfg.num_fragments / cfg.sync_every) if cfg.wait else 1.0

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, DecoupledLearner]:
        params = trainable_parameters(model)
        fragments = [[params[i] for i in fragment] for fragment in fragment_indices(model, self.cfg.num_fragments)]
        inner = functools.partial(adamw, model, self.cfg)
        optimizer = DecoupledLearner(fragments, inner, self._link(), sync_every=self.cfg.sync_every,
                                     overlap=self.cfg.overlap, tokens_per_step=self.tokens_per_step,
                                     wait=self.cfg.wait)
        return model, optimizer

    @classmethod
    def make_synchronizer(cls, cfg: DecoupledDiLoCoConfig, model: torch.nn.Module, learners: int) -> FragmentServer:  # noqa: ARG003
        return FragmentServer(cfg, model)

    def sent_per_step(self, model: torch.nn.Module) -> tuple[float, float, float]:
        """Each fragment offered once per H steps (the learner's parameters of it) and its merge
        received once (the synchronizer's float32 parameters), all amortised over H: learners in
        step, every merge holding every offer (a quorum of all, or offers within the grace
        window). That is the least a learner receives: where a quorum below all merges offers
        apart, each merge goes to every learner, up to N merges of a fragment per H
        (results/stragglers/README.md measured 4.0-4.5x on 4 learners at K = 1)."""
        params = trainable_parameters(model)
        payload = tx = rx = 0.0
        for index, fragment in enumerate(fragment_indices(model, self.cfg.num_fragments)):
            tensors = [params[i] for i in fragment]
            offer = {"kind": OFFER, "fragment": index, "tokens": 10**4, "steps": self.cfg.sync_every,
                     "step": 10**3, "step_s": seconds_field(0.1)}
            payload += sum(t.numel() * t.element_size() for t in tensors)
            tx += frame_bytes(offer, tensors)
            merged = [torch.empty(t.shape, dtype=torch.float32, device="meta") for t in tensors]
            rx += frame_bytes({"kind": GLOBAL, "fragment": index, "version": 10**2}, merged)
        return payload / self.cfg.sync_every, tx / self.cfg.sync_every, rx / self.cfg.sync_every
