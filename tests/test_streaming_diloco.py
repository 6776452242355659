"""Streaming DiLoCo on two real gloo workers against steps worked out by hand, its E3M0 wire,
its fragments, its per-step bytes and peak, and exact resume with an exchange in flight.

The hand-worked case: two scalar parameters a (fragment 0) and b (fragment 1), both 0, W = 2,
H = 2 (offsets 0 and 1), tau = 1, alpha = 0.5, outer lr 0.5 without momentum, inner SGD with
lr 1 and constant gradients g_a = (1, 3), g_b = (2, 6) on workers (0, 1):

  t=1 inner: a = (-1, -3), b = (-2, -6).  send b: Delta_b = (2, 6), mean 4.
  t=2 inner: a = (-2, -6), b = (-4, -12). send a: Delta_a = (2, 6), mean 4.
      receive b: global_b = 0 - 0.5 * 4 = -2;  b = 0.5 b + 0.5 (-2) = (-3, -7).
  t=3 inner: a = (-3, -9), b = (-5, -13). send b: Delta_b = -2 - b = (3, 11), mean 7.
      receive a: global_a = -2;  a = 0.5 a + 0.5 (-2) = (-2.5, -5.5).
  t=4 inner: a = (-3.5, -8.5), b = (-7, -19). send a: Delta_a = -2 - a = (1.5, 6.5), mean 4.
      receive b: global_b = -2 - 0.5 * 7 = -5.5;  b = 0.5 b + 0.5 (-5.5) = (-6.25, -12.25).
  t=5 inner: a = (-4.5, -11.5), b = (-8.25, -18.25). send b: Delta_b = -5.5 - b = (2.75, 12.75), mean 7.75.
      receive a: global_a = -2 - 0.5 * 4 = -4;  a = 0.5 a + 0.5 (-4) = (-4.25, -7.75).

Scalars are exact in E3M0 (each is its own scale), so the same numbers hold on that wire.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.compress.e3m0 import E3M0
from lowcomm.models import build_model
from lowcomm.optim.diloco import DiLoCo, DiLoCoArgs
from lowcomm.optim.streaming_diloco import (
    StreamingDiLoCo,
    StreamingDiLoCoArgs,
    fewest_steps_between_sends,
    fragment_params,
)
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.streaming_diloco import StreamingDiLoCoConfig, StreamingDiLoCoStrategy
from lowcomm.train.metrics import read_metrics
from runs import DroppingComm, kill_resume_and_compare, tensor_bytes, tiny_run, train_in_workers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD = 2
GRAD_A, GRAD_B = (1.0, 3.0), (2.0, 6.0)
EXPECTED_A = [(-1, -3), (-2, -6), (-2.5, -5.5), (-3.5, -8.5), (-4.25, -7.75)]
EXPECTED_B = [(-2, -6), (-3, -7), (-5, -13), (-6.25, -12.25), (-8.25, -18.25)]


# ---------------------------------------------------------------------------- E3M0
def test_e3m0_rounds_to_the_nearest_power_of_two_of_the_scale():
    # scale 8: magnitudes 8, 4, 2, 1, 1/2, 1/4, 1/8 and 0; boundaries at 1.5 x each power
    tensor = torch.tensor([8.0, -5.9, 6.1, 2.9, -3.1, 0.13, -0.05, 0.0, 1.4, 0.0624, 0.0626])
    codec = E3M0()
    payload = codec.encode(tensor)
    assert payload.tensors["codes"].dtype == torch.uint8 and payload.tensors["codes"].numel() == 6
    assert payload.nbytes == codec.payload_nbytes(tensor.shape, tensor.dtype) == 6 + 4
    expected = [8.0, -4.0, 8.0, 2.0, -4.0, 0.125, 0.0, 0.0, 1.0, 0.0, 0.125]
    assert codec.decode([payload]).tolist() == expected


@pytest.mark.parametrize("shape", [(7, 13), (5,), (1,), (3, 4, 5)])
def test_e3m0_relative_error_is_at_most_a_third_above_the_smallest_step(shape):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    decoded = E3M0().decode([E3M0().encode(tensor)])
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    scale = tensor.abs().max()
    big = tensor.abs() >= scale / 64
    assert torch.all((decoded[big] - tensor[big]).abs() <= tensor[big].abs() / 3 + 1e-6)
    assert torch.all(torch.sign(decoded[big]) == torch.sign(tensor[big]))


# ---------------------------------------------------------------------------- fragments
def test_fragments_group_blocks_strided_or_sequential_with_embedding_first_and_head_last():
    names = ["transformer.wte.weight"] + [f"transformer.blocks.{i}.{w}" for i in range(4) for w in ("x", "y")] + [
        "transformer.ln_f.weight"]
    params = {name: torch.nn.Parameter(torch.zeros(1)) for name in names}
    ids = {id(p): name for name, p in params.items()}

    def named(fragments):
        return [[ids[id(p)] for p in fragment] for fragment in fragments]

    strided = named(fragment_params(params.items(), 2, "strided"))
    assert strided == [
        ["transformer.wte.weight", "transformer.blocks.0.x", "transformer.blocks.0.y", "transformer.blocks.2.x",
         "transformer.blocks.2.y"],
        ["transformer.blocks.1.x", "transformer.blocks.1.y", "transformer.blocks.3.x", "transformer.blocks.3.y",
         "transformer.ln_f.weight"],
    ]
    sequential = named(fragment_params(params.items(), 2, "sequential"))
    assert sequential[0][1:] == ["transformer.blocks.0.x", "transformer.blocks.0.y", "transformer.blocks.1.x",
                                 "transformer.blocks.1.y"]


def test_schedule_staggers_the_fragments_evenly():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    optimizer = StreamingDiLoCo([[p] for p in params], lambda ps: torch.optim.SGD(ps, lr=1.0),
                                StreamingDiLoCoArgs.defaults(sync_every=8))
    assert optimizer.offsets == [0, 2, 4, 6]
    assert [optimizer.fragments_sent_at(t) for t in range(1, 9)] == [[], [1], [], [2], [], [3], [], [0]]


@pytest.mark.parametrize(("num_fragments", "sync_every", "gap"), [
    (4, 8, 2), (4, 10, 2),  # offsets 0, 2, 5, 7 of 10: sends 2, 3, 2 and 3 steps apart
    (4, 100, 25), (1, 10, 10), (3, 3, 1),
])
def test_the_fewest_steps_between_two_sends(num_fragments, sync_every, gap):
    assert fewest_steps_between_sends(num_fragments, sync_every) == gap


def test_a_dropped_exchange_moves_no_global_fragment_and_a_restored_one_asks_no_quorum():
    """H = 4, P = 2, tau = 1, alpha = 0.5, SGD lr 0.1 and gradient 1: fragment 1 is sent after
    step 2 and due at 3, where its exchange is dropped: the global copy stays at its start, 1,
    and the local fragment is mixed with it (0.5 x 0.7 + 0.5 x 1); fragment 0 keeps training."""
    comm = DroppingComm()
    fragments = [[torch.nn.Parameter(torch.ones(2))], [torch.nn.Parameter(torch.ones(3))]]
    params = [p for fragment in fragments for p in fragment]
    args = StreamingDiLoCoArgs(sync_every=4, overlap=1, mixing=0.5, outer_lr=0.7, outer_momentum=0.9,
                               nesterov=True, exchange="all_reduce")
    optimizer = StreamingDiLoCo(fragments, torch.optim.SGD(params, lr=0.1), args, comm=comm)
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    assert comm.commits == 1
    assert torch.equal(optimizer._global[1][0], torch.ones(3))  # unmoved: the start
    assert torch.allclose(fragments[1][0].detach(), torch.full((3,), 0.5 * 0.7 + 0.5 * 1.0))
    assert torch.allclose(fragments[0][0].detach(), torch.full((2,), 0.7))
    # fragment 0 sent after step 4, then the run checkpointed and resumed with it in flight: at its
    # due step no quorum holds it (none is asked), and between replica groups it is dropped
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = optimizer.state_dict()
    resumed = StreamingDiLoCo([[torch.nn.Parameter(torch.zeros(2))], [torch.nn.Parameter(torch.zeros(3))]],
                              lambda ps: torch.optim.SGD(ps, lr=0.1), args, comm=DroppingComm())
    resumed.load_state_dict(state)
    for fragment in resumed.fragments:
        fragment[0].grad = torch.ones_like(fragment[0])
    resumed.step()
    assert resumed.comm.commits == 0 and torch.equal(resumed._global[0][0], torch.ones(2))
    assert resumed.comm.fell_behind == 1  # its peers may have merged it: it heals at the next quorum


# ---------------------------------------------------------------------------- on real workers
def _optimizer(params, comm, codec, **overrides):
    args = StreamingDiLoCoArgs.defaults(**{**dict(sync_every=2, overlap=1, mixing=0.5, outer_lr=0.5,
                                                  outer_momentum=0.0), **overrides})
    return StreamingDiLoCo([[p] for p in params], lambda ps: torch.optim.SGD(ps, lr=1.0), args, compressor=codec,
                           comm=comm)


def _run(optimizer, params, comm, rank, steps):
    history, payload_bytes = [], []
    for _ in steps:
        params[0].grad = torch.tensor([GRAD_A[rank]], dtype=torch.float64)
        params[1].grad = torch.tensor([GRAD_B[rank]], dtype=torch.float64)
        optimizer.step()
        payload_bytes.append(int(comm.meter.end_step()["comm/payload_bytes"]))
        history.append([p.detach().clone() for p in params])
    return history, payload_bytes


def _scalars():
    return [torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)) for _ in range(2)]


def _nesterov_pair(comm, rank):
    """P = 1, tau = 0, alpha = 0 against DiLoCo with the same Nesterov outer step."""
    generator = torch.Generator().manual_seed(5)
    start = [torch.randn(3, 2, generator=generator, dtype=torch.float64), torch.randn(4, dtype=torch.float64,
                                                                                       generator=generator)]
    streaming = [torch.nn.Parameter(t.clone()) for t in start]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    inner = lambda ps: torch.optim.AdamW(ps, lr=0.1)  # noqa: E731
    optimizers = [
        StreamingDiLoCo([streaming], inner, StreamingDiLoCoArgs(sync_every=3, overlap=0, mixing=0.0, outer_lr=0.7,
                                                                outer_momentum=0.9, nesterov=True,
                                                                exchange="all_reduce"), comm=comm),
        DiLoCo(plain, inner, DiLoCoArgs(sync_every=3, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                                        error_feedback=None, exchange="all_reduce"), comm=comm),
    ]
    for step in range(1, 8):
        grads = torch.Generator().manual_seed(10 * rank + step)
        for a, b in zip(streaming, plain, strict=True):
            a.grad = torch.randn(a.shape, generator=grads, dtype=torch.float64)
            b.grad = a.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    return [p.detach() for p in streaming], [p.detach() for p in plain]


def _worker(rank: int, world_size: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    results = {}
    for name, codec, exchange in (("dense", None, "all_reduce"), ("e3m0", E3M0(), "all_reduce"),
                                  ("e3m0_gather", E3M0(), "all_gather")):
        comm = Communicator()
        params = _scalars()
        results[name] = _run(_optimizer(params, comm, codec, exchange=exchange), params, comm, rank, range(5))

    # resume after step 3: fragment 1's exchange (sent at 3) is in flight until step 4
    comm = Communicator()
    params = _scalars()
    optimizer = _optimizer(params, comm, E3M0())
    _run(optimizer, params, comm, rank, range(3))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    params = _scalars()
    optimizer = _optimizer(params, comm, E3M0())
    optimizer.load_state_dict(saved["optimizer"])  # its own parameters come with the optimizer state
    results["in_flight_saved"] = [(e["fragment"], e["due"]) for e in saved["optimizer"]["in_flight"]]
    results["resumed"] = _run(optimizer, params, comm, rank, range(3, 5))[0]
    results["nesterov"] = _nesterov_pair(Communicator(), rank)
    out = io.BytesIO()
    torch.save(results, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def worker_results() -> list[dict]:
    return [torch.load(io.BytesIO(blob)) for blob in spawn_workers(_worker, WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["dense", "e3m0", "e3m0_gather"])
def test_steps_match_the_hand_worked_example(worker_results, wire):
    for rank in range(WORLD):
        history, _ = worker_results[rank][wire]
        for step, (a, b) in enumerate(history):
            assert a.item() == EXPECTED_A[step][rank], f"a, rank {rank}, step {step + 1}"
            assert b.item() == EXPECTED_B[step][rank], f"b, rank {rank}, step {step + 1}"


@pytest.mark.slow
def test_each_fragment_is_charged_at_the_step_it_is_sent(worker_results):
    for rank in range(WORLD):
        # one float64 scalar per step (dense all-reduce); E3M0: one byte of codes + a float32 scale,
        # all-gathered or (the scalar is one rank's whole chunk) all-reduced
        assert worker_results[rank]["dense"][1] == [8] * 5
        assert worker_results[rank]["e3m0"][1] == worker_results[rank]["e3m0_gather"][1] == [5] * 5


@pytest.mark.slow
def test_resume_with_an_exchange_in_flight_is_bit_identical(worker_results):
    for rank in range(WORLD):
        assert worker_results[rank]["in_flight_saved"] == [(1, 4)]
        straight = worker_results[rank]["e3m0"][0][3:]
        for resumed, reference in zip(worker_results[rank]["resumed"], straight, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(resumed, reference, strict=True))


@pytest.mark.slow
def test_one_fragment_without_overlap_or_mixing_is_diloco(worker_results):
    for rank in range(WORLD):
        streaming, plain = worker_results[rank]["nesterov"]
        for a, b in zip(streaming, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------- config, strategy, runs
def test_config_file_holds_the_paper_settings_and_validates():
    fields = OmegaConf.load(CONFIGS / "optimizer" / "streaming_diloco.yaml")
    assert fields.pop("name") == "streaming_diloco"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StreamingDiLoCoConfig), fields))
    assert cfg.validate() == []
    assert (cfg.sync_every, cfg.num_fragments, cfg.pattern, cfg.overlap, cfg.mixing, cfg.quantization) == (
        100, 4, "strided", 1, 0.5, "e3m0")
    assert StreamingDiLoCoConfig.defaults(sync_every=4, num_fragments=5, overlap=4, pattern="x").validate() == [
        "optimizer.overlap must be in [0, sync_every), got 4",
        "optimizer.num_fragments must be <= sync_every (one staggered offset per fragment), got 5 > 4",
        "optimizer.pattern must be one of strided, sequential, got 'x'",
    ]
    assert STRATEGIES["streaming_diloco"] is StreamingDiLoCoStrategy


def test_strategy_bytes_amortised_and_peak():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(4)])
    cfg = StreamingDiLoCoConfig.defaults(sync_every=8, num_fragments=4, quantization="none")
    strategy = StreamingDiLoCoStrategy(cfg, {"name": "none"}, Communicator())
    _, optimizer = strategy.build(model)
    assert [len(f) for f in optimizer.fragments] == [1, 1, 1, 1]
    assert strategy.analytic_payload_bytes(model) == 4 * 64 * 4 / 8
    assert strategy.analytic_peak_payload_bytes(model) == 64 * 4
    # dense: a ring all-reduce, 2 (W-1)/W x the payload
    assert strategy.analytic_traffic(model, 2) == (4 * 64 * 4 / 8, 4 * 64 * 4 / 8, 4 * 64 * 4 / 8, 0.0)
    # E3M0: half a byte per entry and a 4-byte scale per row (8 rows) for each 8 x 8 weight
    e3m0 = StreamingDiLoCoStrategy(StreamingDiLoCoConfig.defaults(sync_every=8), {"name": "none"}, Communicator())
    assert e3m0.analytic_payload_bytes(model) == 4 * (32 + 4 * 8) / 8
    # the quantized all-reduce at W = 2: each weight in two 4-row chunks of 16 + 16 bytes; a rank
    # sends the other's chunk (32 B) and forwards its reduced one (32 B) per weight
    # (half of it, the all-to-all, straight to the other rank)
    assert e3m0.analytic_traffic(model, 2) == (4 * 64 / 8, 4 * 64 / 8, 4 * 64 / 8, 4 * 32 / 8)
    gathered = StreamingDiLoCoStrategy(StreamingDiLoCoConfig.defaults(sync_every=8, exchange="all_gather"),
                                       {"name": "none"}, Communicator())
    assert gathered.analytic_traffic(model, 4) == (4 * 64 / 8, 3 * 4 * 64 / 8, 3 * 4 * 64 / 8, 0.0)


@pytest.mark.parametrize("overlap", [1, 3])
def test_the_checkpoint_estimate_is_the_largest_state_a_worker_holds(overlap):
    """The dry run's per-rank bytes against the optimizer's own state, step by step over two
    cycles: the largest is the estimate (the fragments' means in flight at once included)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(3)], torch.nn.Linear(8, 4))
    cfg = StreamingDiLoCoConfig.defaults(sync_every=4, num_fragments=2, quantization="none", overlap=overlap)
    strategy = StreamingDiLoCoStrategy(cfg, {"name": "none"}, Communicator())
    _, optimizer = strategy.build(model)
    held = []
    for _ in range(8):
        model(torch.randn(3, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        held.append(tensor_bytes(optimizer.state_dict()))
    assert strategy.optimizer_state_bytes(model, 1) == (0.0, max(held))



@pytest.mark.slow
def test_streaming_peak_is_below_diloco_at_the_same_amortised_bytes(tmp_path):
    """Real tiny runs: DiLoCo sends every parameter at once every H steps; Streaming DiLoCo
    with two fragments sends each on its own step, so its peak is the larger fragment's."""
    common = ["optimizer.sync_every=4", "train.checkpoint_every=0"]
    diloco = tiny_run(tmp_path, "optimizer=diloco", *common, max_steps=8)
    streaming = tiny_run(tmp_path, "optimizer=streaming_diloco", "optimizer.num_fragments=2",
                         "optimizer.quantization=none", *common, max_steps=8)
    summaries = {}
    for name, run in (("diloco", diloco), ("streaming", streaming)):
        train_in_workers(run)
        summaries[name] = json.loads((run.run_dir / "summary.json").read_text())
    model = build_model(diloco.model, "meta")
    numel = sum(p.numel() for p in model.parameters())
    strategy = StreamingDiLoCoStrategy(streaming.optimizer, {"name": "none"}, Communicator())
    fragments = [sum(p.numel() for p in f) for f in strategy.fragments(model)]
    assert summaries["diloco"]["comm/peak_MB"] == pytest.approx(numel * 4 / 1e6)
    assert summaries["streaming"]["comm/peak_MB"] == pytest.approx(max(fragments) * 4 / 1e6)
    assert summaries["streaming"]["comm/peak_MB"] < summaries["diloco"]["comm/peak_MB"]
    assert summaries["streaming"]["cum_payload_MB"] == pytest.approx(summaries["diloco"]["cum_payload_MB"])
    per_step = [r["comm/payload_bytes"] for r in read_metrics(streaming.run_dir / "metrics.jsonl")]
    assert per_step == [0, fragments[1] * 4, 0, fragments[0] * 4] * 2


@pytest.mark.slow
def test_sigkill_with_an_exchange_in_flight_then_resume_is_bit_identical(tmp_path):
    # H = 4, two fragments (offsets 0 and 2), tau = 2: fragment 0 is sent at step 4 and merged at
    # 6, so the checkpoint at step 5 holds it in flight
    kill_resume_and_compare(tmp_path, "optimizer=streaming_diloco", "optimizer.sync_every=4",
                            "optimizer.num_fragments=2", "optimizer.overlap=2", "optimizer.lr=3e-3")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "parameters"), [("olmo_300m", 319_946_752), ("olmo_1b", 1_176_764_416)])
def test_comm_table_rows_for_the_paper_models(model, parameters):
    """E3M0: half a byte per parameter plus a 4 B scale per row, every fragment once per H; the
    quantized all-reduce sends about 2 (W-1)/W of it."""
    from lowcomm.report.comm_table import build_table  # noqa: PLC0415 - report sits above this test's subject

    rows = build_table([model], 64, [("streaming", ["optimizer=streaming_diloco"], False)])
    d = 1024 if model == "olmo_300m" else 2048
    rows_total = 50_304 + 16 * (3 * d + d + 8 * d + d)  # embedding, then att_proj, attn_out, ff_proj, ff_out
    payload = (parameters / 2 + 4 * rows_total) / 100
    assert rows[0].payload_mb * 1e6 == pytest.approx(payload, rel=1e-9)
    assert rows[0].tx_mb * 1e6 == pytest.approx(2 * 63 / 64 * payload, rel=2e-3)
    cfg = StreamingDiLoCoConfig.defaults()
    strategy = StreamingDiLoCoStrategy(cfg, {"name": "none"}, Communicator())
    spec = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{model}.yaml"))
    from lowcomm.models import ModelSpec  # noqa: PLC0415

    meta = build_model(ModelSpec(**spec), "meta")
    peak = strategy.analytic_peak_payload_bytes(meta)
    # fragment 0 holds the embedding (50304 x d) and blocks 0, 4, 8, 12, each 16 d^2 (att_proj 3d x d,
    # attn_out d x d, ff_proj 8d x d, ff_out d x 4d): the largest of the four fragments
    d = 1024 if model == "olmo_300m" else 2048
    assert peak == (50304 * d + 4 * 16 * d * d) // 2 + 4 * (50304 + 4 * 13 * d)  # a scale per row
