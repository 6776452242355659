"""DiLoCo on real gloo workers, against a single-process simulation written out here.

The simulation keeps W model copies with their own AdamW, averages the pseudo-gradients
explicitly (through a dense top-k and an explicit accumulator for the compressed variant) and
applies the outer Nesterov step as the formula ``b <- mu b + Delta; theta <- theta - lr (Delta +
mu b)``. Parameters are float64 so the comparison is tight.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.compress.quantize import Quantize
from lowcomm.compress.registry import build_codec
from lowcomm.compress.topk import TopK
from lowcomm.optim.diloco import DiLoCo, DiLoCoArgs, sync_traffic
from lowcomm.strategies.diloco import DiLoCoConfig, DiLoCoStrategy

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD = 2
STEPS = 8
INNER = dict(lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, sync_every=3, error_feedback=None, exchange="all_gather")
TWO_STEPS = DiLoCoArgs(**{**OUTER, "sync_every": 2})
TOPK_FRACTION = 0.2
EF_BETA = 0.9

# name -> (DiLoCo keyword overrides, compression config)
RUNS = {
    "dense": ({}, {"name": "none"}),
    "topk_ef": ({"error_feedback": EF_BETA}, {"name": "topk", "fraction": TOPK_FRACTION}),
    "quantize": ({}, {"name": "quantize", "bits": 2, "method": "statistical"}),
    # MuLoCo's exchange: the quantized all-reduce, error feedback on the worker's own quantization
    "quantize_ef_reduce": ({"error_feedback": EF_BETA, "exchange": "all_reduce"},
                           {"name": "quantize", "bits": 2, "method": "statistical"}),
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    inputs = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    targets = torch.randn(16, 1, generator=generator, dtype=torch.float64)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _diloco(model, overrides, compression, comm) -> DiLoCo:
    return DiLoCo(
        list(model.parameters()),
        lambda params: torch.optim.AdamW(params, **INNER),
        DiLoCoArgs(**{**OUTER, **overrides}),
        compressor=build_codec(compression),
        comm=comm,
    )


def _train(model, optimizer, comm, rank, steps) -> tuple[list[torch.Tensor], list[int]]:
    history, payload_bytes = [], []
    for step in steps:
        _backward(model, rank, step)
        optimizer.step()
        optimizer.zero_grad()
        payload_bytes.append(int(comm.meter.end_step()["comm/payload_bytes"]))
        history.append(_flat(model))
    return history, payload_bytes


def _worker(rank: int, world_size: int) -> dict:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    results = {}
    for name, (overrides, compression) in RUNS.items():
        comm = Communicator()
        model = _model()
        history, payload_bytes = _train(
            model, _diloco(model, overrides, compression, comm), comm, rank, range(1, STEPS + 1)
        )
        results[name] = {"history": history, "payload_bytes": payload_bytes}

    # Resume from serialized state into a differently seeded model: mid-interval (step 5 of
    # H = 3), model and optimizer; at an outer boundary (step 6), the optimizer alone (its state
    # leaves the parameters out there: they are its global copy)
    overrides, compression = RUNS["topk_ef"]
    for stop, name, with_model in ((5, "resumed", True), (6, "resumed_at_boundary", False)):
        comm = Communicator()
        model = _model()
        optimizer = _diloco(model, overrides, compression, comm)
        _train(model, optimizer, comm, rank, range(1, stop + 1))
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        results[f"{name}_keys"] = sorted(saved["optimizer"])
        model = _model(seed=123)
        optimizer = _diloco(model, overrides, compression, comm)
        if with_model:
            model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        history, _ = _train(model, optimizer, comm, rank, range(stop + 1, STEPS + 1))
        results[f"{name}_final"] = history[-1]
    return results


@pytest.fixture(scope="module")
def worker_results() -> list[dict]:
    return spawn_workers(_worker, WORLD)


def _dense_topk(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
    kept = max(1, int(fraction * tensor.numel()))
    threshold = tensor.abs().flatten().sort(descending=True).values[kept - 1]
    return torch.where(tensor.abs() >= threshold, tensor, torch.zeros_like(tensor))


def _quantized_all_reduce(sources: list[torch.Tensor], codec) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The quantized all-reduce written out for W workers' copies of one tensor: each cut by
    rows into W chunks (torch.tensor_split: the first rows % W chunks one row longer), each
    chunk quantized on its own, chunk j's W decodings averaged and quantized again. Returns the
    decoded result and what each worker's quantization dropped."""
    chunks = [torch.tensor_split(source, WORLD) for source in sources]
    result, dropped = [], [[] for _ in sources]
    for j in range(WORLD):
        if chunks[0][j].numel() == 0:
            result.append(chunks[0][j].clone())
            for rank in range(len(sources)):
                dropped[rank].append(chunks[rank][j].clone())
            continue
        decoded = [codec.decode([codec.encode(chunks[rank][j])]) for rank in range(len(sources))]
        for rank in range(len(sources)):
            dropped[rank].append(chunks[rank][j] - decoded[rank])
        mean = sum(decoded[1:], decoded[0].clone()) / len(sources)
        result.append(codec.decode([codec.encode(mean)]))
    return torch.cat(result), [torch.cat(parts) for parts in dropped]


def _simulate(topk_fraction: float | None = None, ef_beta: float | None = None,
              reduce_codec=None) -> list[list[torch.Tensor]]:
    """history[step][rank]: every worker's flat parameters after each step."""
    models = [_model() for _ in range(WORLD)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in models]
    global_params = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(p) for p in global_params]
    errors = [[torch.zeros_like(p) for p in global_params] for _ in range(WORLD)]
    lr, mu, period = OUTER["outer_lr"], OUTER["outer_momentum"], OUTER["sync_every"]
    history = []
    for step in range(1, STEPS + 1):
        for rank, (model, inner) in enumerate(zip(models, inners, strict=True)):
            _backward(model, rank, step)
            inner.step()
            inner.zero_grad()
        if step % period == 0:
            with torch.no_grad():
                for index, global_param in enumerate(global_params):
                    sent = []
                    if reduce_codec is not None:
                        for rank, model in enumerate(models):
                            delta = global_param - list(model.parameters())[index]
                            errors[rank][index] = ef_beta * errors[rank][index] + delta
                        mean_delta, dropped = _quantized_all_reduce([e[index] for e in errors], reduce_codec)
                        for rank in range(WORLD):
                            errors[rank][index] = dropped[rank]
                        sent = [mean_delta] * WORLD
                    for rank, model in enumerate(models):
                        delta = global_param - list(model.parameters())[index]
                        if reduce_codec is not None:
                            break
                        if topk_fraction is None:
                            sent.append(delta)
                        else:
                            errors[rank][index] = ef_beta * errors[rank][index] + delta
                            compressed = _dense_topk(errors[rank][index], topk_fraction)
                            errors[rank][index] = errors[rank][index] - compressed
                            sent.append(compressed)
                    mean_delta = sum(sent) / WORLD
                    momentum[index] = mu * momentum[index] + mean_delta
                    global_param -= lr * (mean_delta + mu * momentum[index])
                    for model in models:
                        list(model.parameters())[index].copy_(global_param)
        history.append([_flat(m) for m in models])
    return history


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "simulation"), [
        ("dense", {}), ("topk_ef", {"topk_fraction": TOPK_FRACTION, "ef_beta": EF_BETA}),
        ("quantize_ef_reduce", {"ef_beta": EF_BETA, "reduce_codec": Quantize(bits=2, method="statistical")}),
    ]
)
@pytest.mark.slow
def test_matches_simulation(worker_results, run, simulation):
    expected = _simulate(**simulation)
    for step in range(STEPS):
        for rank in range(WORLD):
            torch.testing.assert_close(
                worker_results[rank][run]["history"][step],
                expected[step][rank],
                rtol=1e-10,
                atol=1e-12,
                msg=f"{run}: step {step + 1}, rank {rank}",
            )


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_ranks_agree_exactly_after_each_sync_only(worker_results, run):
    for step in range(1, STEPS + 1):
        rank0, rank1 = (worker_results[r][run]["history"][step - 1] for r in range(WORLD))
        assert torch.equal(rank0, rank1) == (step % OUTER["sync_every"] == 0), f"{run}: step {step}"


@pytest.mark.slow
def test_bytes_follow_the_schedule(worker_results):
    shapes = [p.shape for p in _model().parameters()]
    per_sync = {
        "dense": sum(s.numel() * 8 for s in shapes),  # float64 parameters, all-reduced whole
        "topk_ef": sum(
            max(1, int(TOPK_FRACTION * s.numel())) * (8 + 4) for s in shapes
        ),  # values + int32 idx
        "quantize": sum(-(-s.numel() * 2 // 8) + 4 * 4 for s in shapes),  # 2-bit codes + 4-entry table
        # the same per chunk: each rank's row range of every tensor, its own codes and table
        "quantize_ef_reduce": sum(-(-c.numel() * 2 // 8) + 4 * 4 for s in shapes
                                  for c in torch.tensor_split(torch.empty(s), WORLD) if c.numel()),
    }
    for run, expected in per_sync.items():
        for rank in range(WORLD):
            observed = worker_results[rank][run]["payload_bytes"]
            assert observed == [expected if step % 3 == 0 else 0 for step in range(1, STEPS + 1)], run
        codec = build_codec(RUNS[run][1])
        exchange = RUNS[run][0].get("exchange", OUTER["exchange"])
        assert sync_traffic(shapes, codec, exchange, WORLD, torch.float64)[0] == expected, run


@pytest.mark.slow
def test_resume_from_state_dict_is_bit_identical(worker_results):
    for rank in range(WORLD):
        assert torch.equal(
            worker_results[rank]["resumed_final"], worker_results[rank]["topk_ef"]["history"][-1]
        )


@pytest.mark.slow
def test_at_an_outer_boundary_the_state_leaves_the_parameters_out_and_resumes_bit_for_bit(worker_results):
    """A checkpoint there holds no model-sized copy per worker of what its global copy holds;
    restored into another model from the optimizer's state alone, the run goes on as before."""
    for rank in range(WORLD):
        results = worker_results[rank]
        assert "local_params" in results["resumed_keys"]
        assert "local_params" not in results["resumed_at_boundary_keys"]
        assert torch.equal(results["resumed_at_boundary_final"], results["topk_ef"]["history"][-1])


def test_one_worker_h1_plain_outer_step_equals_the_inner_optimizer():
    reference, wrapped = _model(), _model()
    adamw = torch.optim.AdamW(reference.parameters(), **INNER)
    diloco = DiLoCo(
        list(wrapped.parameters()),
        torch.optim.AdamW(wrapped.parameters(), **INNER),
        DiLoCoArgs(**{**OUTER, "outer_lr": 1.0, "outer_momentum": 0.0, "sync_every": 1}),
        comm=Communicator(),
    )
    for step in range(1, 11):
        for model, optimizer in ((reference, adamw), (wrapped, diloco)):
            _backward(model, 0, step)
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(_flat(wrapped), _flat(reference), rtol=1e-12, atol=1e-14)
    assert diloco.param_groups is diloco.inner.param_groups


def test_schedule_drives_the_inner_lr():
    model = _model()
    diloco = DiLoCo(list(model.parameters()), lambda params: torch.optim.AdamW(params, **INNER), TWO_STEPS)
    schedule = torch.optim.lr_scheduler.LambdaLR(diloco, lambda step: 1 / (step + 2))
    assert diloco.inner.param_groups[0]["lr"] == pytest.approx(INNER["lr"] / 2)
    _backward(model, 0, 1)
    diloco.step()
    schedule.step()
    assert diloco.inner.param_groups[0]["lr"] == pytest.approx(INNER["lr"] / 3)


def test_the_schedule_still_drives_the_inner_lr_after_a_resume():
    from lowcomm.train.schedule import apply_lr

    model = _model()
    saved = DiLoCo(list(model.parameters()), lambda params: torch.optim.AdamW(params, **INNER), TWO_STEPS)
    _backward(model, 0, 1)
    saved.step()
    resumed = DiLoCo(list(model.parameters()), lambda params: torch.optim.AdamW(params, **INNER), TWO_STEPS)
    resumed.load_state_dict(saved.state_dict())
    apply_lr(resumed, 0.25)
    assert resumed.inner.param_groups[0]["lr"] == pytest.approx(INNER["lr"] / 4)


def test_rejects_mismatched_inner_and_feedback_without_codec():
    model, other = _model(), _model()
    with pytest.raises(ValueError, match="exactly the parameters"):
        DiLoCo(list(model.parameters()), torch.optim.AdamW(other.parameters()), TWO_STEPS)
    with pytest.raises(ValueError, match="needs a compressor"):
        DiLoCo(list(model.parameters()), torch.optim.AdamW, DiLoCoArgs(**{**OUTER, "error_feedback": 0.9}))


# -------------------------------------------------------------------------------- strategy
def test_config_file_matches_schema_and_validates():
    fields = OmegaConf.load(CONFIGS / "optimizer" / "diloco.yaml")
    assert fields.pop("name") == "diloco"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DiLoCoConfig), fields))
    assert cfg.validate() == []
    assert (cfg.lr, cfg.weight_decay, cfg.betas, cfg.sync_every, cfg.outer_lr, cfg.outer_momentum) == (
        4e-4,
        0.1,
        [0.9, 0.95],
        10,
        0.7,
        0.9,
    )
    assert DiLoCoConfig.defaults(sync_every=0, outer_momentum=1.0, error_feedback=2.0).validate() == [
        "optimizer.sync_every must be >= 1, got 0",
        "optimizer.outer_momentum must be in [0, 1), got 1.0",
        "optimizer.error_feedback must be null or in [0, 1], got 2.0",
    ]
    for name in ("topk", "quantize"):
        compression = OmegaConf.to_container(OmegaConf.load(CONFIGS / "compression" / f"{name}.yaml"))
        assert isinstance(build_codec(compression), TopK if name == "topk" else Quantize)


def test_strategy_builds_diloco_and_reports_amortised_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    numel = sum(p.numel() for p in model.parameters())
    dense = DiLoCoStrategy(DiLoCoConfig.defaults(sync_every=10), {"name": "none"}, Communicator())
    wrapped, optimizer = dense.build(model)
    assert wrapped is model and isinstance(optimizer, DiLoCo) and optimizer.compressor is None
    assert isinstance(optimizer.inner, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 4e-4
    assert dense.analytic_payload_bytes(model) == pytest.approx(numel * 4 / 10)

    compressed = DiLoCoStrategy(
        DiLoCoConfig.defaults(sync_every=10, error_feedback=0.7), {"name": "topk", "fraction": 0.01}, Communicator()
    )
    _, optimizer = compressed.build(copy.deepcopy(model))
    assert isinstance(optimizer.compressor, TopK)
    kept = sum(max(1, int(0.01 * p.numel())) for p in model.parameters())
    assert compressed.analytic_payload_bytes(model) == pytest.approx(kept * 8 / 10)
    with pytest.raises(ValueError, match="error_feedback"):
        DiLoCoStrategy(DiLoCoConfig.defaults(error_feedback=0.7), {"name": "none"}, Communicator()).build(model)


@pytest.mark.parametrize("name", ["diloco", "muloco", "streaming_diloco", "sparseloco"])
def test_a_run_config_saved_before_the_quantized_all_reduce_loads_as_it_trained(tmp_path, name):
    """A config.yaml written before ``optimizer.exchange`` existed (and SparseLoCo's ``wire: paper``
    / ``binning`` became ``reference`` / one quantizer) validates, with the all-gather those runs did."""
    from lowcomm.config import load_run_config, validate_optimizer
    from lowcomm.config.compose import compose

    codec = ["compression=quantize"] if name == "muloco" else []
    raw = OmegaConf.to_container(compose([f"optimizer={name}", *codec]), resolve=True)
    if name == "sparseloco":
        raw["optimizer"].update(wire="paper", binning="reference")
    else:
        del raw["optimizer"]["exchange"]
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(raw), path)
    upgraded = OmegaConf.to_container(load_run_config(path), resolve=True)
    _, cfg = validate_optimizer(upgraded)
    if name == "sparseloco":
        assert cfg.wire == "reference" and "binning" not in upgraded["optimizer"]
    else:
        assert cfg.exchange == "all_gather"
