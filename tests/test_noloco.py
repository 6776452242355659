"""NoLoCo on real gloo workers against its equations written out here in plain torch.

Each worker holds two float64 tensors and minimises 0.5 ||theta - target(rank, step)||^2 with an
SGD inner step, so every inner step is theta <- theta - lr (theta - target) by hand. The
workers start from different weights (the method starts them equal; unequal starts make the
pull toward the peer's outer weights matter from the first outer step, so that a wrong gamma
fails here). The simulation keeps W replicas and applies, at every H-th step, in each group g:

    delta_i <- alpha delta_i - beta mean_g(phi_j - theta_j) - gamma (phi_i - mean_g(phi_j))
    phi_i <- phi_i + delta_i;  theta_i <- phi_i

W = 2 is one pair, W = 3 one group of three (every rank exchanges with both others): both
pairings are fixed whatever the seed. W = 4 draws pairs; there the simulation takes the pairs
from ``peer_groups``, which the tests at the end check on their own (the same on every rank,
seeded, every rank in one group).
"""

from __future__ import annotations

import io

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.optim.noloco import NoLoCo, NoLoCoArgs, peer_groups
from lowcomm.strategies.noloco import NoLoCoConfig, NoLoCoStrategy

SHAPES = ((3, 2), (4,))
LR = 0.1
ARGS = NoLoCoArgs(sync_every=3, outer_lr=0.7, outer_momentum=0.5, pull=0.4)
STEPS = 6  # two outer steps
SEED = 11
BYTES_PER_SYNC = 2 * (6 + 4) * 8  # outer and current weights, float64


def _start(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]


def _targets(rank: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]


def _optimizer(params, comm) -> NoLoCo:
    return NoLoCo(params, lambda ps: torch.optim.SGD(ps, lr=LR), ARGS, comm=comm, seed=SEED)


def _train(params, optimizer, comm, rank, steps) -> tuple[list[list[torch.Tensor]], list[dict]]:
    history, metered = [], []
    for step in steps:
        loss = sum(0.5 * (p - t).square().sum() for p, t in zip(params, _targets(rank, step), strict=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        metered.append(comm.meter.end_step())
        history.append([p.detach().clone() for p in params])
    return history, metered


def _worker(rank: int, world_size: int) -> dict:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    comm = Communicator()
    params = [torch.nn.Parameter(t) for t in _start(rank)]
    optimizer = _optimizer(params, comm)
    history, metered = _train(params, optimizer, comm, rank, range(1, STEPS + 1))
    result = {"history": history, "metered": metered, "peers": [optimizer.peers(k) for k in range(1, 6)]}

    # stopped after step 4 (mid-period: H = 3) and after step 3 (an outer step: the state leaves
    # the parameters out, they are the outer weights there), resumed into fresh tensors from it
    for stop, name in ((4, "resumed"), (3, "resumed_at_outer_step")):
        params = [torch.nn.Parameter(t) for t in _start(rank)]
        optimizer = _optimizer(params, comm)
        _train(params, optimizer, comm, rank, range(1, stop + 1))
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in SHAPES]
        optimizer = NoLoCo(params, lambda ps: torch.optim.SGD(ps, lr=LR), ARGS, comm=comm, seed=0)
        state = torch.load(buffer)
        result[f"{name}_keys"] = sorted(state)
        optimizer.load_state_dict(state)
        resumed, _ = _train(params, optimizer, comm, rank, range(stop + 1, STEPS + 1))
        result[f"{name}_final"] = resumed[-1]
    return result


def _simulate(world: int, groups_at) -> list[list[list[torch.Tensor]]]:
    """history[step][rank]: every replica's weights after each step, by the equations alone."""
    theta = [_start(rank) for rank in range(world)]
    phi = [[t.clone() for t in weights] for weights in theta]
    delta = [[torch.zeros_like(t) for t in weights] for weights in theta]
    alpha, beta, gamma = ARGS.outer_momentum, ARGS.outer_lr, ARGS.pull
    history = []
    for step in range(1, STEPS + 1):
        for rank in range(world):
            theta[rank] = [w - LR * (w - t) for w, t in zip(theta[rank], _targets(rank, step), strict=True)]
        if step % ARGS.sync_every == 0:
            new_phi = [None] * world
            for group in groups_at(step // ARGS.sync_every):
                for rank in group:
                    updated = []
                    for index in range(len(SHAPES)):
                        mean_phi = sum(phi[j][index] for j in group) / len(group)
                        mean_pseudo = sum(phi[j][index] - theta[j][index] for j in group) / len(group)
                        delta[rank][index] = (alpha * delta[rank][index] - beta * mean_pseudo
                                              - gamma * (phi[rank][index] - mean_phi))
                        updated.append(phi[rank][index] + delta[rank][index])
                    new_phi[rank] = updated
            phi = new_phi
            theta = [[t.clone() for t in weights] for weights in phi]
        history.append([[t.clone() for t in weights] for weights in theta])
    return history


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_two_outer_steps_match_the_hand_derived_ones(world):
    results = spawn_workers(_worker, world)
    fixed = {2: lambda _k: [[0, 1]], 3: lambda _k: [[0, 1, 2]]}
    expected = _simulate(world, fixed.get(world, lambda k: peer_groups(world, SEED, k)))
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["history"], expected, strict=True), start=1):
            for g, w in zip(got, want[rank], strict=True):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"rank {rank} step {step}")
        # resumed mid-period, and at an outer step, from the saved state: bit-identical to the
        # uninterrupted run; only the first state holds the parameters
        for name in ("resumed", "resumed_at_outer_step"):
            for g, w in zip(result[f"{name}_final"], result["history"][-1], strict=True):
                assert torch.equal(g, w), name
        assert "local_params" in result["resumed_keys"]
        assert "local_params" not in result["resumed_at_outer_step_keys"]
        # bytes only at the outer steps (3 and 6): both copies to every peer, as much back
        peers = 2 if world == 3 else 1
        for step, metrics in enumerate(result["metered"], start=1):
            sync = step % ARGS.sync_every == 0
            assert metrics["comm/payload_bytes"] == (BYTES_PER_SYNC if sync else 0)
            assert metrics["comm/tx_bytes"] == metrics["comm/rx_bytes"] == (BYTES_PER_SYNC * peers if sync else 0)
            assert metrics["comm/messages"] == (2 * len(SHAPES) * peers if sync else 0)
    # the pairing is the same on every rank: whoever names a peer is named by it
    for step in range(5):
        for rank, result in enumerate(results):
            assert all(rank in results[peer]["peers"][step] for peer in result["peers"][step])
            assert len(result["peers"][step]) == (2 if world == 3 else 1)


def test_pairs_are_seeded_by_the_run_and_the_outer_step():
    draws = [peer_groups(4, SEED, step) for step in range(60)]
    assert draws == [peer_groups(4, SEED, step) for step in range(60)]  # a resumed run draws the same
    # redrawn every outer step: all three pairings of four ranks occur
    assert len({frozenset(frozenset(group) for group in groups) for groups in draws}) == 3
    assert [peer_groups(4, SEED + 1, step) for step in range(60)] != draws  # another seed, other pairs
    for world in (1, 2, 3, 5, 8, 9):
        for step in range(20):
            groups = peer_groups(world, SEED, step)
            assert sorted(rank for group in groups for rank in group) == list(range(world))
            # pairs, and an odd W's last group has three (one rank alone only when W = 1)
            sizes = sorted(len(group) for group in groups)
            assert sizes == ([1] if world == 1 else [2] * (world // 2 - 1) + [3] if world % 2 else [2] * (world // 2))


def test_the_strategy_draws_pairs_from_the_run_seed_and_counts_one_peer_per_outer_step():
    torch.manual_seed(77)  # what the loop's build_model(seed=run.seed) leaves behind
    model = torch.nn.Linear(4, 3)
    cfg = NoLoCoConfig(**{**vars(NoLoCoConfig.defaults()), "sync_every": 10})
    strategy = NoLoCoStrategy(cfg, {"name": "none"}, Communicator())
    _, optimizer = strategy.build(model)
    assert optimizer.seed == 77
    parameters_bytes = (4 * 3 + 3) * 4
    # outer and current weights to one peer every 10 steps: the same tx per worker at any even W
    for world in (2, 64, 4096):
        payload, tx, rx, direct = strategy.analytic_traffic(model, world)
        assert payload == tx == rx == direct == 2 * parameters_bytes / 10
    # W = 3: all three send to two peers; W = 5: three of five do
    assert strategy.analytic_traffic(model, 3).tx == 2 * (2 * parameters_bytes) / 10
    assert strategy.analytic_traffic(model, 5).tx == pytest.approx((2 * parameters_bytes) * 8 / 5 / 10, abs=0.1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="pull must be >= 0"):
        NoLoCoArgs(sync_every=3, outer_lr=0.7, outer_momentum=0.5, pull=-1.0).check()
    with pytest.raises(ValueError, match="outer_momentum must be in"):
        NoLoCoArgs(sync_every=3, outer_lr=0.7, outer_momentum=1.0, pull=0.7).check()
