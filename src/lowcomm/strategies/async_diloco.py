"""Asynchronous DiLoCo as a strategy: learners (an AdamW inner optimizer each) push their outer
gradients to a synchronizer process when their round ends, which applies each as it arrives by
delayed Nesterov and answers with the global parameters and the learner's next number of inner
steps (:mod:`lowcomm.optim.async_diloco`; the harness's side: :mod:`lowcomm.strategies.learners`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.optim.async_diloco import GLOBAL, PUSH, AsyncDiLoCoArgs, AsyncLearner, serve_async
from lowcomm.optim.grouping import AdamWArgs, adamw
from lowcomm.optim.synchronizer import DelayedNesterov, seconds_field
from lowcomm.strategies.base import Cycle, Display, Point, Row, StrategyConfig, register, trainable_parameters
from lowcomm.strategies.learners import LearnerStrategy, frame_bytes


@dataclass(kw_only=True)
class AsyncDiLoCoConfig(StrategyConfig, AdamWArgs, AsyncDiLoCoArgs):
    """``configs/optimizer/async_diloco.yaml``: inner AdamW (``lr`` is the inner, scheduled lr),
    the base H and delayed Nesterov's outer lr and momentum."""

    config_name: ClassVar[str] = "async_diloco"


class AsyncServer:
    """The synchronizer's side as :mod:`lowcomm.train.synchronizer` runs it: the global
    parameters (float32) and delayed Nesterov, its period N the number of learners."""

    def __init__(self, cfg: AsyncDiLoCoConfig, model: torch.nn.Module, learners: int):
        self.cfg = cfg
        self.parameters = [p.detach().float().clone() for p in trainable_parameters(model)]
        self.rule = DelayedNesterov(cfg.outer_lr, cfg.outer_momentum, learners)

    def serve(self, hub, *, learners: int, before: Callable[[int], None], idle_timeout_s: float) -> None:
        serve_async(hub, self.parameters, self.rule, learners=learners, base_steps=self.cfg.sync_every,
                    dynamic=self.cfg.dynamic_local_steps, idle_timeout_s=idle_timeout_s, before_apply=before)

    def state_dict(self) -> dict:
        return {"parameters": [p.clone() for p in self.parameters], "rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.parameters = [p.clone() for p in state["parameters"]]
        self.rule.load_state_dict(state["rule"])


@register
class AsyncDiLoCoStrategy(LearnerStrategy):
    """Asynchronous DiLoCo with an AdamW inner optimizer per learner."""

    name = "async_diloco"
    Config = AsyncDiLoCoConfig
    display = Display("Async DiLoCo", marker="x", color="sienna")
    quickstart = (Point("Async DiLoCo H=10", "optimizer.lr=6e-3", "optimizer.sync_every=10"),)
    table1_tiny = quickstart
    comm_table = (Row("Async DiLoCo H=10", "optimizer.sync_every=10"),)
    # One learner: its pushes arrive in the one order there is. Several learners' order is the
    # network's, so that two runs of one config differ, and a resume cannot be bit for bit (the
    # rule: LearnerStrategy.elastic_rule, docs/methods.md)
    mid_period = ("optimizer.sync_every=2", "optimizer.dynamic_local_steps=false", "cluster.workers=1")
    cycle = Cycle(2, "optimizer.sync_every=2", "optimizer.dynamic_local_steps=false")

    @classmethod
    def waits_for_slowest(cls, cfg: AsyncDiLoCoConfig) -> bool:  # noqa: ARG003
        """No: a learner waits for the synchronizer's reply to its own push alone."""
        return False

    @classmethod
    def comm_overlap(cls, cfg: AsyncDiLoCoConfig, parameters: int, compression=None) -> float:  # noqa: ARG003
        """0: a learner waits for the reply to its push (the global parameters) before its next round."""
        return 0.0

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, AsyncLearner]:
        params = trainable_parameters(model)
        inner = functools.partial(adamw, model, self.cfg)
        return model, AsyncLearner(params, inner, self._link(), base_steps=self.cfg.sync_every)

    @classmethod
    def make_synchronizer(cls, cfg: AsyncDiLoCoConfig, model: torch.nn.Module, learners: int) -> AsyncServer:
        return AsyncServer(cfg, model, learners)

    def sent_per_step(self, model: torch.nn.Module) -> tuple[float, float, float]:
        """One outer gradient pushed per H steps and the float32 global parameters received
        (H: the base; dynamic local updates give a slower learner fewer steps per round)."""
        params = trainable_parameters(model)
        payload = sum(p.numel() * p.element_size() for p in params)
        tx = frame_bytes({"kind": PUSH, "steps": self.cfg.sync_every, "step": 10**3, "step_s": seconds_field(0.1)},
                         params)
        merged = [torch.empty(p.shape, dtype=torch.float32, device="meta") for p in params]
        rx = frame_bytes({"kind": GLOBAL, "arrivals": 10**2, "local_steps": self.cfg.sync_every}, merged)
        return payload / self.cfg.sync_every, tx / self.cfg.sync_every, rx / self.cfg.sync_every
