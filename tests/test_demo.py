"""DeMo on real gloo workers against a dense single-process re-derivation written out here.

The re-derivation simulates W workers with explicit matrices: block-diagonal (Kronecker) DCT
matrices built from the DCT-II definition, top-k by sorting each block and the receivers'
values per wire format (both shared with test_dct_codec), the mean over the workers that sent
each coefficient by explicit counting, and the base transforms from their formulas. Parameters are float64 so that rounding cannot
flip a sign or a top-k choice, and the comparison can be tight.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dct_reference import as_matrix, chunk_by_search, dct_definition, dense_topk
from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.compress import cpu_kernels
from lowcomm.compress.dct import random_orthonormal_basis
from lowcomm.compress.dct_topk import WIRES, DCTTopK
from lowcomm.config import ConfigError, validate, validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.models import ModelSpec, build_model
from lowcomm.optim import DeMo, DeMoArgs, demo_payload_bytes
from lowcomm.strategies.demo import DeMoConfig, DeMoStrategy

F64 = torch.float64
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# 2-D, non-dividing (chunks 2 x 3), 1-D, 3-D (seen as 4 x 24), short rows (2 < chunk), a prime
# dimension (chunk 1 along it); (4, 12) stacks with (8, 12) and the last (24,) with the first
# (one block geometry and width: one transform, top-k and decode for both, when they share a bucket)
SHAPES = [(8, 12), (4, 12), (10, 6), (24,), (4, 3, 8), (2, 8), (8, 7), (24,)]
CHUNK, TOPK, STEPS, LR = 4, 3, 10, 0.01
IGNORE_CHUNK_1 = pytest.mark.filterwarnings("ignore:a dimension of size")

# name -> DeMo keyword arguments (plus "parameter_domain": run the 3-transform path)
RUNS = {
    "dct_sign_paper": {"weight_decay": 0.1},
    "dct_sgd_compact": {"base": "sgd", "wire": "compact", "momentum_subtraction": 0.5},
    "dct_muon_signwire": {"base": "muon", "wire": "sign", "compression_decay": 0.999},
    "dct_sgd_parameter_domain": {"base": "sgd", "parameter_domain": True},
    "identity_sign": {"projection": "identity", "momentum_subtraction": 0.0},
    "random_sgd": {"projection": "random", "base": "sgd", "momentum_subtraction": 0.7, "weight_decay": 0.05},
}
# the same runs, exchanged one parameter per bucket and all parameters in one bucket
BUCKETINGS = {"per_parameter": 1, "one_bucket": 10**9}
DEFAULTS = {
    "compression_decay": 0.9,
    "weight_decay": 0.0,
    "momentum_subtraction": 1.0,
    "projection": "dct",
    "base": "sign",
    "wire": "paper",
}


# ------------------------------------------------------------------ inputs
def initial_params(dtype=F64) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=F64).to(dtype)) for shape in SHAPES
    ]


def gradient(rank: int, step: int, index: int, dtype=F64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * step + index)
    return torch.randn(SHAPES[index], generator=generator, dtype=F64).to(dtype)


def make_demo(params, overrides: dict, comm: Communicator | None = None, **extra) -> DeMo:
    options = {"compression_topk": TOPK, "compression_chunk": CHUNK, **DEFAULTS, **overrides, **extra}
    parameter_domain = options.pop("parameter_domain", False)
    optimizer = DeMo(params, DeMoArgs.defaults(lr=LR, **options), comm=comm)
    if parameter_domain:
        optimizer._momentum_in_coefficients = False
    return optimizer


def run_steps(optimizer: DeMo, params, rank: int, steps: range) -> list[list[torch.Tensor]]:
    history = []
    for step in steps:
        for index, param in enumerate(params):
            param.grad = gradient(rank, step, index, param.dtype)
        optimizer.step()
        history.append([param.detach().clone() for param in params])
    return history


# --------------------------------------------------------- the re-derivation
class DenseProjection:
    """P(M) = L M R^T with block-diagonal L, R of one basis per chunk (identity for chunk 1)."""

    def __init__(self, shape, projection: str, step: int):
        rows, cols = as_matrix(torch.empty(shape)).shape
        c0, c1 = chunk_by_search(rows, CHUNK), chunk_by_search(cols, CHUNK)
        self.left = torch.kron(torch.eye(rows // c0, dtype=F64), self._basis(c0, projection, step))
        self.right = torch.kron(torch.eye(cols // c1, dtype=F64), self._basis(c1, projection, step))

    @staticmethod
    def _basis(size: int, projection: str, step: int) -> torch.Tensor:
        if size == 1 or projection == "identity":
            return torch.eye(size, dtype=F64)
        if projection == "dct":
            return dct_definition(size)
        # documented: seeded by the step (so all workers share it), a new basis every step
        return random_orthonormal_basis(size, seed=1_000_003 * step + size, dtype=F64)

    def forward(self, matrix):
        return self.left @ matrix @ self.right.T

    def inverse(self, coefficients):
        return self.left.T @ coefficients @ self.right


def newton_schulz_quintic(matrix):
    x = matrix / (matrix.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def reference_run(world: int, options: dict, steps: int = STEPS) -> list[list[torch.Tensor]]:
    """W simulated workers; returns the (shared) parameters after every step."""
    options = {**DEFAULTS, **options}
    decay, alpha, wd = options["compression_decay"], options["momentum_subtraction"], options["weight_decay"]
    params = [as_matrix(p.detach().clone()) for p in initial_params()]
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    history = []
    for step in range(steps):
        for index, param in enumerate(params):
            projection = DenseProjection(SHAPES[index], options["projection"], step + 1)
            param.mul_(1 - LR * wd)
            sums, counts = torch.zeros_like(param), torch.zeros_like(param)
            for rank in range(world):
                momentum = momenta[rank][index]
                momentum.mul_(decay).add_(LR * as_matrix(gradient(rank, step, index)))
                sent, mask = dense_topk(projection.forward(momentum), CHUNK, TOPK, options["wire"])
                momentum.sub_(alpha * projection.inverse(sent))
                sums += sent
                counts += mask
            update = projection.inverse(sums / counts.clamp(min=1))
            if options["base"] == "sign":
                update = torch.sign(update)
            elif options["base"] == "muon":
                update = newton_schulz_quintic(update)
            param.sub_(LR * update)
        history.append([p.reshape(shape).clone() for p, shape in zip(params, SHAPES, strict=True)])
    return history


def assert_close_relative(actual, expected, tolerance, where=""):
    error = (actual - expected).norm() / expected.norm()
    assert error <= tolerance, f"{where}: relative error {error:.3e} > {tolerance}"


# --------------------------------------------------------------- W = 2 runs
def _compare_worker(rank: int, world: int, runs: dict) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    warnings.filterwarnings("ignore", message="a dimension of size")  # the (8, 7) parameter
    results = {}
    for name, overrides in runs.items():
        params = initial_params()
        optimizer = make_demo(params, overrides)
        results[name] = run_steps(optimizer, params, rank, range(STEPS))
        for bucketing, bucket_numel in BUCKETINGS.items():
            params = initial_params()
            optimizer = make_demo(params, overrides, bucket_numel=bucket_numel)
            results[f"{name}/{bucketing}"] = run_steps(optimizer, params, rank, range(STEPS))
    return results


@pytest.fixture(scope="module")
def two_workers():
    return spawn_workers(_compare_worker, 2, RUNS)


def _compare_worker_on_torch_paths(rank: int, world: int, runs: dict) -> bytes:
    """_compare_worker with lowcomm's CPU kernels off: the matrix products and the torch
    aggregate, what DeMo runs on a GPU, in bf16 and where the kernels cannot be built."""
    os.environ[cpu_kernels.SWITCH] = "0"
    assert cpu_kernels.ops() is None
    return _compare_worker(rank, world, runs)


@pytest.mark.slow
def test_the_torch_paths_match_dense_rederivation_on_two_workers():
    name = "dct_sign_paper"
    results = spawn_workers(_compare_worker_on_torch_paths, 2, {name: RUNS[name]})
    expected = reference_run(2, RUNS[name])
    for step in range(STEPS):
        for index, shape in enumerate(SHAPES):
            on_rank0, on_rank1 = results[0][name][step][index], results[1][name][step][index]
            assert torch.equal(on_rank0, on_rank1), f"ranks differ: step {step} param {shape}"
            assert_close_relative(on_rank0, expected[step][index], 1e-9, f"{name} step {step} param {shape}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_matches_dense_rederivation_on_two_workers(two_workers, name):
    expected = reference_run(2, {k: v for k, v in RUNS[name].items() if k != "parameter_domain"})
    for step in range(STEPS):
        for index, shape in enumerate(SHAPES):
            on_rank0, on_rank1 = two_workers[0][name][step][index], two_workers[1][name][step][index]
            assert torch.equal(on_rank0, on_rank1), f"ranks differ: {name} step {step} param {shape}"
            assert_close_relative(on_rank0, expected[step][index], 1e-9, f"{name} step {step} param {shape}")
            for bucketing in BUCKETINGS:  # how parameters share an exchange changes no bit
                assert torch.equal(two_workers[0][f"{name}/{bucketing}"][step][index], on_rank0), (bucketing, step)


# --------------------------------------------------------------- W = 4 bytes
def expected_payload_bytes(wire: str, value_bytes: int = 4) -> tuple[int, int]:
    """(bytes, per-parameter payload tensors) one worker sends per step for SHAPES, from the wire
    formats' definitions."""
    total = 0
    for shape in SHAPES:
        rows, cols = as_matrix(torch.empty(shape)).shape
        c0, c1 = chunk_by_search(rows, CHUNK), chunk_by_search(cols, CHUNK)
        blocks = (rows // c0) * (cols // c1)
        kept = blocks * min(TOPK, c0 * c1)
        if wire == "paper":
            total += kept * (8 + value_bytes)
        elif wire == "compact":
            total += kept * (2 + 2)
        else:
            total += kept * 2 + math.ceil(kept / 8) + blocks * 2
    return total, len(SHAPES) * (3 if wire == "sign" else 2)


def _bytes_worker(rank: int, world: int) -> bytes:  # noqa: ARG001
    warnings.filterwarnings("ignore", message="a dimension of size")
    results = {}
    for wire in ("paper", "compact", "sign"):
        for bucket_numel in (None, 10**9):
            comm = Communicator()
            params = initial_params(torch.float32)
            optimizer = make_demo(params, {"wire": wire}, comm=comm, bucket_numel=bucket_numel)
            history = run_steps(optimizer, params, rank, range(2))
            breakdown = comm.meter.breakdown(cumulative=False)["data/world/all_gather"]
            results[wire, bucket_numel] = {"step": comm.meter.end_step(), "calls": breakdown["calls"],
                                           "history": history}
    return results


@pytest.mark.slow
@IGNORE_CHUNK_1
def test_payload_bytes_of_a_four_worker_run_match_the_wire_formats():
    results = spawn_workers(_bytes_worker, 4)
    # default buckets hold at most the largest parameter's 96 elements: [96], [48], [60, 24], [96], [16, 56, 24]
    default_buckets = 5
    for wire in ("paper", "compact", "sign"):
        payload, tensors = expected_payload_bytes(wire)
        assert demo_payload_bytes(SHAPES, chunk=CHUNK, topk=TOPK, wire=wire) == payload
        for rank, per_rank in enumerate(results):
            for bucket_numel, buckets in ((None, default_buckets), (10**9, 1)):
                result = per_rank[wire, bucket_numel]
                metrics = result["step"]  # two optimizer steps in one meter step
                assert metrics["comm/payload_bytes"] == 2 * payload, (wire, rank)
                # ring all-gather at W = 4: every rank forwards the 3 others' payloads and its own
                assert metrics["comm/tx_bytes"] == metrics["comm/rx_bytes"] == 2 * 3 * payload
                # one all-gather per wire dtype and bucket (two dtypes in every format), where a
                # per-parameter exchange made one per payload tensor and parameter
                assert result["calls"] == 2 * 2 * buckets < 2 * tensors, (wire, bucket_numel)
                assert metrics["comm/messages"] == result["calls"] * 3  # W-1 ring sends per all-gather
                for step in range(2):
                    for index in range(len(SHAPES)):
                        assert torch.equal(result["history"][step][index],
                                           results[0][wire, None]["history"][step][index])


# --------------------------------------------------------------- W = 1, in process
@IGNORE_CHUNK_1
def test_single_process_matches_rederivation_and_meters_payload():
    params = initial_params()
    optimizer = make_demo(params, {"base": "sgd"})
    assert optimizer.comm.world_size == 1
    history = run_steps(optimizer, params, 0, range(3))
    expected = reference_run(1, {"base": "sgd"}, steps=3)
    for step in range(3):
        for index in range(len(SHAPES)):
            assert_close_relative(history[step][index], expected[step][index], 1e-9)
    metrics = optimizer.comm.meter.end_step()
    assert metrics["comm/payload_bytes"] == 3 * expected_payload_bytes("paper", value_bytes=8)[0]
    assert metrics["comm/tx_bytes"] == metrics["comm/rx_bytes"] == 0


@IGNORE_CHUNK_1
@pytest.mark.parametrize("parameter_domain", [False, True])
def test_keeping_every_coefficient_sends_the_whole_momentum(parameter_domain):
    params = initial_params()
    optimizer = make_demo(
        params, {"base": "sgd", "parameter_domain": parameter_domain}, compression_topk=CHUNK * CHUNK
    )
    before = [p.detach().clone() for p in params]
    for step in range(2):
        for index, param in enumerate(params):
            param.grad = gradient(0, step, index)
        optimizer.step()
        for index, param in enumerate(params):
            # all of delta = lr g is sent and removed, so the update is lr * (lr g)
            before[index] -= LR * LR * gradient(0, step, index)
            torch.testing.assert_close(param.detach(), before[index], rtol=0, atol=1e-14)
            momentum = next(v for k, v in optimizer.state[param].items() if k.startswith("momentum"))
            assert momentum.abs().max() <= 1e-15


@IGNORE_CHUNK_1
@pytest.mark.parametrize("projection", ["dct", "identity"])
@pytest.mark.parametrize("base", ["sign", "sgd", "muon"])
def test_coefficient_domain_momentum_equals_parameter_domain_path(projection, base):
    runs = {}
    for parameter_domain in (False, True):
        params = initial_params()
        optimizer = make_demo(
            params, {"projection": projection, "base": base, "parameter_domain": parameter_domain}
        )
        runs[parameter_domain] = (run_steps(optimizer, params, 0, range(6)), optimizer, params)
    for step in range(6):
        for index in range(len(SHAPES)):
            assert_close_relative(runs[False][0][step][index], runs[True][0][step][index], 1e-12)
    # the stored momenta are the same momentum in two domains
    (_, fused, fused_params), (_, plain, plain_params) = runs[False], runs[True]
    for index, (p_fused, p_plain) in enumerate(zip(fused_params, plain_params, strict=True)):
        momentum = plain.state[p_plain]["momentum"]
        if projection == "dct":
            assert set(fused.state[p_fused]) == {"step", "momentum_dct"}
            momentum = DenseProjection(SHAPES[index], "dct", 0).forward(as_matrix(momentum))
            assert_close_relative(as_matrix(fused.state[p_fused]["momentum_dct"]), momentum, 1e-12)
        else:
            assert_close_relative(fused.state[p_fused]["momentum"], momentum, 1e-12)


@IGNORE_CHUNK_1
@pytest.mark.parametrize("subtraction", [1.0, 0.6])
@pytest.mark.parametrize("wire", WIRES)
def test_subtracting_what_is_sent_in_the_encodes_pass_is_the_separate_subtraction_bit_for_bit(
        monkeypatch, wire, subtraction):
    """On the CPU kernels DeMo's encode subtracts what it sends in the pass that selects it,
    where what it sends is the selected values themselves (paper and signbit wires): the
    parameters and momenta are bit for bit those of the subtraction as a separate index_add_."""
    if not cpu_kernels.available():
        pytest.skip("lowcomm's CPU kernels are not built here")
    subtracted_in_pass = []
    select = DCTTopK.transform_select

    def spy(self, *args, subtract=0.0, **kwargs):
        selected = select(self, *args, subtract=subtract, **kwargs)
        assert selected is not None  # the kernel ran
        subtracted_in_pass.append(subtract)
        return selected

    monkeypatch.setattr(DCTTopK, "transform_select", spy)
    runs = []
    for in_pass in (True, False):
        params = initial_params(torch.float32)
        optimizer = make_demo(params, {"wire": wire, "momentum_subtraction": subtraction})
        if not in_pass:
            monkeypatch.setattr(optimizer, "_subtracts_while_selecting", lambda: False)
        history = run_steps(optimizer, params, 0, range(6))
        runs.append((history, [optimizer.state[param]["momentum_dct"].clone() for param in params]))
    values_sent = wire in ("paper", "signbit")
    half = len(subtracted_in_pass) // 2
    assert subtracted_in_pass[half:] == [0.0] * half  # the separate subtraction's run
    assert subtracted_in_pass[:half] == [subtraction if values_sent else 0.0] * half
    (history, momenta), (expected_history, expected_momenta) = runs
    for step, (got, want) in enumerate(zip(history, expected_history, strict=True)):
        for index, (param, expected) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(param, expected), f"step {step}, parameter {index}"
    for momentum, expected in zip(momenta, expected_momenta, strict=True):
        assert torch.equal(momentum, expected)


def _roundtrip(optimizer: DeMo) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


@IGNORE_CHUNK_1
@pytest.mark.parametrize("overrides", [{}, {"projection": "random", "base": "muon", "wire": "compact"},
                                       {"bucket_numel": 10**9}, {"bucket_numel": 10**9, "parameter_domain": True}])
def test_state_dict_round_trip_continues_identically(overrides):
    params = initial_params(torch.float32)
    optimizer = make_demo(params, overrides)
    run_steps(optimizer, params, 0, range(3))
    saved_params, saved_state = [p.detach().clone() for p in params], _roundtrip(optimizer)

    resumed_params = [torch.nn.Parameter(p.clone()) for p in saved_params]
    resumed = make_demo(resumed_params, overrides)
    resumed.load_state_dict(saved_state)
    fresh_params = [torch.nn.Parameter(p.clone()) for p in saved_params]
    fresh = make_demo(fresh_params, overrides)  # no momentum: must diverge

    expected = run_steps(optimizer, params, 0, range(3, 6))
    got = run_steps(resumed, resumed_params, 0, range(3, 6))
    without_state = run_steps(fresh, fresh_params, 0, range(3, 6))
    for step in range(3):
        for index in range(len(SHAPES)):
            assert torch.equal(got[step][index], expected[step][index])
    assert not all(torch.equal(a, b) for a, b in zip(without_state[-1], expected[-1], strict=True))


@IGNORE_CHUNK_1
def test_a_stack_keeps_its_momenta_in_one_buffer_and_a_checkpoint_per_parameter():
    """(8, 12) and (4, 12) have one block geometry and width, as do the two (24,): in one bucket
    each pair's momenta are views of one buffer, and its state_dict still holds one momentum per
    parameter, of the parameter's shape."""
    params = initial_params(torch.float32)
    optimizer = make_demo(params, {}, bucket_numel=10**9)
    run_steps(optimizer, params, 0, range(2))
    momenta = [optimizer.state[param]["momentum_dct"] for param in params]
    storage = [m.untyped_storage().data_ptr() for m in momenta]
    assert storage[0] == storage[1] and storage[3] == storage[7]
    assert len(set(storage)) == len(SHAPES) - 2
    assert momenta[1].data_ptr() == momenta[0].data_ptr() + momenta[0].numel() * 4  # rows after rows
    saved = _roundtrip(optimizer)["state"]
    assert [tuple(saved[index]["momentum_dct"].shape) for index in range(len(SHAPES))] == SHAPES


@IGNORE_CHUNK_1
@pytest.mark.parametrize("projection", ["dct", "random"])
def test_stacks_respect_groups_and_skipped_gradients_and_leave_no_buffer_behind(projection):
    """Two parameter groups of the same geometry (their own lr and weight decay) in one bucket,
    and a parameter without a gradient at step 2 (under the random projection its step count,
    and so its basis, then differs from its peers'): one bucket computes what one parameter
    per bucket computes, bit for bit, and the optimizer keeps no momentum buffer that no
    parameter's state points into."""
    def run(bucket_numel):
        params = initial_params(torch.float32)
        groups = [{"params": params[:4]}, {"params": params[4:], "lr": 3 * LR, "weight_decay": 0.2}]
        optimizer = DeMo(groups, DeMoArgs.defaults(lr=LR, compression_topk=TOPK, compression_chunk=CHUNK,
                                                   projection=projection, bucket_numel=bucket_numel))
        history = []
        for step in range(5):
            for index, param in enumerate(params):
                param.grad = None if (step == 2 and index == 1) else gradient(0, step, index, torch.float32)
            optimizer.step()
            history.append([p.detach().clone() for p in params])
        return history, optimizer

    expected, _ = run(1)
    got, optimizer = run(10**9)
    assert all(torch.equal(a, b) for step_a, step_b in zip(got, expected, strict=True)
               for a, b in zip(step_a, step_b, strict=True))
    live = {state[key].untyped_storage().data_ptr() for state in optimizer.state.values()
            for key in ("momentum", "momentum_dct") if key in state}
    assert {buffer.untyped_storage().data_ptr() for buffer in optimizer._stacked.values()} <= live
    # (8, 12) and (4, 12) share one again once both have gradients (under the random projection
    # their step counts differ from step 2 on: each its own); the two (24,) never (two groups)
    assert len(optimizer._stacked) == len(SHAPES) - (1 if projection == "dct" else 0)


@IGNORE_CHUNK_1
def test_checkpoint_from_the_parameter_domain_resumes_in_the_coefficient_domain():
    params = initial_params()
    plain = make_demo(params, {"base": "sgd", "parameter_domain": True})
    run_steps(plain, params, 0, range(3))
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make_demo(resumed_params, {"base": "sgd"})
    resumed.load_state_dict(_roundtrip(plain))
    expected = run_steps(plain, params, 0, range(3, 6))
    got = run_steps(resumed, resumed_params, 0, range(3, 6))
    for index in range(len(SHAPES)):
        assert_close_relative(got[-1][index], expected[-1][index], 1e-12)
    assert "momentum_dct" in resumed.state[resumed_params[0]]


def test_parameters_without_gradient_are_left_alone():
    used, unused = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
    before = unused.detach().clone()
    optimizer = DeMo([used, unused], DeMoArgs.defaults(lr=0.1, compression_chunk=4))
    used.grad = torch.randn(8, 8)
    optimizer.step()
    assert torch.equal(unused, before) and unused not in optimizer.state


def test_rejects_bad_arguments():
    param = [torch.nn.Parameter(torch.zeros(4, 4))]
    for bad in (
        {"compression_decay": 1.0},
        {"momentum_subtraction": 1.5},
        {"projection": "fft"},
        {"base": "adam"},
        {"weight_decay": -1.0},
        {"compression_topk": 0},
    ):
        with pytest.raises(ValueError):
            DeMo(param, DeMoArgs.defaults(lr=0.1, **bad))


# ------------------------------------------------------------ paper's table
def _olmo_shapes(d_model: int, n_heads: int) -> list[torch.Size]:
    spec = ModelSpec(
        name=f"olmo_d{d_model}",
        d_model=d_model,
        n_heads=n_heads,
        n_layers=16,
        mlp_ratio=8,
        max_sequence_length=2048,
        tokenizer="allenai_gpt-neox-olmo-dolma-v1_5",
        vocab_size=50280,
        embedding_size=50304,
        eos_token_id=50279,
        pad_token_id=1,
    )
    return [p.shape for p in build_model(spec, "meta").parameters()]


def test_analytic_bytes_reproduce_the_papers_table():
    olmo_1b, olmo_300m = _olmo_shapes(2048, 16), _olmo_shapes(1024, 8)
    assert sum(math.prod(s) for s in olmo_1b) == 1_176_764_416
    assert demo_payload_bytes(olmo_1b, chunk=64, topk=32) == 110_321_664  # 110.32 MB
    assert round(demo_payload_bytes(olmo_1b, chunk=64, topk=16) / 1e6, 2) == 55.16
    assert round(demo_payload_bytes(olmo_1b, chunk=128, topk=32) / 1e6, 2) == 27.58
    # the paper truncates: 29.995 MB is printed 29.9
    assert math.floor(demo_payload_bytes(olmo_300m, chunk=64, topk=32) / 1e5) / 10 == 29.9
    assert math.floor(demo_payload_bytes(olmo_300m, chunk=64, topk=1) / 1e4) / 100 == 0.93
    assert demo_payload_bytes(olmo_1b, chunk=64, topk=32, wire="compact") * 3 == 110_321_664


# ------------------------------------------------------------------- strategy
def test_strategy_config_matches_the_yaml_and_compression_overrides():
    fields = OmegaConf.to_container(OmegaConf.load(CONFIGS / "optimizer" / "demo.yaml"))
    assert fields.pop("name") == "demo"
    config = DeMoConfig(**fields)
    assert config == DeMoConfig.defaults() and config.validate() == []
    assert (config.lr, config.compression_topk, config.compression_chunk, config.wire) == (
        4e-4,
        32,
        64,
        "paper",
    )
    assert DeMoConfig.defaults(projection="fft", compression_decay=1.0).validate() == [
        "optimizer.compression_decay must be in [0, 1), got 1.0",
        "optimizer.projection must be one of dct, random, identity, got 'fft'",
    ]

    model = torch.nn.Linear(64, 128, bias=False)
    for fields, expected in (({}, (64, 32, "paper")), ({"compression_topk": 4, "wire": "sign"}, (64, 4, "sign"))):
        strategy = DeMoStrategy(dataclasses.replace(config, **fields), {"name": "none"}, Communicator())
        wrapped, optimizer = strategy.build(model)
        assert wrapped is model and isinstance(optimizer, DeMo)
        assert (optimizer.codec.chunk, optimizer.codec.topk, optimizer.codec.wire) == expected
        assert strategy.analytic_payload_bytes(model) == optimizer.codec.payload_nbytes((128, 64))
    assert DeMoStrategy.replicated_optimizer_state is False
    # the codec is set one way: by DeMo's own fields, not also by a compression group
    from lowcomm.compress import CODECS

    assert not any(DeMoStrategy.accepts_codec(codec) for codec in CODECS.values())


def test_the_one_bucket_exchange_is_a_config_setting():
    """``optimizer.bucket_numel`` reaches DeMo (one bucket: the whole step in two all-gathers, the
    bit-identical result, test_payload_bytes_of_a_four_worker_run_match_the_wire_formats); a
    bucket of no elements is refused before launch, by name."""
    def strategy(*overrides):
        raw = OmegaConf.to_container(compose(["optimizer=demo", *overrides]), resolve=True)
        strategy_cls, cfg = validate_optimizer(raw)
        return strategy_cls(cfg, raw["compression"], Communicator()), raw

    one_bucket, raw = strategy("optimizer.bucket_numel=10000000000")
    _, optimizer = one_bucket.build(build_model(ModelSpec(**raw["model"]), "meta"))
    assert optimizer.bucket_numel == 10**10
    with pytest.raises(ConfigError, match="optimizer.bucket_numel=0"):
        strategy("optimizer.bucket_numel=0")


# ------------------------------------------------------------ a captured step
class RecordingGraphs:
    """CUDA graphs stood in for on the CPU (CI has no GPU), as ``DeMo.graph_runtime``. A capture
    of an encoding runs the call once to learn what it returns and then puts back every
    parameter and momentum it changed; a decoding (which returns nothing, and whose all-gathered
    input is not there yet) is not run (a real capture runs nothing); a replay runs the call as
    a graph runs its kernels:
    on the capture's gradient tensors and learning-rate tensors, its results copied into the
    captured outputs. What this checks is DeMo's bookkeeping around the graphs: when it warms
    up, captures, replays and drops a capture, the gradients it copies, the buffers the
    all-gathers fill, the step counts. CUDA's graphs themselves: tests/test_cuda_kernels.py."""

    def __init__(self, device: torch.device):
        self.device = device
        self.warm_ups = self.captures = self.replays = 0

    @staticmethod
    def serves(params) -> bool:  # noqa: ARG004
        return True

    def warm_up(self, step) -> None:
        self.warm_ups += 1
        step()

    def new_pool(self) -> None:
        self.captures += 1

    def capture(self, function, *args):
        optimizer = function.__self__
        params = [param for group in optimizer.param_groups for param in group["params"]]
        result = None
        if function.__func__ is not DeMo._decode_bucket:
            changed = [*params, *(state[optimizer._momentum_key] for state in optimizer.state.values())]
            kept = [tensor.clone() for tensor in changed]
            result = function(*args)
            for tensor, before in zip(changed, kept, strict=True):
                tensor.copy_(before)
        return _RecordedGraph(self, function, args, optimizer._lrs, {param: param.grad for param in params}, result), result


class _RecordedGraph:
    def __init__(self, runtime, function, args, lrs, grads, result):
        self.runtime, self.function, self.args, self.lrs, self.grads, self.result = runtime, function, args, lrs, grads, result

    def replay(self) -> None:
        optimizer = self.function.__self__
        now = {param: param.grad for param in self.grads}
        for param, grad in self.grads.items():
            param.grad = grad
        optimizer._lrs = self.lrs
        try:
            result = self.function(*self.args)
        finally:
            optimizer._lrs = None
            for param, grad in now.items():
                param.grad = grad
        if result is not None:  # an encoding: its payloads into the buffers the all-gathers read
            for dtype, flat in result.flats.items():
                self.result.flats[dtype].copy_(flat)
        self.runtime.replays += 1


@pytest.mark.parametrize("bucket_numel", [1, 10**9])
def test_a_captured_step_warms_up_captures_replays_and_drops_its_capture_as_it_should(monkeypatch, bucket_numel):
    """DeMo's captured step with CUDA's graphs stood in for (:class:`RecordingGraphs`), against
    the eager step, over 14 steps: an lr that changes every step, new gradient tensors every
    step, a parameter without a gradient at step 6 and a checkpoint of step 4 loaded before step
    10. Each change of what the capture holds fixed drops it: two eager warm-up steps, then a
    capture. Parameters and momenta equal the eager run's to float64 rounding; bytes and step
    counts equal."""
    from lowcomm.optim import demo as demo_module

    monkeypatch.setattr(demo_module.DeMo, "graph_runtime", RecordingGraphs)
    results = []
    for cuda_graph in (False, True):
        comm = Communicator()
        params = initial_params()
        groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.05}]
        optimizer = make_demo(groups, {"weight_decay": 0.1}, comm=comm, bucket_numel=bucket_numel,
                              cuda_graph=cuda_graph)
        saved = None
        for step in range(14):
            if step == 10:
                optimizer.load_state_dict(saved["optimizer"])
                for param, kept in zip(params, saved["params"], strict=True):
                    param.data.copy_(kept)
            for group in optimizer.param_groups:
                group["lr"] = LR * (1 + step) / 14
            for index, param in enumerate(params):
                param.grad = None if (step, index) == (6, 1) else gradient(0, step, index)
            optimizer.step()
            if step == 4:
                buffer = io.BytesIO()
                torch.save({"optimizer": optimizer.state_dict(), "params": [p.detach().clone() for p in params]}, buffer)
                saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        results.append(([param.detach() for param in params],
                        [optimizer.state[param][optimizer._momentum_key] for param in params],
                        [optimizer.state[param]["step"] for param in params], comm.meter.breakdown(), optimizer._runtime))
    (params, momenta, steps, sent, runtime), (graphed_params, graphed_momenta, graphed_steps, graphed_sent, recorded) = results
    assert runtime is None
    # warm-ups at steps 0-1, 6 (a parameter without gradient), 7-8, 10-11 (the checkpoint);
    # captures at steps 2, 9 and 12; replays at 2-5, 9 and 12-13, two per bucket each
    buckets = len(optimizer._buckets())
    assert (recorded.warm_ups, recorded.captures, recorded.replays) == (7, 3, 2 * buckets * 7)
    assert graphed_steps == steps and graphed_sent == sent
    torch.testing.assert_close(graphed_params, params, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(graphed_momenta, momenta, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bucket_numel", [1, 10**9])
@pytest.mark.parametrize("name", [name for name in RUNS if not name.startswith("random")])
def test_a_captured_steps_arithmetic_is_the_eager_steps(monkeypatch, name, bucket_numel):
    """Every fixed-basis run captured (:class:`RecordingGraphs`): learning rates as tensors (a
    schedule that changes every step, two groups with one lr, which an eager step joins in one
    run and a captured step keeps apart), weight decay, new gradient tensors every step: the
    parameters and momenta equal the eager step's to float64 rounding (the momentum's ``beta m
    + lr P(g)`` is one scaled accumulation eagerly and a transform then a multiply-add when
    captured)."""
    from lowcomm.optim import demo as demo_module

    monkeypatch.setattr(demo_module.DeMo, "graph_runtime", RecordingGraphs)
    results = []
    for cuda_graph in (False, True):
        params = initial_params()
        groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.05}]
        optimizer = make_demo(groups, {**RUNS[name], "weight_decay": 0.1}, bucket_numel=bucket_numel,
                              cuda_graph=cuda_graph)
        for step in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = LR * (1 + step) / STEPS
            for index, param in enumerate(params):
                param.grad = gradient(0, step, index)
            optimizer.step()
        momenta = [optimizer.state[param][optimizer._momentum_key] for param in params]
        results.append(([param.detach() for param in params], momenta,
                        [optimizer.state[param]["step"] for param in params]))
    assert optimizer._runtime.replays == 2 * len(optimizer._buckets()) * (STEPS - 2)
    (params, momenta, steps), (captured_params, captured_momenta, captured_steps) = results
    assert captured_steps == steps == [STEPS] * len(SHAPES)
    torch.testing.assert_close(captured_params, params, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(captured_momenta, momenta, rtol=1e-12, atol=1e-14)


def test_cuda_graph_leaves_a_cpu_step_as_it_was():
    """``cuda_graph=true`` is ignored on the CPU: bit for bit the step without it (a laptop runs
    a cluster's config unchanged)."""
    results = []
    for cuda_graph in (False, True):
        params = initial_params()
        optimizer = make_demo(params, {"weight_decay": 0.1}, cuda_graph=cuda_graph)
        run_steps(optimizer, params, 0, range(3))
        assert optimizer._graphs is None
        results.append([param.detach() for param in params])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_cuda_graph_is_refused_where_a_step_cannot_be_captured():
    """Before launch, by name: a basis drawn every step; FlexDeMo and DisTrO (their steps are not
    DeMo's); bf16 weights. The optimizers refuse it too, when built outside the harness."""
    from lowcomm.optim.distro import DisTrO, DisTrOArgs
    from lowcomm.optim.flexdemo import FlexDeMo

    def errors(*overrides):
        raw = OmegaConf.to_container(compose(list(overrides)), resolve=True)
        with pytest.raises(ConfigError) as caught:
            validate_optimizer(raw)
        return str(caught.value)

    assert "optimizer.cuda_graph needs a fixed basis" in errors(
        "optimizer=demo", "optimizer.cuda_graph=true", "optimizer.projection=random")
    for name in ("flexdemo", "distro"):
        assert f"optimizer.cuda_graph is DeMo's alone, not {name}'s" in errors(
            f"optimizer={name}", "optimizer.cuda_graph=true")
    raw = OmegaConf.to_container(compose(["optimizer=demo", "optimizer.cuda_graph=true"]), resolve=True)
    assert validate_optimizer(raw)[1].cuda_graph is True
    with pytest.raises(ConfigError, match=r"optimizer.cuda_graph=true needs train.param_dtype=fp32, got bf16"):
        validate(compose(["optimizer=demo", "optimizer.cuda_graph=true", "train.param_dtype=bf16"]))
    param = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match="cuda_graph is DeMo's alone; FlexDeMo's step cannot be captured"):
        FlexDeMo(param, DeMoArgs.defaults(cuda_graph=True))
    with pytest.raises(ValueError, match="cuda_graph is DeMo's alone, not distro's"):
        DisTrO(param, DisTrOArgs.defaults(cuda_graph=True))


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("wire", ["paper", "compact", "sign", "signbit"])
def test_a_stacks_gathered_payloads_are_aggregated_as_one(wire, kernels, monkeypatch):
    """Two (8, 16) parameters: 8 blocks x k = 3 is 24 sign bits, whole bytes, so in every wire
    their payloads, laid out key by key, read as one stacked payload: one aggregation entry
    (one decode into both parameters where the CPU kernels decode, one aggregate elsewhere)."""
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "ops", lambda: None)
    params = [torch.nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(i))) for i in range(2)]
    optimizer = DeMo(params, DeMoArgs.defaults(lr=LR, compression_topk=TOPK, compression_chunk=CHUNK, wire=wire,
                                                        bucket_numel=10**9))
    entries = []
    aggregate, decode = optimizer.codec.aggregate_gathered, optimizer.codec.decode_add

    def counting(payloads, layouts, offsets, **work):
        entries.append(("aggregate", [layout.shape for layout in layouts]))
        return aggregate(payloads, layouts, offsets, **work)

    def counting_decodes(payload, layout, targets, **how):
        entries.append(("decode_add", [layout.shape]))
        return decode(payload, layout, targets, **how)

    monkeypatch.setattr(optimizer.codec, "aggregate_gathered", counting)
    monkeypatch.setattr(optimizer.codec, "decode_add", counting_decodes)
    for param in params:
        param.grad = torch.randn(8, 16)
    optimizer.step()
    assert entries == [("decode_add" if kernels else "aggregate", [(16, 16)])]
