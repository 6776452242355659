"""benchmarks/senders.py: each method's receiving side with W simulated senders, on one device;
and the one-pass decodes it led to (the quantized all-reduce's stacked chunks, SparseLoCo's
stacked payloads), each checked against the per-chunk, per-worker computation it replaces."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.quantized import chunk_bounds, chunk_runs, stacked_chunks
from lowcomm.compress.base import Payload
from lowcomm.compress.chunked_topk import ChunkedTopK
from lowcomm.compress.e3m0 import E3M0
from lowcomm.compress.quantize import Quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import senders  # noqa: E402  (a benchmark script)

CODECS = [Quantize(bits=2), Quantize(bits=4, method="linear"), Quantize(bits=8), E3M0(), E3M0(rowwise=False)]


# ----------------------------------------------------------- one-pass encodes and decodes
@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("shape", [(3, 5, 7), (4, 9), (5,)])
def test_a_stack_of_chunks_encodes_and_decodes_as_each_chunk_alone(codec, shape):
    """Row i of encode_stacked (k chunks of one shape, an odd number of codes each) is
    encode(chunk i), bit for bit at these sizes (below the 32K entries where the CPU splits a
    flat mean across threads), and dequantize of the stack is each row's values."""
    chunks = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    stacked = codec.encode_stacked(chunks)
    values = codec.dequantize(stacked)
    assert values.shape == (shape[0], chunks[0].numel())
    for row, chunk in enumerate(chunks):
        alone = codec.encode(chunk)
        assert stacked.tensors.keys() == alone.tensors.keys()
        for key, tensor in alone.tensors.items():
            assert torch.equal(stacked.tensors[key][row], tensor), key
        assert torch.equal(values[row], codec.decode([alone]).reshape(-1))


def test_chunk_runs_cover_the_nonempty_chunks_in_runs_of_one_shape():
    for shape, world in [((13, 9), 4), ((3, 40), 7), ((101,), 7), ((), 2), ((64, 2), 8)]:
        runs = chunk_runs(shape, world)
        assert len(runs) <= 2
        covered = [(rank, first + (rank - ranks.start) * size, first + (rank - ranks.start + 1) * size)
                   for ranks, first, size in runs for rank in ranks]
        assert covered == [(rank, start, stop) for rank, (start, stop) in enumerate(chunk_bounds(shape, world))
                           if stop > start]
    tensor = torch.arange(13 * 9.0).view(13, 9)
    larger, smaller = chunk_runs(tensor.shape, 4)  # 13 rows: 4, 3, 3, 3
    assert (larger[0], smaller[0]) == (range(0, 1), range(1, 4))
    assert torch.equal(stacked_chunks(tensor, smaller)[1], tensor[7:10])  # chunk 2 of 4: rows 7-9
    assert stacked_chunks(tensor, smaller).data_ptr() == tensor[4].data_ptr()  # a view, not a copy


@pytest.mark.parametrize("wire", ["packed", "templar", "reference"])
@pytest.mark.parametrize("bits", [2, None])
def test_gathered_payloads_decode_in_one_pass_as_one_by_one(wire, bits):
    """ChunkedTopK.decode_gathered of W payloads stacked (what all_gather_stacked leaves), and
    decode() of the list, are the per-worker computation bit for bit: each entry's mean over
    the workers that sent it, summed in worker order; one payload decodes to its values."""
    codec = ChunkedTopK(chunk=8, topk=5, bits=bits, wire=wire)
    generator = torch.Generator().manual_seed(3)
    payloads = [codec.encode(torch.randn(20, 12, generator=generator)) for _ in range(5)]
    stacked = Payload({key: torch.stack([p.tensors[key] for p in payloads]) for key in payloads[0].tensors},
                      payloads[0].meta)
    # the per-worker computation it replaces: one payload at a time, summed in worker order
    sums, senders_ = torch.zeros(20 * 12), torch.zeros(20 * 12)
    for payload in payloads:
        positions, values = codec._sparse(payload)  # noqa: SLF001 - one worker's entries
        sums.index_add_(0, positions, values)
        senders_.index_add_(0, positions, torch.ones_like(values))
    expected = (sums / senders_.clamp(min=1)).view(20, 12)
    assert torch.equal(codec.decode_gathered(stacked), expected)
    assert torch.equal(codec.decode(payloads), expected)
    assert torch.equal(codec.decode(payloads[:1]), sums.zero_().index_add_(0, *codec._sparse(payloads[0])).view(20, 12))  # noqa: SLF001


# ------------------------------------------------------------------- the benchmark itself
def test_identical_senders_step_as_one_worker():
    """With no noise of their own (spread 0) the other sender sends what rank 0 sends, and
    every method's mean of two identical contributions (exact in floating point: v + v = 2v)
    is rank 0's own: its first step with two senders lands where its first step alone does,
    bit for bit. (The quantized all-reduce is left out: at W = 2 it quantizes each
    half of a tensor with its own statistics, at W = 1 the whole, by design.)"""
    for name in [name for name in senders.METHODS if name != "quantized"]:
        setup = senders.Setup.of(name)
        alone = senders.with_senders(setup, 1, steps=1, warmup=0, spread=0.0)["params"]
        two = senders.with_senders(setup, 2, steps=1, warmup=0, spread=0.0)["params"]
        for one, other in zip(alone, two, strict=True):
            assert torch.equal(other, one), name


def test_senders_of_their_own_change_the_step():
    """The converse, so the first test cannot pass by ignoring the senders: with noise of
    their own, rank 0's step differs from its step alone."""
    setup = senders.Setup.of("demo")
    alone = senders.with_senders(setup, 1, steps=1, warmup=1, spread=1.0)["params"]
    four = senders.with_senders(setup, 4, steps=1, warmup=1, spread=1.0)["params"]
    assert any(not torch.equal(one, other) for one, other in zip(alone, four, strict=True))


@pytest.mark.parametrize("name", ["demo", "distro", "sparseloco"])
def test_bytes_received_are_the_all_gathers_the_strategy_declares(name):
    """What rank 0 is metered as receiving at W = 5 is its strategy's analytic all-gather: W-1
    payloads (SparseLoCo at H = 1: every step syncs)."""
    setup = senders.Setup.of(name)
    received = senders.with_senders(setup, 5, steps=1, warmup=1)["rx_MB"]
    strategy = setup.strategy_class(setup.cfg, setup.raw.get("compression") or {}, Communicator())
    declared = strategy.analytic_traffic(setup.model, 5)
    assert received * 1e6 == pytest.approx(declared.rx, abs=1)
    assert declared.rx == pytest.approx(4 * strategy.analytic_payload_bytes(setup.model))


def test_a_collective_out_of_the_recorded_order_is_named():
    comm = senders.SimulatedSenders(3, 0, torch.device("cpu"), received=[("all_gather", torch.zeros(2, 4))])
    with pytest.raises(RuntimeError, match="call 0 is all_reduce here, but the senders recorded all_gather"):
        comm.all_reduce(torch.zeros(4))


def test_the_command_prints_each_method_at_each_w_then_a_table_and_json(capsys):
    assert senders.main(["--workers", "1", "3", "--steps", "1", "--methods", "demo", "quantized", "powersgd"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^\[senders\] (demo|quantized|powersgd) W=[13]: [\d.]+ ms/step", out, re.MULTILINE)) == 6
    # its own ms at W = 1 and 3 (x W = 1), MB received at each, the simulated backend's writes at 3
    assert re.search(r"^\| DeMo \| [\d.]+ \| [\d.]+ \([\d.]+x\) \| 0\.000 \| [\d.]+ \| [\d.]+ \|$", out, re.MULTILINE)
    figures = json.loads(out.strip().splitlines()[-1])
    assert set(figures["steps"]) == {"demo", "quantized", "powersgd"}
    assert all(set(by_w) == {"1", "3"} for by_w in figures["steps"].values())
    assert figures["rx_MB"]["demo"]["1"] == 0 and figures["rx_MB"]["demo"]["3"] > 0
    assert figures["writes_ms"]["demo"]["1"] == 0 and figures["writes_ms"]["demo"]["3"] > 0


def test_bad_arguments_are_refused(capsys):
    for argv, message in ((["--workers", "0"], "--workers are at least 1"), (["--steps", "0"], "--steps is at least 1")):
        with pytest.raises(SystemExit) as exit_info:
            senders.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_prepared_gpu_run_runs_every_row_here_on_tiny_shapes(tmp_path):
    """benchmarks/gpu_targets.sh --smoke: the GPU run's commands, on this CPU and tiny shapes,
    every one to its end, every target row printed (what a GPU lease runs, known to work)."""
    import subprocess

    from lowcomm.strategies import STRATEGIES

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_targets.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path), "--smoke"], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("senders_300m", "senders_1b", "targets", "others")}
    for name, log in logs.items():
        assert re.search(r"^=== rc=0 after \d+ s$", log, re.MULTILINE), (name, log[-2000:])
    assert "| SparseLoCo |" in logs["senders_300m"] and "| quantized all-reduce |" in logs["senders_300m"]
    for figure in ("DeMo step / fused AdamW step", "DeMo step at 4 simulated senders / at 1",
                   "DeMo's 300M training step / AdamW-DDP's", "AdamW-DDP MFU by 6N, 300M",
                   "DeMo's 1B training step / AdamW-DDP's", "AdamW-DDP MFU by OLMo-core's formula, 1B"):
        assert f"| CPU, {figure}" in logs["targets"], figure
    assert "one checkpoint written in" in logs["targets"]
    others = re.findall(r"^\| CPU, (.+?): 300M training step / AdamW-DDP's, W=1 \|", logs["others"], re.MULTILINE)
    assert len(others) == len(STRATEGIES) - 2  # every method but AdamW-DDP (the baseline) and DeMo (its own rows)
    assert (tmp_path / "environment.txt").read_text().strip()
