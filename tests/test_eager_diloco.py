"""Eager DiLoCo on real gloo workers against steps worked out by hand, the naive delayed rule
beside it, a three-worker Nesterov run against a plain-torch simulation, exact resume with the
exchange in flight, and its bytes, overlap and checkpoint layout.

The hand-worked case: one scalar parameter x = 0, W = 2, H = 2, outer lr 0.5 without momentum,
inner SGD with lr 1 and gradient c_r x k on rank r in phase k (c = (1, 3); phase k = steps
2k - 1 and 2k). The mean of outer step t arrives at outer step t + 1.

Eager, D_m = (Delta_m^t + sum_{j != m} Delta_j^(t-1)) / W (no mean yet at t = 1):

  t=1,2  x = (-1, -3), (-2, -6).      Delta^1 = (2, 6), mean 4 sent.  D = (1, 3)
         theta^1 = 0 - 0.5 D = (-0.5, -1.5) = x after step 2.
  t=3,4  x = (-2.5, -7.5), (-4.5, -13.5).  Delta^2 = theta^1 - x = (4, 12), mean 8 sent.
         D = 4 + (Delta^2 - Delta^1) / 2 = (5, 7)  [= (4 + 6) / 2, (12 + 2) / 2]
         theta^2 = (-0.5 - 2.5, -1.5 - 3.5) = (-3, -5).
  t=5,6  x = (-6, -14), (-9, -23).     Delta^3 = (6, 18).  D = 8 + (Delta^3 - Delta^2) / 2 = (9, 11)
         theta^3 = (-3 - 4.5, -5 - 5.5) = (-7.5, -10.5).

Delayed (the paper's naive rule), D = the arrived mean:

  t=1,2  x = (-1, -3), then theta^1 = 0 (nothing arrived): (0, 0).
  t=3,4  x = (-2, -6), (-4, -12).  Delta^2 = (4, 12); D = 4: theta^2 = -2 on both.
  t=5,6  x = (-5, -11), (-8, -20).  Delta^3 = (6, 18); D = 8: theta^3 = -6 on both.

Scalars are exact in E3M0 (each is its own scale), so the same numbers hold through the
quantized all-reduce and the all-gather.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.compress.e3m0 import E3M0
from lowcomm.config import ConfigError, validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.models import ModelSpec, build_model
from lowcomm.optim.diloco import DiLoCo, DiLoCoArgs
from lowcomm.optim.eager_diloco import EagerDiLoCo, EagerDiLoCoArgs
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.diloco import DiLoCoConfig, DiLoCoStrategy
from lowcomm.strategies.eager_diloco import EagerDiLoCoConfig, EagerDiLoCoStrategy
from runs import DroppingComm, kill_resume_and_compare, tensor_bytes

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD = 2
SCALE = (1.0, 3.0)
EXPECTED = {
    "eager": [(-1, -3), (-0.5, -1.5), (-2.5, -7.5), (-3, -5), (-6, -14), (-7.5, -10.5)],
    "delayed": [(-1, -3), (0, 0), (-2, -6), (-2, -2), (-5, -11), (-6, -6)],
}
# (mode, codec, exchange) of each hand-worked run
WIRES = {
    "eager": ("eager", None, "all_reduce"),
    "delayed": ("delayed", None, "all_reduce"),
    "eager_e3m0": ("eager", E3M0(), "all_reduce"),
    "eager_e3m0_gather": ("eager", E3M0(), "all_gather"),
}


def _optimizer(param, comm, mode="eager", codec=None, exchange="all_reduce"):
    args = EagerDiLoCoArgs.defaults(sync_every=2, outer_lr=0.5, outer_momentum=0.0, mode=mode, exchange=exchange)
    return EagerDiLoCo([param], lambda ps: torch.optim.SGD(ps, lr=1.0), args, compressor=codec, comm=comm)


def _run(optimizer, param, comm, rank, steps):
    history, payload = [], []
    for step in steps:
        param.grad = torch.tensor([SCALE[rank] * (step // 2 + 1)], dtype=torch.float64)
        optimizer.step()
        payload.append(int(comm.meter.end_step()["comm/payload_bytes"]))
        history.append(param.item())
    return history, payload


def _scalar():
    return torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))


# ---------------------------------------------------------------------------- three workers, Nesterov
SIM_WORLD, SIM_STEPS, SIM_H, INNER_LR = 3, 9, 3, 0.1
SIM_OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)


def _gradient(rank: int, step: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + step), dtype=torch.float64)


def _start() -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _simulate() -> list[list[torch.Tensor]]:
    """Every worker's parameter after each step, in one process: plain SGD inside, the eager
    direction written out from the workers' pseudo-gradients, torch's formula for Nesterov
    momentum (b = mu b + D; theta -= lr (D + mu b))."""
    W, mu, lr = SIM_WORLD, SIM_OUTER["outer_momentum"], SIM_OUTER["outer_lr"]
    theta = [_start() for _ in range(W)]
    local = [t.clone() for t in theta]
    momentum = [torch.zeros_like(t) for t in theta]
    previous = None  # every worker's pseudo-gradient of the last outer step
    history = []
    for step in range(SIM_STEPS):
        for m in range(W):
            local[m] = local[m] - INNER_LR * _gradient(m, step, local[m].shape)
        if (step + 1) % SIM_H == 0:
            fresh = [theta[m] - local[m] for m in range(W)]
            for m in range(W):
                stale_others = sum(previous[j] for j in range(W) if j != m) if previous is not None else 0.0
                direction = (fresh[m] + stale_others) / W
                momentum[m] = mu * momentum[m] + direction
                theta[m] = theta[m] - lr * (direction + mu * momentum[m])
                local[m] = theta[m].clone()
            previous = fresh
        history.append([t.clone() for t in local])
    return history


def _nesterov_run(comm: Communicator, rank: int) -> list[torch.Tensor]:
    param = torch.nn.Parameter(_start())
    args = EagerDiLoCoArgs.defaults(sync_every=SIM_H, mode="eager", **SIM_OUTER)
    optimizer = EagerDiLoCo([param], lambda ps: torch.optim.SGD(ps, lr=INNER_LR), args, comm=comm)
    history = []
    for step in range(SIM_STEPS):
        param.grad = _gradient(rank, step, param.shape)
        optimizer.step()
        history.append(param.detach().clone())
    return history


def _nesterov_worker(rank: int, world_size: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    out = io.BytesIO()
    torch.save(_nesterov_run(Communicator(), rank), out)
    return out.getvalue()


# ---------------------------------------------------------------------------- two workers, by hand
def _worker(rank: int, world_size: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    results = {}
    for name, (mode, codec, exchange) in WIRES.items():
        comm, param = Communicator(), _scalar()
        results[name] = _run(_optimizer(param, comm, mode, codec, exchange), param, comm, rank, range(6))

    # killed after step 3: step 2's exchange is in flight (due at step 4) with this rank's Delta^1
    comm, param = Communicator(), _scalar()
    optimizer = _optimizer(param, comm)
    _run(optimizer, param, comm, rank, range(3))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    param = _scalar()
    optimizer = _optimizer(param, comm)
    optimizer.load_state_dict(saved)  # the worker's own parameters come with the optimizer state
    results["saved"] = {key: [t.item() for t in saved[key]] for key in ("in_flight_mean", "own_delta",
                                                                         "global_params")}
    results["resumed"] = _run(optimizer, param, comm, rank, range(3, 6))[0]
    out = io.BytesIO()
    torch.save(results, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def worker_results() -> list[dict]:
    return [torch.load(io.BytesIO(blob)) for blob in spawn_workers(_worker, WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("wire", list(WIRES))
def test_steps_match_the_hand_worked_example(worker_results, wire):
    expected = EXPECTED[WIRES[wire][0]]
    for rank in range(WORLD):
        history, _ = worker_results[rank][wire]
        assert history == [step[rank] for step in expected], f"rank {rank}"


@pytest.mark.slow
def test_eager_workers_differ_after_each_outer_step_and_delayed_ones_agree(worker_results):
    eager = [worker_results[rank]["eager"][0] for rank in range(WORLD)]
    delayed = [worker_results[rank]["delayed"][0] for rank in range(WORLD)]
    for outer_step in (1, 3, 5):
        assert eager[0][outer_step] != eager[1][outer_step]
        assert delayed[0][outer_step] == delayed[1][outer_step]


@pytest.mark.slow
def test_each_outer_step_sends_the_parameters_once(worker_results):
    for rank in range(WORLD):
        assert worker_results[rank]["eager"][1] == [0, 8, 0, 8, 0, 8]  # one float64 scalar
        # E3M0: one byte of codes and a float32 scale, all-reduced (one rank's chunk) or all-gathered
        assert worker_results[rank]["eager_e3m0"][1] == worker_results[rank]["eager_e3m0_gather"][1] == [
            0, 5, 0, 5, 0, 5]


@pytest.mark.slow
def test_resume_with_the_exchange_in_flight_is_bit_identical(worker_results):
    for rank in range(WORLD):
        saved = worker_results[rank]["saved"]
        # after step 3: step 2's mean (4) on its way, this worker's Delta^1 and theta^1 its own
        assert saved == {"in_flight_mean": [4.0], "own_delta": [(2.0, 6.0)[rank]],
                         "global_params": [(-0.5, -1.5)[rank]]}
        assert worker_results[rank]["resumed"] == worker_results[rank]["eager"][0][3:]


@pytest.mark.slow
def test_three_workers_with_nesterov_momentum_match_the_simulation():
    results = [torch.load(io.BytesIO(blob)) for blob in spawn_workers(_nesterov_worker, SIM_WORLD)]
    simulated = _simulate()
    for rank in range(SIM_WORLD):
        for step, (ours, theirs) in enumerate(zip(results[rank], simulated, strict=True)):
            torch.testing.assert_close(ours, theirs[rank], rtol=0, atol=1e-12, msg=f"rank {rank}, step {step + 1}")
    assert not torch.equal(results[0][-1], results[1][-1])  # every worker its own outer parameters


def test_one_worker_is_diloco():
    """W = 1: the arrived mean is the worker's own stale pseudo-gradient, so the eager direction
    is the fresh one, DiLoCo's (up to the rounding of mean + fresh - stale)."""
    start = _start()
    params = [torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())]
    args = dict(sync_every=3, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    inner = lambda ps: torch.optim.AdamW(ps, lr=0.05)  # noqa: E731
    optimizers = [EagerDiLoCo([params[0]], inner, EagerDiLoCoArgs.defaults(mode="eager", **args)),
                  DiLoCo([params[1]], inner, DiLoCoArgs.defaults(**args))]
    for step in range(12):
        for param, optimizer in zip(params, optimizers, strict=True):
            param.grad = _gradient(0, step, param.shape)
            optimizer.step()
        torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-12, msg=f"step {step + 1}")
    assert not torch.equal(params[0].detach(), start)


# ---------------------------------------------------------------------------- config, strategy
def test_config_file_holds_the_paper_settings_and_validates():
    fields = OmegaConf.load(CONFIGS / "optimizer" / "eager_diloco.yaml")
    assert fields.pop("name") == "eager_diloco"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EagerDiLoCoConfig), fields))
    assert cfg.validate() == []
    assert (cfg.sync_every, cfg.mode, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov, cfg.error_feedback) == (
        30, "eager", 0.7, 0.9, True, None)
    assert EagerDiLoCoConfig.defaults(mode="stale", error_feedback=0.9).validate() == [
        "optimizer.mode must be one of eager, delayed, got 'stale'",
        "optimizer.error_feedback must be null (eager DiLoCo has no error feedback), got 0.9",
    ]
    assert STRATEGIES["eager_diloco"] is EagerDiLoCoStrategy


def test_a_bad_mode_is_one_line_naming_the_key():
    raw = OmegaConf.to_container(compose(["optimizer=eager_diloco", "optimizer.mode=eagre"]), resolve=True)
    with pytest.raises(ConfigError, match=r"optimizer\.mode must be one of eager, delayed, got 'eagre'"):
        validate_optimizer(raw)


def test_bytes_are_diloco_s_and_the_state_is_per_rank():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    eager = EagerDiLoCoStrategy(EagerDiLoCoConfig.defaults(sync_every=8), {"name": "none"}, Communicator())
    diloco = DiLoCoStrategy(DiLoCoConfig.defaults(sync_every=8), {"name": "none"}, Communicator())
    params = 4 * (64 + 32)
    assert eager.analytic_payload_bytes(model) == diloco.analytic_payload_bytes(model) == params / 8
    assert eager.analytic_traffic(model, 4) == diloco.analytic_traffic(model, 4)
    # per rank: outer parameters, outer momentum, local parameters, AdamW's two moments, the
    # mean in flight and the worker's last Delta; nothing is written once for all ranks
    assert eager.optimizer_state_bytes(model, 1) == (0.0, 7 * params)
    delayed = EagerDiLoCoStrategy(EagerDiLoCoConfig.defaults(mode="delayed"), {"name": "none"}, Communicator())
    assert delayed.optimizer_state_bytes(model, 1) == (0.0, 6 * params)
    assert EagerDiLoCoStrategy.replicated_state_keys == () and not EagerDiLoCoStrategy.replicated_optimizer_state
    _, optimizer = eager.build(model)
    assert type(optimizer) is EagerDiLoCo and optimizer.sync_every == 8
    for _ in range(8):  # one outer step in one process: every piece of state exists
        model(torch.randn(3, 8)).square().mean().backward()
        optimizer.step()
    # at the outer step the local parameters are the outer ones: the state leaves them out
    assert tensor_bytes(optimizer.state_dict()) == 6 * params == eager.checkpoint_bytes(model, 1, at_boundary=True)[1]
    model(torch.randn(3, 8)).square().mean().backward()
    optimizer.step()
    assert tensor_bytes(optimizer.state_dict()) == 7 * params



def test_the_whole_exchange_hides_behind_the_next_inner_phase():
    """Dense or all-gathered: in flight for all H steps; the quantized all-reduce: its all-to-all
    (half of its bytes) only, its all-gather runs when the mean is needed."""
    cfg = EagerDiLoCoConfig.defaults()
    assert EagerDiLoCoStrategy.comm_overlap(cfg, 319_946_752) == 1.0
    assert EagerDiLoCoStrategy.comm_overlap(cfg, 319_946_752, {"name": "none"}) == 1.0
    assert EagerDiLoCoStrategy.comm_overlap(cfg, 319_946_752, {"name": "quantize"}) == 0.5
    gathered = EagerDiLoCoConfig.defaults(exchange="all_gather")
    assert EagerDiLoCoStrategy.comm_overlap(gathered, 319_946_752, {"name": "quantize"}) == 1.0
    assert DiLoCoStrategy.comm_overlap(DiLoCoConfig.defaults(), 319_946_752, {"name": "none"}) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(("model", "parameters"), [("olmo_300m", 319_946_752), ("olmo_1b", 1_176_764_416)])
def test_comm_table_rows_for_the_paper_models(model, parameters):
    """Dense: every fp32 parameter once per H, a ring all-reduce's 2 (W-1)/W of it each way."""
    from lowcomm.report.comm_table import build_table  # noqa: PLC0415 - report sits above this test's subject

    rows = build_table([model], 64, [(label, ["optimizer=eager_diloco", *overrides], False)
                                     for label, overrides in (("H=10", ["optimizer.sync_every=10"]),
                                                              ("H=100", ["optimizer.sync_every=100"]))])
    for row, sync_every in zip(rows, (10, 100), strict=True):
        assert row.payload_mb * 1e6 == pytest.approx(4 * parameters / sync_every)
        assert row.tx_mb * 1e6 == pytest.approx(2 * 63 / 64 * 4 * parameters / sync_every)
    meta = build_model(ModelSpec(**OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{model}.yaml"))),
                       "meta")
    assert sum(p.numel() for p in meta.parameters()) == parameters


@pytest.mark.slow
def test_sigkill_with_the_exchange_in_flight_then_resume_is_bit_identical(tmp_path):
    # H = 2: outer steps at 2 and 4; the step-5 checkpoint holds step 4's exchange in flight
    kill_resume_and_compare(tmp_path, "optimizer=eager_diloco", "optimizer.sync_every=2", "optimizer.lr=3e-3")


def test_a_dropped_exchanges_mean_is_never_applied_and_a_restored_one_asks_no_quorum_but_a_heal():
    """x = 0, H = 2, outer lr 0.5, SGD lr 1, gradient k in phase k, one worker. Outer step 1:
    x = -1, -2, Delta^1 = 2, applied at once (W = 1): theta^1 = -1. Outer step 2: x = -3, -5,
    Delta^2 = 4; step 1's exchange is dropped, so its own term is taken back with no mean in
    its place: D = 4 - 2 = 2, theta^2 = -2, as if only Delta^2 had ever been applied."""
    comm = DroppingComm()
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = _optimizer(param, comm)
    history = []
    for phase in (1, 1, 2, 2):
        param.grad = torch.tensor([float(phase)], dtype=torch.float64)
        optimizer.step()
        history.append(param.item())
    assert history == [-1, -1, -3, -2] and comm.commits == 1
    # resumed with step 2's exchange in flight: at outer step 3 no quorum holds it (none is asked),
    # and between replica groups it is dropped alike
    resumed = _optimizer(torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)), DroppingComm())
    resumed.load_state_dict(optimizer.state_dict())
    (resumed_param,) = resumed.param_groups[0]["params"]
    for _ in range(2):  # phase 3: x = -5, -8, Delta^3 = 6; D = 6 - 4 = 2, theta^3 = -3
        resumed_param.grad = torch.tensor([3.0], dtype=torch.float64)
        resumed.step()
    assert resumed.comm.commits == 0 and resumed_param.item() == -3
    assert resumed.comm.fell_behind == 1  # its peers may have applied it: it heals at this quorum
