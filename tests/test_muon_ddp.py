"""Muon-DDP: which parameters Muon gets, the combined Muon+AdamW optimizer against the two torch
optimizers run side by side, DDP on real gloo workers against one process on the whole batch,
and exact resume of a training run."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.config.compose import compose
from lowcomm.models import ModelSpec, build_model, count_parameters
from lowcomm.optim.grouping import CombinedOptimizer, MuonArgs, muon_adamw, split_muon_adamw
from lowcomm.optim.muon import BatchedMuon
from lowcomm.strategies.muon_ddp import MuonDDP, MuonDDPConfig
from lowcomm.train.metrics import read_metrics
from lowcomm.train.schedule import apply_lr
from runs import tiny_run, train_in_workers

BLOCK_MATRICES = ("att_proj", "attn_out", "ff_proj", "ff_out")


def test_olmo_300m_hidden_matrices_go_to_muon_and_the_tied_embedding_to_adamw():
    model = build_model(ModelSpec(**compose(["model=olmo_300m"]).model), "meta")
    split = split_muon_adamw(model)
    d_model, hidden, layers, vocab = 1024, 8 * 1024, 16, 50304  # mlp_ratio 8, SwiGLU halves ff_out's input
    expected_shapes = {"att_proj": (3 * d_model, d_model), "attn_out": (d_model, d_model),
                       "ff_proj": (hidden, d_model), "ff_out": (d_model, hidden // 2)}
    assert set(split.muon) == {
        f"transformer.blocks.{i}.{m}.weight" for i in range(layers) for m in BLOCK_MATRICES
    }
    assert split.adamw == ["transformer.wte.weight"]
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name in split.muon:
        assert shapes[name] == expected_shapes[name.split(".")[3]]
    assert shapes["transformer.wte.weight"] == (vocab, d_model)
    assert sum(torch.Size(shapes[n]).numel() for n in split.muon + split.adamw) == 319_946_752


def test_an_untied_head_goes_to_adamw_but_the_blocks_ff_out_to_muon():
    model = build_model(ModelSpec(weight_tying=False), "meta")
    split = split_muon_adamw(model)
    assert split.adamw == ["transformer.wte.weight", "transformer.ff_out.weight"]
    assert "transformer.blocks.0.ff_out.weight" in split.muon


class _WithVectors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lookup = torch.nn.Embedding(11, 4)
        self.linear = torch.nn.Linear(4, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.frozen = torch.nn.Linear(5, 5, bias=False).requires_grad_(False)


def test_vectors_embeddings_and_frozen_parameters():
    split = split_muon_adamw(_WithVectors())
    assert split.muon == ["linear.weight"]
    assert split.adamw == ["lookup.weight", "linear.bias", "norm.weight", "norm.bias"]


def _toy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return _WithVectors()


def _toy_step(model: torch.nn.Module, step: int) -> None:
    tokens = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(step))
    model.norm(model.linear(model.lookup(tokens))).square().mean().backward()


HYPER = MuonArgs(lr=0.02, adamw_lr=0.003, weight_decay=0.1, muon_momentum=0.95, muon_nesterov=True,
                 adjust_lr_fn="match_rms_adamw", ns_steps=5, betas=[0.9, 0.95], eps=1e-8,
                 decay_embeddings=True)  # the reference below decays every AdamW parameter
SCHEDULE = [1.0, 0.5, 0.25, 0.125]


def test_combined_optimizer_equals_muon_and_adamw_side_by_side_through_a_schedule_and_a_resume():
    reference = _toy(0)
    muon = torch.optim.Muon([reference.linear.weight], lr=0.02, weight_decay=0.1, momentum=0.95,
                            nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for n, p in reference.named_parameters() if n != "linear.weight"
                               and p.requires_grad], lr=0.003, betas=(0.9, 0.95), weight_decay=0.1)
    for step, multiplier in enumerate(SCHEDULE):
        muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"] = 0.02 * multiplier, 0.003 * multiplier
        _toy_step(reference, step)
        muon.step()
        adamw.step()
        reference.zero_grad()

    model = _toy(0)
    optimizer = muon_adamw(model, HYPER)
    assert sorted(optimizer.parts) == ["adamw", "muon"]
    for step, multiplier in enumerate(SCHEDULE[:2]):
        apply_lr(optimizer, multiplier)
        _toy_step(model, step)
        optimizer.step()
        optimizer.zero_grad()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    model = _toy(1)
    model.load_state_dict(saved["model"])
    optimizer = muon_adamw(model, HYPER)
    optimizer.load_state_dict(saved["optimizer"])
    for step, multiplier in enumerate(SCHEDULE[2:], start=2):
        apply_lr(optimizer, multiplier)  # reaches the parts only if load_state_dict kept the groups live
        _toy_step(model, step)
        optimizer.step()
        optimizer.zero_grad()
    for name, expected in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], expected), name


def test_combined_optimizer_rejects_a_shared_parameter_and_a_foreign_state():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="more than one"):
        CombinedOptimizer({"a": torch.optim.SGD([weight], lr=1), "b": torch.optim.SGD([weight], lr=1)})
    optimizer = CombinedOptimizer({"a": torch.optim.SGD([weight], lr=1)})
    with pytest.raises(ValueError, match="parts"):
        optimizer.load_state_dict({"b": {}})


# --------------------------------------------------------------------------- DDP on gloo
WORLD, STEPS, LR = 2, 3, 0.01
SPEC = ModelSpec()


def _tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (2, 24), generator=torch.Generator().manual_seed(100 * step + rank))


def _model() -> torch.nn.Module:
    """The tiny OLMo in float64, so that summation order cannot move AdamW's tiny-gradient
    coordinates (Adam divides by sqrt(v)) or Muon's bf16 Newton-Schulz input."""
    return build_model(SPEC, "cpu", seed=0).double()


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def _ddp_worker(rank: int, world_size: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    comm = Communicator()
    # fp32 wire and decayed embedding: the float64 single-process reference below is exact only so
    strategy = MuonDDP(MuonDDPConfig.defaults(lr=LR, wire_dtype="float32", decay_embeddings=True), {"name": "none"}, comm)
    ddp, optimizer = strategy.build(_model())
    payload_bytes = []
    for step in range(STEPS):
        _loss(ddp, _tokens(rank, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        payload_bytes.append(comm.meter.end_step()["comm/payload_bytes"])
    buffer = io.BytesIO()
    torch.save({"params": ddp.module.state_dict(), "payload_bytes": payload_bytes}, buffer)
    return buffer.getvalue()


@pytest.mark.slow
def test_ddp_workers_stay_identical_and_match_one_process_on_the_whole_batch():
    results = [torch.load(io.BytesIO(blob)) for blob in spawn_workers(_ddp_worker, WORLD)]
    model = _model()
    hidden = [p for n, p in model.named_parameters() if n.startswith("transformer.blocks.")]
    muon = torch.optim.Muon(hidden, lr=LR, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([model.transformer.wte.weight], lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(STEPS):
        # Equal per-worker batches: the gradient of the mean over their union is DDP's average.
        _loss(model, torch.cat([_tokens(rank, step) for rank in range(WORLD)])).backward()
        muon.step()
        adamw.step()
        model.zero_grad()
    for name, expected in model.state_dict().items():
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name
        assert not torch.equal(expected, initial[name]), name
        torch.testing.assert_close(results[0]["params"][name], expected, rtol=0, atol=1e-12)
    for result in results:  # every float64 gradient element once per step
        assert result["payload_bytes"] == [8 * count_parameters(model)] * STEPS
    fp32_model = build_model(SPEC, "meta")
    for wire_dtype, element_bytes in (("float32", 4), ("bfloat16", 2)):
        strategy = MuonDDP(MuonDDPConfig.defaults(wire_dtype=wire_dtype), {}, Communicator())
        assert strategy.analytic_payload_bytes(fp32_model) == element_bytes * count_parameters(fp32_model)


@pytest.mark.slow
def test_a_resumed_run_ends_bit_identical(tmp_path):
    run = tiny_run(tmp_path, "optimizer=muon_ddp", "optimizer.lr=0.003", "train.checkpoint_every=2",
                   workers=2, max_steps=4)
    train_in_workers(run)
    final = run.run_dir / "checkpoints" / "step_000000004"
    reference = torch.load(final / "model.pt")
    reference_metrics = read_metrics(run.run_dir / "metrics.jsonl")
    shutil.rmtree(final)
    (run.run_dir / "summary.json").unlink()  # as if killed before the end: a finished run is not rerun
    train_in_workers(run)  # resumes from step 2 (Muon momentum and AdamW moments from optim.pt)
    resumed = torch.load(final / "model.pt")
    for name, tensor in reference.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after resume"
    resumed_metrics = read_metrics(run.run_dir / "metrics.jsonl")
    assert [r["train/loss"] for r in resumed_metrics] == [r["train/loss"] for r in reference_metrics]


@pytest.mark.parametrize(("nesterov", "adjust_lr_fn"), [(True, "match_rms_adamw"), (False, "original")])
def test_batched_muon_steps_as_torch_muon_and_takes_its_state(nesterov, adjust_lr_fn):
    """Three (48, 32) matrices (a tall shape: iterated transposed), two (32, 96) and one (32, 32):
    three batches of Newton-Schulz instead of six iterations, bit for bit torch's update on the
    CPU; a state_dict of torch's Muon continues in BatchedMuon as in torch's."""
    shapes = [(48, 32), (32, 96), (48, 32), (32, 32), (32, 96), (48, 32)]
    generator = torch.Generator().manual_seed(0)
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(5)]
    hyper = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}

    def run(optimizer_class, steps, params=None, state=None):
        if params is None:
            init = torch.Generator().manual_seed(1)
            params = [torch.nn.Parameter(torch.randn(shape, generator=init)) for shape in shapes]
        optimizer = optimizer_class(params, **hyper)
        if state is not None:
            optimizer.load_state_dict(state)
        for step in steps:
            for param, grad in zip(params, grads[step], strict=True):
                param.grad = grad.clone()
            optimizer.step()
        return params, optimizer

    expected, _ = run(torch.optim.Muon, range(5))
    batched, _ = run(BatchedMuon, range(5))
    assert all(torch.equal(a, b) for a, b in zip(batched, expected, strict=True))
    halfway, torch_muon = run(torch.optim.Muon, range(2))
    resumed, _ = run(BatchedMuon, range(2, 5), params=halfway, state=torch_muon.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected, strict=True))
