"""Asynchronous DiLoCo (lowcomm.optim.async_diloco) over a real hub, learners in processes of
their own: one learner's run against a hand-worked trajectory; two of unequal speed, where the
slow one is given fewer inner steps a round (dynamic local updates) and the bytes balance."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from lowcomm.comm.hub import SYNC, Hub, HubLink
from lowcomm.comm.meter import CommMeter
from lowcomm.comm.spawn import spawn_workers
from lowcomm.optim.async_diloco import AsyncLearner, serve_async
from lowcomm.optim.synchronizer import DelayedNesterov

TARGET, INNER_LR = 3.0, 0.1


def _learner(rank: int, world: int, address: str, rounds: int, base_steps: int, pause_s: float,  # noqa: ARG001
             slow_done: str | None = None) -> dict:
    """Minimise (theta - 3)^2 from theta = 1 by inner SGD, ``rounds`` rounds; rank r sleeps
    ``r * pause_s`` after each inner step (a slower device). With ``slow_done`` (a path), the
    slow rank marks it when it has done its rounds and the fast one trains on until then, so
    that every round of the slow one is given while both train."""
    meter = CommMeter()
    link = HubLink(address, learner=rank, meter=meter)
    if slow_done:  # both connected before either trains (a process can start seconds late in a busy suite)
        Path(f"{slow_done}.ready{rank}").touch()
        while not all(Path(f"{slow_done}.ready{r}").exists() for r in range(world)):
            time.sleep(0.01)
    theta = torch.nn.Parameter(torch.tensor([1.0]))
    learner = AsyncLearner([theta], lambda ps: torch.optim.SGD(ps, lr=INNER_LR), link, base_steps=base_steps)
    local_steps = []
    while learner.rounds < rounds or (slow_done and rank == 0 and not Path(slow_done).exists()):
        loss = ((theta - TARGET) ** 2).sum()
        loss.backward()
        before = learner.rounds
        learner.step()
        learner.zero_grad()
        time.sleep(rank * pause_s)
        if learner.rounds > before:
            local_steps.append(learner.local_steps)
    if slow_done and rank == 1:
        Path(slow_done).touch()
    learner.finish()
    return {"theta": theta.item(), "local_steps": local_steps,
            **{kind: meter.cumulative_bytes(kind, purpose=SYNC) for kind in ("payload", "tx", "rx")}}


def _serve(learners: int, base_steps: int, period: int):
    hub = Hub("127.0.0.1")
    global_theta = [torch.tensor([1.0])]
    rule = DelayedNesterov(lr=0.7, momentum=0.9, period=period)
    result: dict = {}
    server = threading.Thread(target=lambda: result.update(order=serve_async(
        hub, global_theta, rule, learners=learners, base_steps=base_steps, idle_timeout_s=60)))
    server.start()
    return hub, server, global_theta, result


def test_one_learner_follows_the_hand_worked_rounds():
    hub, server, global_theta, result = _serve(1, base_steps=2, period=1)
    try:
        (learner,) = spawn_workers(_learner, 1, f"127.0.0.1:{hub.port}", 3, 2, 0.0, backend=None)
        server.join(timeout=60)
    finally:
        hub.close()
    # by hand: each round two SGD steps on (theta - 3)^2 from the pulled value p (theta -= 0.2
    # (theta - 3), so p -> 3 - 0.64 (3 - p)), g = p - theta; the synchronizer's Nesterov (N = 1):
    # m = 0.9 m + g; p -= 0.7 (g + 0.9 m)
    pulled, momentum = 1.0, 0.0
    for _ in range(3):
        trained = 3 - 0.64 * (3 - pulled)
        g = pulled - trained
        momentum = 0.9 * momentum + g
        pulled -= 0.7 * (g + 0.9 * momentum)
    assert learner["theta"] == pytest.approx(pulled, rel=1e-6)
    assert global_theta[0].item() == pytest.approx(pulled, rel=1e-6)
    assert result["order"] == [0, 0, 0] and learner["local_steps"] == [2, 2, 2]


def test_a_slow_learner_is_given_fewer_inner_steps_and_the_bytes_balance(tmp_path):
    hub, server, global_theta, result = _serve(2, base_steps=6, period=2)
    try:
        fast, slow = spawn_workers(_learner, 2, f"127.0.0.1:{hub.port}", 3, 6, 0.05, str(tmp_path / "slow-done"),
                                   backend=None)
        server.join(timeout=60)
    finally:
        hub.close()
    # the slow learner (0.05 s a step against the fast one's microseconds) is given fewer steps
    # once the synchronizer has seen both speeds (its last round at the latest), the fast one H
    assert slow["local_steps"][-1] < 6 and set(fast["local_steps"]) == {6}
    rounds_of_fast = len(fast["local_steps"])
    assert sorted(result["order"]) == [0] * rounds_of_fast + [1, 1, 1]  # in arrival order, each round once
    assert global_theta[0].item() != 1.0
    hub_bytes = {kind: hub.meter.cumulative_bytes(kind, purpose=SYNC) for kind in ("payload", "tx", "rx")}
    assert fast["tx"] + slow["tx"] == hub_bytes["rx"] and fast["rx"] + slow["rx"] == hub_bytes["tx"]
    # each push and each reply carries one float32: 4 bytes of payload
    assert fast["payload"] == rounds_of_fast * 4 and slow["payload"] == 3 * 4
    assert hub_bytes["payload"] == 2 * (rounds_of_fast + 3) * 4
