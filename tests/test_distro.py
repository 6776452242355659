"""DisTrO on two real gloo workers against steps worked out by hand: the 1-bit wire, the aggregate
applied one step late, the lookahead, and an exact resume with an exchange in flight.

The hand-worked case: one parameter x of 4 elements, 0 at start, identity projection (top-k of
the raw momentum), chunk 2 (blocks [x0 x1], [x2 x3]), k = 1, beta = 0.5, lr = 0.5, no weight
decay, W = 2, constant gradients g0 = (4, -2, 1, 3) on worker 0 and g1 = (-6, 2, 3, -1) on
worker 1; delta <- 0.5 delta + 0.5 g, then the selected value leaves delta.

  t=1  delta0 = (2, -1, .5, 1.5): sends x0 (+), x3 (+); keeps (0, -1, .5, 0); lookahead s0 = (+,-,+,+)
       delta1 = (-3, 1, 1.5, -.5): sends x0 (-), x2 (+); keeps (0, 1, 0, -.5);  lookahead s1 = (-,+,+,-)
       aggregate A1 = mean of +-1 over senders: x0 (+1 - 1) / 2 = 0, x2 1, x3 1 -> sign (0, 0, 1, 1)
       nothing to apply yet; x = -0.5 s: worker 0 (-.5, .5, -.5, -.5), worker 1 (.5, -.5, -.5, .5)
  t=2  lookahead taken back: x = 0
       delta0 = (2, -1.5, .75, 1.5): sends x0 (+), x3 (+); delta1 = (-3, 1.5, 1.5, -.75): x0 (-), x2 (+)
       A2 = (0, 0, 1, 1); apply A1: x = (0, 0, -.5, -.5); lookahead: worker 0 (-.5, .5, -1, -1),
       worker 1 (.5, -.5, -1, 0)
  t=3  x = (0, 0, -.5, -.5); delta0 = (2, -1.75, .875, 1.5), delta1 = (-3, 1.75, 1.5, -.875): the same
       choices; apply A2: x = (0, 0, -1, -1); lookahead: (-.5, .5, -1.5, -1.5), (.5, -.5, -1.5, -.5)

With values as sent (the ``paper`` wire) x0 would get mean(2, -3) = -0.5, sign -1: the 0 there is
the 1-bit wire's. Without the lookahead x is (0,0,0,0), (0,0,-.5,-.5), (0,0,-1,-1) on both workers.
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.compress.dct import block_transform
from lowcomm.compress.dct_topk import DCTTopK, index_width
from lowcomm.optim import DeMo, DeMoArgs, DisTrO, DisTrOArgs, demo_payload_bytes
from lowcomm.strategies.distro import DisTrOConfig, DisTrOStrategy

F64 = torch.float64
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GRADS = ((4.0, -2.0, 1.0, 3.0), (-6.0, 2.0, 3.0, -1.0))
WITH_LOOKAHEAD = [
    [(-0.5, 0.5, -0.5, -0.5), (0.5, -0.5, -0.5, 0.5)],
    [(-0.5, 0.5, -1.0, -1.0), (0.5, -0.5, -1.0, 0.0)],
    [(-0.5, 0.5, -1.5, -1.5), (0.5, -0.5, -1.5, -0.5)],
]
WITHOUT_LOOKAHEAD = [(0.0, 0.0, 0.0, 0.0), (0.0, 0.0, -0.5, -0.5), (0.0, 0.0, -1.0, -1.0)]
MOMENTUM_AFTER_STEP_1 = [(0.0, -1.0, 0.5, 0.0), (0.0, 1.0, 0.0, -0.5)]


# ---------------------------------------------------------------------------- the 1-bit wire
def test_signbit_indices_take_the_narrowest_width_that_holds_the_block():
    # Psyche's compress_idx: uint8 up to 256 positions, uint16 up to 65536, then uint32
    assert [index_width(n) for n in (2, 256, 257, 4096, 65536, 65537)] == [1, 1, 2, 2, 2, 4]


@pytest.mark.parametrize(("chunk", "width"), [(16, 1), (64, 2), (512, 4)])
def test_signbit_sends_indices_and_one_bit_per_value_and_decodes_pure_signs(chunk, width):
    tensor = torch.randn(chunk, 2 * chunk, generator=torch.Generator().manual_seed(chunk), dtype=F64)
    codec = DCTTopK(chunk=chunk, topk=3, wire="signbit")
    payload = codec.encode(tensor)
    kept = 2 * 3  # two chunk x chunk blocks, three values each
    assert payload.tensors["index"].dtype == torch.uint8 and payload.tensors["index"].shape == (2, 3, width)
    assert payload.nbytes == codec.payload_nbytes(tensor.shape, F64) == kept * width + math.ceil(kept / 8)
    index, values = codec.unpack(payload)
    # the round trip gives back the selection and the sign of each selected coefficient
    layout = codec.layout(tensor.shape)
    coefficients = block_transform(tensor, layout, *codec.bases(layout, tensor.device, F64))
    selected, _, selected_values = codec.select(coefficients, layout)
    assert torch.equal(index, selected.view(index.shape))
    assert torch.equal(values, torch.where(selected_values < 0, -1.0, 1.0).to(F64).view(values.shape))  # no scale
    assert not codec.decodes_magnitudes and DCTTopK(wire="sign").decodes_magnitudes


def test_signbit_decodes_zero_as_plus_one_as_psyches_signbit_does():
    codec = DCTTopK(chunk=2, topk=2, wire="signbit")
    layout = codec.layout((4,))
    index = torch.tensor([[0, 1], [0, 1]])
    payload = codec.pack(index, torch.tensor([[0.0, -0.0], [-2.0, 3.0]]), layout)
    assert codec.unpack(payload)[1].tolist() == [[1.0, -1.0], [-1.0, 1.0]]


# ---------------------------------------------------------------------------- on real workers
def _distro(param: torch.nn.Parameter, comm: Communicator, lookahead: bool) -> DisTrO:
    args = DisTrOArgs.defaults(lr=0.5, compression_decay=0.5, compression_topk=1, compression_chunk=2,
                               weight_decay=0.0, projection="identity", lookahead=lookahead)
    return DisTrO([param], args, comm)


def _steps(optimizer: DisTrO, param: torch.nn.Parameter, comm: Communicator, rank: int, steps: int):
    history, payloads = [], []
    for _ in range(steps):
        param.grad = torch.tensor(GRADS[rank], dtype=F64)
        optimizer.step()
        history.append(tuple(param.detach().tolist()))
        payloads.append(comm.meter.end_step())
    return history, payloads


def _fresh(comm: Communicator, lookahead: bool):
    param = torch.nn.Parameter(torch.zeros(4, dtype=F64))
    return param, _distro(param, comm, lookahead)


def _lagged_start() -> list[torch.Tensor]:
    return [torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=F64)
            for i, shape in enumerate([(8, 12), (24,), (6, 10)])]


def _lagged_pair(comm: Communicator, rank: int, wire: str):
    """DCT on real shapes: DisTrO without lookahead, one step behind DeMo on the same gradients
    (they do not depend on the parameters here, and without weight decay nor lookahead nothing
    else moves them)."""
    shapes = [start.shape for start in _lagged_start()]
    start = _lagged_start()
    options = dict(lr=0.01, compression_decay=0.9, compression_topk=3, compression_chunk=4, weight_decay=0.0,
                   wire=wire)
    demo_params = [torch.nn.Parameter(t.clone()) for t in start]
    distro_params = [torch.nn.Parameter(t.clone()) for t in start]
    demo = DeMo(demo_params, DeMoArgs.defaults(**options), comm)
    distro = DisTrO(distro_params, DisTrOArgs.defaults(**options, lookahead=False), comm)
    demo_history, distro_history = [], []
    for step in range(5):
        grads = [torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + 10 * step + i),
                             dtype=F64) for i, shape in enumerate(shapes)]
        for optimizer, params, history in ((demo, demo_params, demo_history),
                                           (distro, distro_params, distro_history)):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
            history.append([p.detach().clone() for p in params])
    return demo_history, distro_history


def _worker(rank: int, world: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="a dimension of size")
    results = {}
    for lookahead in (True, False):
        comm = Communicator()
        param, optimizer = _fresh(comm, lookahead)
        history, payloads = _steps(optimizer, param, comm, rank, 1)
        results["momentum_after_1", lookahead] = tuple(optimizer.state[param]["momentum"].tolist())
        more, more_payloads = _steps(optimizer, param, comm, rank, 2)
        results[lookahead] = history + more, payloads + more_payloads

    # killed after step 2, with step 2's all-gather in flight: resumed from its state alone
    comm = Communicator()
    param, optimizer = _fresh(comm, True)
    _steps(optimizer, param, comm, rank, 2)
    buffer = io.BytesIO()
    torch.save({"param": param.detach().clone(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    results["in_flight_saved"] = len(saved["optimizer"]["in_flight"])
    param, optimizer = _fresh(Communicator(), True)
    # the optimizer's state alone puts this worker back at its own lookahead point (a
    # checkpoint's model file holds rank 0's parameters, its lookahead included)
    param.data.fill_(math.nan)
    optimizer.load_state_dict(saved["optimizer"])
    results["restored"] = (tuple(param.detach().tolist()), tuple(saved["param"].tolist()))
    results["resumed"] = _steps(optimizer, param, comm, rank, 1)[0]
    results["lagged", "signbit"] = _lagged_pair(Communicator(), rank, "signbit")
    results["lagged", "paper"] = _lagged_pair(Communicator(), rank, "paper")
    out = io.BytesIO()
    torch.save(results, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def workers() -> list[dict]:
    return [torch.load(io.BytesIO(blob), weights_only=False) for blob in spawn_workers(_worker, 2)]


@pytest.mark.slow
def test_steps_match_the_hand_worked_example(workers):
    for rank in range(2):
        assert workers[rank][True][0] == [WITH_LOOKAHEAD[step][rank] for step in range(3)], rank
        assert workers[rank][False][0] == WITHOUT_LOOKAHEAD, rank
        # the sent values leave the momentum unquantized (they decode to +-1 on the wire)
        for lookahead in (True, False):
            assert workers[rank]["momentum_after_1", lookahead] == MOMENTUM_AFTER_STEP_1[rank]


@pytest.mark.slow
def test_every_step_sends_index_and_sign_bytes_through_the_meter(workers):
    # per step and worker: 2 blocks x k=1: two 1-byte indices and one byte of sign bits; a ring
    # all-gather at W = 2 forwards one payload each way
    for rank in range(2):
        for step in workers[rank][True][1]:
            assert step["comm/payload_bytes"] == 3 == step["comm/tx_bytes"] == step["comm/rx_bytes"]


@pytest.mark.slow
def test_a_checkpoint_between_steps_holds_the_exchange_in_flight_and_resumes_exactly(workers):
    for rank in range(2):
        assert workers[rank]["in_flight_saved"] == 1
        restored, saved = workers[rank]["restored"]
        assert restored == saved == WITH_LOOKAHEAD[1][rank]
        assert workers[rank]["resumed"] == [WITH_LOOKAHEAD[2][rank]]


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["signbit", "paper"])
def test_without_lookahead_it_is_demo_one_step_late(workers, wire):
    for rank in range(2):
        demo, distro = workers[rank]["lagged", wire]
        # step 1 applies nothing (no weight decay, no lookahead)
        assert all(torch.equal(a, b) for a, b in zip(distro[0], _lagged_start(), strict=True))
        for step in range(1, 5):
            for late, early in zip(distro[step], demo[step - 1], strict=True):
                assert torch.equal(late, early), (wire, rank, step)
        assert not torch.equal(distro[1][0], demo[1][0])  # it is late, not the same


# ---------------------------------------------------------------------------- strategy
def test_strategy_config_is_the_yaml_and_psyches_40b_settings():
    fields = OmegaConf.to_container(OmegaConf.load(CONFIGS / "optimizer" / "distro.yaml"))
    assert fields.pop("name") == "distro"
    config = DisTrOConfig(**fields)
    assert config == DisTrOConfig.defaults() and config.validate() == []
    assert (config.compression_topk, config.compression_chunk, config.compression_decay, config.weight_decay,
            config.wire, config.base, config.lookahead) == (4, 64, 0.995, 0.1, "signbit", "sign", True)
    model = torch.nn.Linear(128, 64, bias=False)
    strategy = DisTrOStrategy(config, {"name": "none"}, Communicator())
    wrapped, optimizer = strategy.build(model)
    assert wrapped is model and isinstance(optimizer, DisTrO) and optimizer.lookahead
    # a 64 x 128 matrix: two 64 x 64 blocks, 4 values each: 8 two-byte indices + 1 byte of signs
    assert strategy.analytic_payload_bytes(model) == 8 * 2 + 1
    assert strategy.wire_collective() == "all_gather"
    # once: the parameters without the lookahead; per worker: the momentum (fp32) and the
    # lookahead's int8 direction per element
    assert strategy.optimizer_state_bytes(model, 8) == (64 * 128 * 4, 64 * 128 * 5)
    assert DisTrOStrategy.comm_overlap(config, 10**9) == 1.0
    no_lookahead = DisTrOStrategy(dataclasses.replace(config, lookahead=False), {"name": "none"}, Communicator())
    assert no_lookahead.optimizer_state_bytes(model, 8) == (0.0, 64 * 128 * 4)


def test_psyche_40b_payload_on_olmo_1b_is_a_fortieth_of_demo_k32():
    from test_demo import _olmo_shapes

    olmo_1b = _olmo_shapes(2048, 16)
    distro = demo_payload_bytes(olmo_1b, chunk=64, topk=4, wire="signbit")
    demo = demo_payload_bytes(olmo_1b, chunk=64, topk=32)
    # every OLMo-1B matrix divides into 64 x 64 blocks (4096 positions: 2-byte indices), 4 kept:
    # 8 + 1/2 bytes per block where DeMo k=32 sends 32 x 12 = 384
    blocks = demo / (32 * 12)
    assert distro == blocks * 8.5
    assert round(demo / distro, 1) == 45.2
