"""Asynchronous DiLoCo: asynchronous Local-SGD with delayed Nesterov momentum and dynamic local
updates (Liu et al. 2024, arXiv 2401.09135); the rules are :mod:`lowcomm.optim.synchronizer`'s,
the transport :mod:`lowcomm.comm.hub`.

Each learner starts from the global parameters it last pulled, ``theta_pulled``, runs ``H_w``
inner steps, pushes its outer gradient ``g = theta_pulled - theta`` and waits for the reply:
the synchronizer's global parameters once it has applied g, and the learner's next ``H_w``. The
synchronizer applies each outer gradient as it arrives, whatever the global parameters have
become since the learner pulled (no learner waits for another), with delayed Nesterov momentum
(:class:`~lowcomm.optim.synchronizer.DelayedNesterov`, its period N the number of learners); it
measures each learner's speed from the step times it reports and gives it
``floor(v_w / max v * H)`` inner steps for its next round
(:func:`~lowcomm.optim.synchronizer.dynamic_local_steps`), so that slow learners push as often as
fast ones and their outer gradients are no staler.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from lowcomm.comm.hub import BYE, DONE
from lowcomm.optim.args import Args
from lowcomm.optim.diloco import InnerOptimizer, outer_step_errors
from lowcomm.optim.synchronizer import DelayedNesterov, dynamic_local_steps, seconds_field

__all__ = ["AsyncDiLoCoArgs", "AsyncLearner", "serve_async"]


@dataclass(kw_only=True)
class AsyncDiLoCoArgs(Args):
    """Asynchronous DiLoCo's arguments; defaults in ``configs/optimizer/async_diloco.yaml``.

    sync_every: H, a learner's inner steps per round (the fastest learner's, under dynamic local updates).
    dynamic_local_steps: whether the synchronizer gives each learner ``floor(v / max v * H)`` steps.
    outer_lr, outer_momentum: delayed Nesterov's (its period N: the number of learners).
    """

    config_name: ClassVar[str] = "async_diloco"

    sync_every: int
    dynamic_local_steps: bool
    outer_lr: float
    outer_momentum: float

    def errors(self) -> list[str]:
        return super().errors() + outer_step_errors(self.sync_every, self.outer_lr, self.outer_momentum)

PUSH = "push"  # learner -> synchronizer: {kind, steps, step, step_s} + its outer gradient, tensor for tensor
GLOBAL = "global"  # synchronizer -> learner: {kind, arrivals, local_steps} + the global parameters
# (a learner leaving says hub.DONE and is answered hub.BYE: lowcomm.comm.hub)


class AsyncLearner(torch.optim.Optimizer):
    """An asynchronous DiLoCo learner around any inner optimizer: after every ``local_steps``
    inner steps (the synchronizer's word for this learner's next round; ``base_steps`` at first)
    it pushes its outer gradient through ``link`` and continues from the global parameters of
    the reply."""

    def __init__(self, params: Sequence[torch.nn.Parameter], inner: InnerOptimizer, link, *, base_steps: int,
                 reply_timeout_s: float = 300.0):
        params = list(params)
        if base_steps < 1:
            raise ValueError(f"H is >= 1, got {base_steps}")
        super().__init__(params, dict(base_steps=base_steps))
        self.inner = inner(params) if callable(inner) else inner
        self.param_groups = self.inner.param_groups
        self.params, self.link = params, link
        self.local_steps, self.reply_timeout_s = base_steps, reply_timeout_s
        with torch.no_grad():
            self.pulled = [p.detach().clone() for p in params]
        self.local_step = 0
        self.steps_in_round = 0
        self.rounds = 0
        self._round_started = time.perf_counter()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = self.inner.step(closure)
        self.local_step += 1
        self.steps_in_round += 1
        if self.steps_in_round < self.local_steps:
            return loss
        step_s = (time.perf_counter() - self._round_started) / self.steps_in_round
        self.link.push({"kind": PUSH, "steps": self.steps_in_round, "step": self.local_step,
                        "step_s": seconds_field(step_s)},
                       [pulled - p.detach() for pulled, p in zip(self.pulled, self.params, strict=True)])
        reply = self.link.wait_for(lambda m: m.header.get("kind") == GLOBAL, timeout_s=self.reply_timeout_s)
        for param, pulled, value in zip(self.params, self.pulled, reply.tensors, strict=True):
            param.copy_(value.to(param.dtype))
            pulled.copy_(param)
        self.local_steps = int(reply.header["local_steps"])
        self.steps_in_round, self.rounds = 0, self.rounds + 1
        self._round_started = time.perf_counter()
        return loss

    def finish(self) -> None:
        """Leave the synchronizer (:meth:`~lowcomm.comm.hub.HubLink.leave`)."""
        self.link.leave(timeout_s=self.reply_timeout_s)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "pulled": [p.clone() for p in self.pulled],
                "local_step": self.local_step, "steps_in_round": self.steps_in_round,
                "local_steps": self.local_steps, "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.param_groups = self.inner.param_groups  # (the inner's load replaced its list: the schedule's groups)
        self.pulled = [p.clone() for p in state["pulled"]]
        self.local_step, self.steps_in_round = int(state["local_step"]), int(state["steps_in_round"])
        self.local_steps, self.rounds = int(state["local_steps"]), int(state["rounds"])


def serve_async(hub, parameters: Sequence[torch.Tensor], rule: DelayedNesterov, *, learners: int, base_steps: int,
                dynamic: bool = True, idle_timeout_s: float = 300.0, before_apply=None) -> list[int]:
    """Serve ``learners`` learners through ``hub`` until each has said it is done (or none has
    said anything for ``idle_timeout_s``): apply each arriving outer gradient to ``parameters``
    (the global ones, in place) by ``rule``, and answer its learner with them and its next number
    of inner steps (``dynamic``: by its speed, else H). ``before_apply(step)``: called before each
    outer gradient is applied with the learner's inner step it was pushed after. Returns the
    learners in the order their outer gradients were applied."""
    speeds: dict[int, float] = {}
    done: set[int] = set()
    order: list[int] = []
    while len(done) < learners:
        try:
            learner, message = hub.next(timeout=idle_timeout_s)
        except queue.Empty:
            break
        if message is None:  # lost: its speed no longer sets the others' steps
            speeds.pop(learner, None)
            continue
        kind = message.header.get("kind")
        if kind == DONE:
            done.add(learner)
            speeds.pop(learner, None)  # dynamic local updates are relative to the learners still training
            hub.send(learner, {"kind": BYE})
        elif kind == PUSH:
            if before_apply is not None:
                before_apply(int(message.header.get("step", 0)))
            rule.apply(parameters, message.tensors)
            order.append(learner)
            step_s = float(message.header["step_s"])
            if step_s > 0 and dynamic:
                speeds[learner] = 1.0 / step_s
            known = sorted(speeds)
            steps = dict(zip(known, dynamic_local_steps([speeds[m] for m in known], base_steps), strict=True)) \
                if known else {}
            hub.send(learner, {"kind": GLOBAL, "arrivals": rule.arrivals, "local_steps": steps.get(learner, base_steps)},
                     parameters)
    return order
