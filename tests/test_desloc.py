"""DES-LOC on three real gloo workers against a plain simulation of its equations.

The simulation below holds three copies of (theta, m, v) and applies, at step t = 1..20:
gradient at each worker's own theta; clip g; if t % K_u == 0 replace every worker's m by the
mean; m update; likewise v; if t % K_x == 0 replace every worker's theta by the mean; then the
local Adam(W) update from it (the paper's equations).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.optim.desloc import DESLoc, DESLocArgs
from lowcomm.strategies.desloc import DESLocConfig, DESLocStrategy

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD = 3
STEPS = 20
SHAPES = [(4, 3), (4,)]

# name -> DESLoc's arguments
RUNS = {
    # the paper's update: no bias correction, no weight decay; K_u, K_v default to 3 K_x, 6 K_x
    "paper": DESLocArgs(lr=0.02, betas=[0.9, 0.95], eps=1e-8, clip=0.5, sync_x=2, sync_u=None, sync_v=None,
                        weight_decay=0.0, bias_correction=False),
    "adamw": DESLocArgs(lr=0.02, betas=[0.8, 0.9], eps=1e-6, clip=None, sync_x=2, sync_u=3, sync_v=5,
                        weight_decay=0.1, bias_correction=True),
}


def _initial_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]


def _gradients(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    """Gradient of worker ``rank``'s loss at ``params`` on its batch for ``step``."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    inputs = torch.randn(8, 3, generator=generator, dtype=torch.float64)
    targets = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    leaves = [p.detach().clone().requires_grad_() for p in params]
    loss = 2.0 * ((torch.tanh(inputs @ leaves[0].T + leaves[1]) - targets) ** 2).sum()
    return list(torch.autograd.grad(loss, leaves))


def _train(optimizer: DESLoc, params, comm, rank, steps) -> tuple[list[list[torch.Tensor]], list[int]]:
    history, payload_bytes = [], []
    for step in steps:
        for param, grad in zip(params, _gradients(params, rank, step), strict=True):
            param.grad = grad
        optimizer.step()
        payload_bytes.append(int(comm.meter.end_step()["comm/payload_bytes"]))
        history.append([p.detach().clone() for p in params])
    return history, payload_bytes


def _worker(rank: int, world_size: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    results = {}
    for name, args in RUNS.items():
        comm = Communicator()
        params = [torch.nn.Parameter(p) for p in _initial_params()]
        history, payload_bytes = _train(
            DESLoc(params, args, comm=comm), params, comm, rank, range(1, STEPS + 1)
        )
        results[name] = {"history": history, "payload_bytes": payload_bytes}

    # Resume at step 9 (between every period's syncs) into fresh, differently initialised tensors.
    comm = Communicator()
    params = [torch.nn.Parameter(p) for p in _initial_params()]
    optimizer = DESLoc(params, RUNS["paper"], comm=comm)
    _train(optimizer, params, comm, rank, range(1, 10))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    params = [torch.nn.Parameter(torch.zeros_like(p)) for p in saved["params"]]
    optimizer = DESLoc(params, RUNS["paper"], comm=comm)
    with torch.no_grad():
        for param, value in zip(params, saved["params"], strict=True):
            param.copy_(value)
    optimizer.load_state_dict(saved["optimizer"])
    history, _ = _train(optimizer, params, comm, rank, range(10, STEPS + 1))
    results["resumed_final"] = history[-1]

    buffer = io.BytesIO()  # plain bytes: tensors through the queue would die with the worker
    torch.save(results, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def worker_results() -> list[dict]:
    return [torch.load(io.BytesIO(blob)) for blob in spawn_workers(_worker, WORLD)]


def _periods(args: DESLocArgs) -> tuple[int, int, int]:
    sync_x = args.sync_x
    return sync_x, args.sync_u or 3 * sync_x, args.sync_v or 6 * sync_x


def _simulate(args: DESLocArgs) -> tuple[list[list[list[torch.Tensor]]], int]:
    """history[step][rank][param] and how many gradient coordinates the clip changed."""
    lr, (beta1, beta2), eps, clip = args.lr, args.betas, args.eps, args.clip
    weight_decay, bias_correction = args.weight_decay, args.bias_correction
    sync_x, sync_u, sync_v = _periods(args)
    theta = [_initial_params() for _ in range(WORLD)]
    m = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(WORLD)]
    v = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(WORLD)]

    def replace_by_mean(copies: list[list[torch.Tensor]]) -> None:
        for index in range(len(SHAPES)):
            mean = sum(copies[rank][index] for rank in range(WORLD)) / WORLD
            for rank in range(WORLD):
                copies[rank][index] = mean.clone()

    history, clipped = [], 0
    for t in range(1, STEPS + 1):
        grads = [_gradients(theta[rank], rank, t) for rank in range(WORLD)]
        if clip is not None:
            clipped += sum(int((g.abs() > clip).sum()) for per_rank in grads for g in per_rank)
            grads = [[g.clamp(-clip, clip) for g in per_rank] for per_rank in grads]
        if t % sync_u == 0:
            replace_by_mean(m)
        if t % sync_v == 0:
            replace_by_mean(v)
        if t % sync_x == 0:
            replace_by_mean(theta)
        for rank in range(WORLD):
            for i, g in enumerate(grads[rank]):
                m[rank][i] = beta1 * m[rank][i] + (1 - beta1) * g
                v[rank][i] = beta2 * v[rank][i] + (1 - beta2) * g * g
                m_hat = m[rank][i] / (1 - beta1**t) if bias_correction else m[rank][i]
                v_hat = v[rank][i] / (1 - beta2**t) if bias_correction else v[rank][i]
                decayed = theta[rank][i] * (1 - lr * weight_decay)
                theta[rank][i] = decayed - lr * m_hat / (v_hat.sqrt() + eps)
        history.append([[p.clone() for p in theta[rank]] for rank in range(WORLD)])
    return history, clipped


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_matches_simulation_of_the_equations(worker_results, run):
    expected, clipped = _simulate(RUNS[run])
    if RUNS[run].clip is not None:
        assert clipped > 0  # the clip is exercised
    for step in range(STEPS):
        for rank in range(WORLD):
            for observed, wanted in zip(
                worker_results[rank][run]["history"][step], expected[step][rank], strict=True
            ):
                torch.testing.assert_close(
                    observed, wanted, rtol=1e-9, atol=1e-11, msg=f"{run}: step {step + 1}, rank {rank}"
                )


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_the_parameter_average_is_taken_before_the_local_update(worker_results, run):
    """Right after a step with t % K_x == 0, theta_{t+1} = mean(theta_t) - lr u_t^m: the workers
    still differ by their own updates (averaging after the update would make them equal)."""
    sync_x = RUNS[run].sync_x
    for step in range(sync_x, STEPS + 1, sync_x):
        per_rank = [torch.cat([p.flatten() for p in worker_results[r][run]["history"][step - 1]])
                    for r in range(WORLD)]
        assert not all(torch.equal(per_rank[0], other) for other in per_rank[1:]), f"{run}: step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_bytes_follow_each_period(worker_results, run):
    sync_x, sync_u, sync_v = _periods(RUNS[run])
    state_bytes = sum(torch.Size(s).numel() for s in SHAPES) * 8  # float64
    expected = [
        state_bytes * sum(step % period == 0 for period in (sync_x, sync_u, sync_v))
        for step in range(1, STEPS + 1)
    ]
    for rank in range(WORLD):
        assert worker_results[rank][run]["payload_bytes"] == expected
    amortised = DESLoc.amortized_payload_bytes(
        SHAPES, sync_x, RUNS[run].sync_u, RUNS[run].sync_v, torch.float64
    )
    assert amortised == pytest.approx(state_bytes * (1 / sync_x + 1 / sync_u + 1 / sync_v))


@pytest.mark.slow
def test_resume_from_state_dict_is_bit_identical(worker_results):
    for rank in range(WORLD):
        for resumed, straight in zip(
            worker_results[rank]["resumed_final"], worker_results[rank]["paper"]["history"][-1], strict=True
        ):
            assert torch.equal(resumed, straight)


def test_config_file_strategy_and_amortised_bytes():
    fields = OmegaConf.load(CONFIGS / "optimizer" / "desloc.yaml")
    assert fields.pop("name") == "desloc"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DESLocConfig), fields))
    assert cfg.validate() == []
    assert (cfg.sync_x, cfg.sync_u, cfg.sync_v, cfg.clip, cfg.bias_correction) == (10, None, None, 1.0, False)
    assert DESLocConfig.defaults(sync_x=0, clip=-1.0).validate() == [
        "optimizer.clip must be null or > 0, got -1.0",
        "optimizer.sync_x must be >= 1, got 0",
    ]

    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    strategy = DESLocStrategy(cfg, {"name": "none"}, Communicator())
    wrapped, optimizer = strategy.build(model)
    assert wrapped is model and isinstance(optimizer, DESLoc)
    assert (optimizer.sync_x, optimizer.sync_u, optimizer.sync_v) == (10, 30, 60)
    numel = sum(p.numel() for p in model.parameters())
    assert strategy.analytic_payload_bytes(model) == pytest.approx(numel * 4 * (1 / 10 + 1 / 30 + 1 / 60))
