"""PowerSGD on real gloo workers: the reducer against a dense re-derivation written out here, the
DDP hook against the plain all-reduce average, and a W=4 training run's metered bytes and
exact resume.

The re-derivation simulates W workers explicitly in float64: P = sum_i (G_i + E_i) Q, columns
orthonormalised by QR (the reducer uses Gram-Schmidt at rank 2; the two differ only in column
signs, which cancel in P P^T), Q = sum_i (G_i + E_i)^T P / W, output P Q^T, E_i the remainder,
Q kept for the next step. The skip rule and the byte counts are written out from the formulas.
"""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.models import ModelSpec, build_model
from lowcomm.optim.powersgd import PowerSGDArgs, PowerSGDReducer, batched_mm, orthogonalize_
from lowcomm.strategies.powersgd import PowerSGD, PowerSGDConfig
from lowcomm.train.loop import next_token_loss
from lowcomm.train.metrics import read_metrics
from runs import tiny_run, train_in_workers

F64 = torch.float64
WORLD = 2
STEPS = 3
# (n, m) as PowerSGD views them: 12 x 10, a vector (6 x 1), a 3-D tensor (8 x 6), 10 x 12, and
# another 12 x 10 (compressed in one batch with a).
SHAPES = {"a": (12, 10), "b": (6,), "c": (8, 3, 2), "d": (10, 12), "e": (12, 10)}
LOW_RANK = dict(matrix_approximation_rank=2, min_compression_rate=2.0)
# At rank 2 and rate 2: a, d, e compress ((12 + 10) * 2 * 2 = 88 < 120); b (7 * 1 * 2 >= 6) and
# c ((8 + 6) * 2 * 2 = 56 >= 48) are sent whole.
LOW_RANK_COMPRESSED = {"a": 2, "d": 2, "e": 2}
# Rank >= min(n, m) for every tensor and a low rate, so that every one of them is compressed.
FULL_RANK = dict(matrix_approximation_rank=100, min_compression_rate=0.1)


@pytest.mark.parametrize("rank", [2, 5], ids=["gram-schmidt", "qr"])
def test_a_batch_is_orthonormalised_matrix_by_matrix(rank):
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(3, 9, rank, generator=generator)
    batch[1, :, 0] = 0  # an all-zero column: epsilon keeps Gram-Schmidt finite
    alone = torch.stack([orthogonalize_(matrix.clone(), 1e-8) for matrix in batch])
    together = orthogonalize_(batch.clone(), 1e-8)
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-7)
    for matrix in together[[0, 2]]:  # orthonormal columns
        torch.testing.assert_close(matrix.T @ matrix, torch.eye(rank), rtol=0, atol=1e-5)


@pytest.mark.parametrize("per_matrix", [True, False], ids=["mm-each", "bmm"])
def test_batched_mm_is_each_product(per_matrix):
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 7, 4, generator=generator), torch.randn(3, 5, 4, generator=generator)
    product = batched_mm(a, b.mT, per_matrix=per_matrix)  # a transposed operand, as Q = M^T P has
    for i in range(3):
        torch.testing.assert_close(product[i], a[i] @ b[i].T, rtol=1e-6, atol=1e-6)


def _gradient(name: str, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * step + sorted(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=generator, dtype=F64)


def _params() -> dict[str, torch.nn.Parameter]:
    return {name: torch.nn.Parameter(torch.zeros(shape, dtype=F64)) for name, shape in SHAPES.items()}


def _reducer(comm: Communicator, params, **kwargs) -> PowerSGDReducer:
    return PowerSGDReducer(comm, params.items(), PowerSGDArgs.defaults(start_powerSGD_iter=0, **kwargs))


# How the gradients are handed to ``average_``, per step: all in one call, one call each (as
# DDP buckets of one tensor would: nothing is batched), or regrouped from step to step (as DDP
# regroups its buckets after the first step: a batch of a and e, then neither).
ONE_CALL = [list(SHAPES)]
ONE_BY_ONE = [[name] for name in SHAPES]
REGROUPED = [ONE_CALL, [["a"], ["b", "c", "d", "e"]], [["e", "d"], ["a", "b", "c"]]]


def _steps(
    reducer: PowerSGDReducer, comm: Communicator, rank: int, steps, calls=None
) -> tuple[list[dict], list[int]]:
    """Each step's averaged gradients and payload bytes; ``calls``: the names of each
    ``average_`` call of every step (default: one call), or a list of those per step."""
    outputs, payload_bytes = [], []
    for step in steps:
        gradients = {name: _gradient(name, rank, step) for name in SHAPES}
        per_step = calls[step] if calls is not None and isinstance(calls[0][0], list) else calls or ONE_CALL
        for names in per_step:
            reducer.average_([(name, gradients[name]) for name in names])
        reducer.iteration += 1
        outputs.append(gradients)
        payload_bytes.append(int(comm.meter.end_step()["comm/payload_bytes"]))
    return outputs, payload_bytes


def _reducer_worker(rank: int, world_size: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    comm, params = Communicator(), _params()
    results = {}
    full = _reducer(comm, params, **FULL_RANK)
    results["full_rank"], _ = _steps(full, comm, rank, range(STEPS))
    # the same, nothing batched: QR of each matrix alone (rank 10 > 2)
    results["full_rank_one_by_one"], _ = _steps(_reducer(comm, params, **FULL_RANK), comm, rank, range(STEPS),
                                                ONE_BY_ONE)

    low = _reducer(comm, params, **LOW_RANK)
    results["initial_q"] = {
        name: low.initial_q(name, SHAPES[name][1], rank_, F64) for name, rank_ in LOW_RANK_COMPRESSED.items()
    }
    results["low_rank"], results["payload_bytes"] = _steps(low, comm, rank, range(STEPS))
    results["batched"] = sorted(low._inputs)  # the groups of equal-shape matrices it stacked
    results["one_by_one"], _ = _steps(_reducer(comm, params, **LOW_RANK), comm, rank, range(STEPS), ONE_BY_ONE)
    regrouped = _reducer(comm, params, **LOW_RANK)
    results["regrouped"], _ = _steps(regrouped, comm, rank, range(STEPS), REGROUPED)
    results["regrouped_kept"] = sorted(regrouped._inputs)
    for flags in ({"use_error_feedback": False}, {"warm_start": False}):
        label = next(iter(flags))
        results[f"{label}_off"], _ = _steps(_reducer(comm, params, **LOW_RANK, **flags), comm, rank, range(STEPS))
        results[f"{label}_off_one_by_one"], _ = _steps(_reducer(comm, params, **LOW_RANK, **flags), comm, rank,
                                                       range(STEPS), ONE_BY_ONE)

    # Resume after step 1 into a fresh reducer from serialised state; steps 2.. must match.
    first = _reducer(comm, params, **LOW_RANK)
    _steps(first, comm, rank, range(1))
    state = first.state_dict()
    _steps(first, comm, rank, range(1, 2))  # a later step must not change the state taken before it
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = _reducer(comm, params, **LOW_RANK)
    resumed.load_state_dict(torch.load(buffer))
    results["resumed"], _ = _steps(resumed, comm, rank, range(1, STEPS))
    return results


@pytest.fixture(scope="module")
def reducer_results() -> list[dict]:
    return spawn_workers(_reducer_worker, WORLD)


def _mean_over_ranks(name: str, step: int) -> torch.Tensor:
    return sum(_gradient(name, rank, step) for rank in range(WORLD)) / WORLD


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(matrix).Q


def _simulate_low_rank(initial_q: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The averaged gradient of every step, for W workers with error feedback and warm start."""
    q = dict(initial_q)
    errors = [{name: 0.0 for name in LOW_RANK_COMPRESSED} for _ in range(WORLD)]
    history = []
    for step in range(STEPS):
        averaged = {}
        for name, shape in SHAPES.items():
            if name not in LOW_RANK_COMPRESSED:
                averaged[name] = _mean_over_ranks(name, step)
                continue
            inputs = [_gradient(name, rank, step) + errors[rank][name] for rank in range(WORLD)]
            start = _orthonormal(q[name])
            p = _orthonormal(sum(m @ start for m in inputs))
            q[name] = sum(m.T @ p for m in inputs) / WORLD
            averaged[name] = (p @ q[name].T).reshape(shape)
            for rank in range(WORLD):
                errors[rank][name] = inputs[rank] - averaged[name]
        history.append(averaged)
    return history


@pytest.mark.slow
def test_at_full_rank_the_compressed_average_is_the_plain_average(reducer_results):
    for result in reducer_results:
        for step, averaged in enumerate(result["full_rank"]):
            for name in SHAPES:
                torch.testing.assert_close(averaged[name], _mean_over_ranks(name, step), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_low_rank_error_feedback_and_warm_start_match_the_dense_re_derivation(reducer_results):
    initial_q = reducer_results[0]["initial_q"]
    for name in LOW_RANK_COMPRESSED:  # the random start is shared by the workers
        assert torch.equal(reducer_results[1]["initial_q"][name], initial_q[name])
    expected = _simulate_low_rank(initial_q)
    for result in reducer_results:
        for step in range(STEPS):
            for name in SHAPES:
                torch.testing.assert_close(result["low_rank"][step][name], expected[step][name],
                                           rtol=1e-9, atol=1e-11)
    # The approximation really is low-rank (so the comparison above is not the plain mean).
    assert torch.linalg.matrix_rank(expected[-1]["a"]) == 2
    assert not torch.allclose(expected[-1]["a"], _mean_over_ranks("a", STEPS - 1))


@pytest.mark.slow
@pytest.mark.parametrize(("batched", "alone"), [
    ("low_rank", "one_by_one"),  # Gram-Schmidt (rank 2)
    ("full_rank", "full_rank_one_by_one"),  # QR
    ("regrouped", "one_by_one"),  # a batch, then its matrices in other calls
    ("use_error_feedback_off", "use_error_feedback_off_one_by_one"),
    ("warm_start_off", "warm_start_off_one_by_one"),
])
def test_equal_shapes_are_batched_and_give_the_one_by_one_result_bit_for_bit(reducer_results, batched, alone):
    for result in reducer_results:
        assert result["batched"] == [("a", "e"), ("d",)]
        for together, one_by_one in zip(result[batched], result[alone], strict=True):
            for name in SHAPES:
                assert torch.equal(together[name], one_by_one[name]), name
    # the stacks of a group that was broken up are not kept
    assert reducer_results[0]["regrouped_kept"] == [("a",), ("d",), ("e",)]


@pytest.mark.slow
def test_metered_bytes_are_p_and_q_for_compressed_matrices_and_whole_tensors_otherwise(reducer_results):
    # a, d, e: (n + m) * r = (12 + 10) * 2 each; b: 6; c: 8 * 3 * 2 = 48; float64.
    expected = (3 * (12 + 10) * 2 + 6 + 48) * 8
    for result in reducer_results:
        assert result["payload_bytes"] == [expected] * STEPS


@pytest.mark.slow
def test_state_dict_resume_continues_exactly(reducer_results):
    for result in reducer_results:
        for resumed, uninterrupted in zip(result["resumed"], result["low_rank"][1:], strict=True):
            for name in SHAPES:
                assert torch.equal(resumed[name], uninterrupted[name]), name


# ------------------------------------------------------------------------- through DDP
def _ddp_worker(rank: int, world_size: int, bucket_cap_mb: float) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    cfg = PowerSGDConfig.defaults(start_powerSGD_iter=0, matrix_approximation_rank=64, min_compression_rate=0.25,
                                  bucket_cap_mb=bucket_cap_mb)
    strategy = PowerSGD(cfg, {"name": "none"}, Communicator())
    spec = ModelSpec()
    ddp, _ = strategy.build(build_model(spec, "cpu", seed=0))
    assert ddp.bucket_bytes_cap == int(bucket_cap_mb * 2**20)  # the config's size reached DDP
    hook_calls = []
    average = strategy.reducer.average_
    strategy.reducer.average_ = lambda gradients: hook_calls.append([g.numel() for _, g in gradients]) or average(gradients)
    local = build_model(spec, "cpu", seed=0)
    steps = []
    for step in range(2):
        tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(10 * rank + step))
        for model in (ddp, local):
            model.zero_grad()
            next_token_loss(model, tokens).backward()
        steps.append({
            "ddp": {name: p.grad.clone() for name, p in ddp.module.named_parameters()},
            "local": {name: p.grad.clone() for name, p in local.named_parameters()},
        })
    return {"steps": steps, "iteration": strategy.reducer.iteration, "hook_calls": hook_calls}


@pytest.mark.slow
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.1], ids=["one-bucket", "small-buckets"])
def test_the_ddp_hook_averages_exactly_at_full_rank(bucket_cap_mb):
    """Tiny OLMo, rank 64 >= min(n, m) of every matrix, every matrix compressed from step 0; its
    0.6 MB of gradients in one 25 MiB bucket, or in several of ``optimizer.bucket_cap_mb=0.1``."""
    results = spawn_workers(_ddp_worker, WORLD, bucket_cap_mb)
    shapes = dict(build_model(ModelSpec(), "meta").named_parameters())
    assert all((n + m) * min(n, m) * 0.25 < n * m for n, m in (p.shape for p in shapes.values()))
    for step in range(2):
        for name in shapes:
            mean = sum(result["steps"][step]["local"][name] for result in results) / WORLD
            for result in results:
                torch.testing.assert_close(result["steps"][step]["ddp"][name], mean, rtol=1e-4, atol=1e-6)
    assert [result["iteration"] for result in results] == [2, 2]
    # the hook's calls: DDP's first step is one bucket of every parameter (its initial assignment
    # when no parameter may go unused); after it rebuilds them in the order the gradients came,
    # buckets of the config's size, each closed by the parameter that brings it to the cap
    cap = bucket_cap_mb * 2**20
    for result in results:
        first, *buckets = result["hook_calls"]
        assert len(first) == len(shapes) and sum(map(len, buckets)) == len(shapes)
        assert len(buckets) == (1 if bucket_cap_mb == 25 else 4)
        for i, bucket in enumerate(buckets):
            assert 4 * sum(bucket[:-1]) < cap
            assert 4 * sum(bucket) >= cap or i == len(buckets) - 1


def _tiny_payload_bytes(rank: int, min_compression_rate: float) -> int:
    """Written out from the skip rule for the tiny model's fp32 matrices."""
    total = 0
    for _, param in build_model(ModelSpec(), "meta").named_parameters():
        n, m = param.shape
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return total * 4


@pytest.mark.slow
def test_w4_run_meters_the_analytic_bytes_and_resumes_exactly(tmp_path):
    rank, warmup = 16, 1
    run = tiny_run(tmp_path, "optimizer=powersgd", f"optimizer.matrix_approximation_rank={rank}",
                   f"optimizer.start_powerSGD_iter={warmup}", "train.checkpoint_every=2", workers=4, max_steps=4)
    train_in_workers(run)
    dense = 4 * sum(p.numel() for p in build_model(ModelSpec(), "meta").parameters())
    compressed = _tiny_payload_bytes(rank, 2.0)
    # At rank 16 attn_out (64 x 64) sits on the boundary ((64 + 64) * 16 * 2 == 64 * 64): sent whole.
    assert compressed < dense
    records = read_metrics(run.run_dir / "metrics.jsonl")
    assert [r["comm/payload_bytes"] for r in records] == [dense, compressed, compressed, compressed]
    strategy = PowerSGD(run.optimizer, run.compression, Communicator())
    model = build_model(run.model, "meta")
    assert strategy.analytic_payload_bytes(model) == compressed
    assert strategy.warmup_payload_bytes(model) == dense

    final = run.run_dir / "checkpoints" / "step_000000004"
    reference = torch.load(final / "model.pt")
    shutil.rmtree(final)
    (run.run_dir / "summary.json").unlink()  # as if killed before the end: a finished run is not rerun
    train_in_workers(run)  # resumes from step 2, with the error buffers and warm-start Qs of step 2
    resumed = torch.load(final / "model.pt")
    for name, tensor in reference.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after resume"
    assert [r["comm/payload_bytes"] for r in read_metrics(run.run_dir / "metrics.jsonl")] == [
        dense, compressed, compressed, compressed]
