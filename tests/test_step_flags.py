"""The loop's per-step agreement on a stop request and a diverged loss: at once, or one boundary
late for a strategy whose exchange is in flight across the boundary (so that the flag does not
wait behind its bytes on a shared link), and at once wherever a checkpoint is due."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.config import validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.strategies import STRATEGIES
from lowcomm.train.loop import _StepFlags


def _run(flags: _StepFlags, plan: dict[int, tuple[bool, float]], due: set[int], steps: int = 6):
    """Each boundary's (stop, diverged, diverged_at) until the loop would leave."""
    out = []
    for boundary in range(1, steps + 1):
        requested, loss = plan.get(boundary, (False, 1.0))
        stop, diverged, at, _loss = flags.agree(boundary, requested, loss, math.isfinite(loss), now=boundary in due)
        out.append((boundary, stop, diverged, at))
        if stop or diverged:
            flags.drain()
            break
    return out


def test_at_once_a_request_stops_at_its_own_boundary():
    flags = _StepFlags(Communicator(), late=False)
    assert _run(flags, {2: (True, 1.0)}, due=set())[-1] == (2, True, False, 2)


def test_late_a_request_stops_one_boundary_later_and_a_divergence_names_its_own_step():
    assert _run(_StepFlags(Communicator(), late=True), {2: (True, 1.0)}, due=set())[-1] == (3, True, False, 3)
    assert _run(_StepFlags(Communicator(), late=True), {3: (False, math.nan)}, due=set())[-1] == (4, False, True, 3)


def test_late_a_boundary_that_saves_agrees_its_own_flags_at_once():
    # a diverged step never reaches a checkpoint, and a request at a checkpoint is heard there
    assert _run(_StepFlags(Communicator(), late=True), {4: (False, math.nan)}, due={4})[-1] == (4, False, True, 4)
    assert _run(_StepFlags(Communicator(), late=True), {4: (True, 1.0)}, due={4})[-1] == (4, True, False, 4)


def _two_ranks(rank: int, world: int) -> list:  # noqa: ARG001
    flags = _StepFlags(Communicator.world("cpu"), late=True)
    # only rank 1 is asked to stop, at boundary 2: both ranks leave together at boundary 3
    return _run(flags, {2: (rank == 1, 1.0)}, due={6})


def test_late_flags_leave_every_rank_at_the_same_boundary():
    assert spawn_workers(_two_ranks, 2) == [[(1, False, False, 1), (2, False, False, 2), (3, True, False, 3)]] * 2


@pytest.mark.parametrize("name", sorted(name for name, cls in STRATEGIES.items() if cls.exchange_spans_steps))
def test_a_strategy_whose_exchange_spans_steps_says_what_it_hides(name):
    """Agreeing the flags late is for an exchange that hides behind later steps: the strategy's
    comm_overlap (the wall-clock model's) must say so at its defaults."""
    raw = OmegaConf.to_container(compose([f"optimizer={name}"]), resolve=True)
    strategy, cfg = validate_optimizer(raw)
    assert strategy.comm_overlap(cfg, 155_648, compression=raw.get("compression")) > 0
