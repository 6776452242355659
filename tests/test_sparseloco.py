"""SparseLoCo: its codec (chunked top-k, 12-bit packed indices, low-bit values) on odd shapes,
and the optimizer on three real gloo workers against outer steps worked out by hand.

The hand-worked case: W = 3 workers, one 2 x 2 parameter starting at 0, chunk 2 (one block of 4
entries), top-1, no quantization, error-feedback beta 0.5, outer lr 1, inner SGD with lr 1 and
H = 1, so every step is a synchronisation and worker r's pseudo-gradient is its gradient g_r:

    g_0 = [[4, 1], [0, 0]]   g_1 = [[0, -3], [1, 0]]   g_2 = [[0, 0], [0, 2]]

Step 1: E_r = g_r; each worker sends its largest entry: 4 at (0,0), -3 at (0,1), 2 at (1,1).
  mean over W:       Delta = [[4/3, -1], [0, 2/3]]      theta_1 = -Delta
  mean over senders: Delta = [[4, -3], [0, 2]]           (each entry was sent by one worker)
  residuals: E_0 = [[0, 1], [0, 0]], E_1 = [[0, 0], [1, 0]], E_2 = 0.
Step 2: E_r = 0.5 E_r + g_r: E_0 = [[4, 1.5], [0, 0]], E_1 = [[0, -3], [1.5, 0]], E_2 = g_2:
  the same entries win, so theta_2 = 2 theta_1 and the residuals become [[0, 1.5], ...], [[..], [1.5, 0]].
Step 3: E_0 = [[4, 1.75], [0, 0]]; E_1 = [[0, -3], [1.75, 0]]: still the same winners (theta_3 = 3 theta_1).
Step 4 with g_0 replaced by [[1, 1], [0, 0]] (tie-free because of the residual): E_0 = [[1, 1.875], ...]
  -> worker 0 now sends 1.875 at (0,1): mean-over-W Delta_4 = [[0, (1.875 - 3)/3], [0, 2/3]].
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.compress.chunked_topk import ChunkedTopK, pack_uint12, unpack_uint12
from lowcomm.optim.sparseloco import SparseLoCo, SparseLoCoArgs
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.sparseloco import SparseLoCoConfig, SparseLoCoStrategy
from runs import DroppingComm, kill_resume_and_compare

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD = 3
ODD_SHAPES = [(7, 13), (5,), (97,), (3, 4, 5), (1,), (6, 10), (128, 130)]


# ---------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("count", [0, 1, 2, 5, 4096])
def test_twelve_bit_indices_pack_three_bytes_per_pair_and_round_trip(count):
    values = torch.arange(count) * 7919 % 4096
    packed = pack_uint12(values)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * math.ceil(count / 2)
    assert torch.equal(unpack_uint12(packed, count), values)


def test_twelve_bit_layout_is_the_documented_one():
    # 0xABC and 0x123 -> bytes 0xBC, 0x3A (low nibble: A of the first; high: 3 of the second), 0x12
    assert pack_uint12(torch.tensor([0xABC, 0x123])).tolist() == [0xBC, 0x3A, 0x12]
    with pytest.raises(ValueError):
        pack_uint12(torch.tensor([4096]))


def _blocks_by_hand(tensor: torch.Tensor, chunk: int) -> list[list[tuple[int, float]]]:
    """(flat position, value) of every block of DeMo's chunk rule, by explicit loops."""
    def chunk_of(size):
        return size if size <= chunk else max(c for c in range(1, chunk + 1) if size % c == 0)

    shape = tensor.shape
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    flat = tensor.reshape(-1).tolist()
    cr, cc = chunk_of(rows), chunk_of(cols)
    blocks = []
    for br in range(rows // cr):
        for bc in range(cols // cc):
            blocks.append([((br * cr + i) * cols + bc * cc + j, flat[(br * cr + i) * cols + bc * cc + j])
                           for i in range(cr) for j in range(cc)])
    return blocks


@pytest.mark.filterwarnings("ignore:a dimension of size")
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("wire", ["reference", "templar", "packed"])
def test_decode_of_encode_keeps_each_blocks_largest_entries_on_odd_shapes(shape, wire):
    generator = torch.Generator().manual_seed(sum(shape))
    tensor = torch.randn(shape, generator=generator, dtype=torch.float64)
    codec = ChunkedTopK(chunk=4, topk=3, bits=None, wire=wire)
    payload = codec.encode(tensor)
    decoded = codec.decode([payload])
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    expected = torch.zeros(tensor.numel(), dtype=tensor.dtype)
    for block in _blocks_by_hand(tensor, 4):
        keep = min(len(block), max(1, round(len(block) * 3 / 16)))
        for position, value in sorted(block, key=lambda item: -abs(item[1]))[:keep]:
            expected[position] = value
    assert torch.equal(decoded.reshape(-1), expected)
    assert payload.nbytes == codec.payload_nbytes(tensor.shape, tensor.dtype)


@pytest.mark.filterwarnings("ignore:a dimension of size")
@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_bytes_are_really_packed_and_decode_like_the_reference_wire(shape, bits):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float32)
    packed, paper = ChunkedTopK(64, 64, bits, "packed"), ChunkedTopK(64, 64, bits, "reference")
    templar = ChunkedTopK(64, 64, bits, "templar")
    layout = packed.layout(tensor.shape)
    kept = layout.num_blocks * packed.kept_per_block(layout)
    payload = packed.encode(tensor)
    assert {k: t.dtype for k, t in payload.tensors.items()} == {
        "indices": torch.uint8, "codes": torch.uint8, "table": torch.float32}
    assert payload.tensors["indices"].numel() == 3 * math.ceil(kept / 2)
    assert payload.tensors["codes"].numel() == math.ceil(kept * bits / 8)
    assert payload.tensors["table"].numel() == 2**bits
    assert payload.nbytes == packed.payload_nbytes(tensor.shape, tensor.dtype)
    reference = paper.encode(tensor)
    assert reference.tensors["indices"].dtype == torch.int64 and reference.tensors["codes"].numel() == kept
    assert torch.equal(packed.decode([payload]), paper.decode([reference]))
    # templar: the 12-bit indices of the packed wire, one byte per code as the reference
    unpacked = templar.encode(tensor)
    assert unpacked.tensors["indices"].numel() == 3 * math.ceil(kept / 2) and unpacked.tensors["codes"].numel() == kept
    assert unpacked.nbytes == templar.payload_nbytes(tensor.shape, tensor.dtype)
    assert torch.equal(templar.decode([unpacked]), paper.decode([reference]))


def test_two_bit_values_decode_to_the_mean_of_their_bin():
    """Eight kept values, 2-bit bins worked out in plain Python: the reference rounds to multiples
    of s = 6 sigma / 4 around the mean (sigma with Bessel's correction, as the SparseLoCo and
    MuLoCo code)."""
    tensor = torch.tensor([[8.0, 0.1, -6.0, 0.2], [0.3, 1.0, 0.1, -2.0], [2.5, 0.2, -0.5, 0.1], [0.2, 4.0, 0.3, -1.0]])
    codec = ChunkedTopK(chunk=2, topk=2, bits=2, wire="packed")  # four 2x2 blocks, two kept in each
    kept = {0: 8.0, 5: 1.0, 2: -6.0, 7: -2.0, 8: 2.5, 13: 4.0, 10: -0.5, 15: -1.0}
    values = list(kept.values())
    mean = sum(values) / 8
    step = 6 * math.sqrt(sum((v - mean) ** 2 for v in values) / 7) / 4
    bins = {p: min(3, max(0, round((v - mean) / step + 2))) for p, v in kept.items()}
    table = {b: sum(v for p, v in kept.items() if bins[p] == b) / max(1, sum(bins[p] == b for p in kept))
             for b in range(4)}
    expected = torch.zeros(16)
    for position in kept:
        expected[position] = table[bins[position]]
    assert len(set(bins.values())) >= 3  # the case spreads over the bins
    decoded = codec.decode([codec.encode(tensor)]).reshape(-1)
    torch.testing.assert_close(decoded, expected, rtol=1e-6, atol=1e-6)
    assert sorted(bins.values()) == [1, 2, 2, 2, 2, 2, 3, 3]


def test_entries_sent_by_one_two_and_all_workers_are_averaged_over_their_senders():
    """Three workers, top-2 of one 2x2 block: (0,0) is sent by all three, (0,1) by workers 0 and
    1, (1,0) by worker 2 alone, (1,1) by nobody. Over senders: (4 + 1 + 7) / 3 = 4, (2 - 6) / 2 =
    -2, 5 / 1 = 5, 0. Over all R = 3 (Algorithm 1 as printed) the lone entry would move 5/3."""
    codec = ChunkedTopK(chunk=2, topk=2, bits=None, wire="packed")
    payloads = [codec.encode(torch.tensor(t)) for t in ([[4.0, 2.0], [0.0, 1.0]], [[1.0, -6.0], [0.5, 0.0]],
                                                         [[7.0, 0.0], [5.0, 0.0]])]
    assert codec.decode(payloads).tolist() == [[4.0, -2.0], [5.0, 0.0]]
    over_all = sum(codec.decode([p]) for p in payloads) / 3
    assert over_all[1].tolist() == pytest.approx([5.0 / 3, 0.0])


def test_several_payloads_decode_to_the_mean_over_senders():
    codec = ChunkedTopK(chunk=2, topk=1, bits=None, wire="packed")
    first = codec.encode(torch.tensor([[4.0, 1.0], [0.0, 0.0]]))
    second = codec.encode(torch.tensor([[2.0, 0.0], [0.0, -3.0]]))
    assert codec.decode([first, second]).tolist() == [[4.0, 0.0], [0.0, -3.0]]
    third = codec.encode(torch.tensor([[6.0, 0.0], [0.0, 0.0]]))
    assert codec.decode([first, third]).tolist() == [[5.0, 0.0], [0.0, 0.0]]


# ---------------------------------------------------------------------------- the optimizer
GRADS = {
    0: [[4.0, 1.0], [0.0, 0.0]],
    1: [[0.0, -3.0], [1.0, 0.0]],
    2: [[0.0, 0.0], [0.0, 2.0]],
}
STEP4_GRAD_0 = [[1.0, 1.0], [0.0, 0.0]]


def _hand_optimizer(param, comm, aggregate):
    args = SparseLoCoArgs.defaults(sync_every=1, outer_lr=1.0, outer_momentum=0.0, error_feedback=0.5, chunk=2,
                                   topk=1, bits=None, wire="packed", aggregate=aggregate)
    return SparseLoCo([param], lambda ps: torch.optim.SGD(ps, lr=1.0), args, comm=comm)


# A wider case with 2-bit values and H = 2 for the resume check: any shape, any numbers.
WIDE_SHAPES = [(6, 10), (7,)]


def _wide_optimizer(params, comm):
    args = SparseLoCoArgs.defaults(sync_every=2, outer_lr=0.8, outer_momentum=0.0, error_feedback=0.95, chunk=4,
                                   topk=3, bits=2, wire="packed", aggregate="mean")
    return SparseLoCo(params, lambda ps: torch.optim.AdamW(ps, lr=0.05), args, comm=comm)


def _wide_params():
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in WIDE_SHAPES]


def _wide_train(params, optimizer, comm, rank, steps):
    for step in steps:
        generator = torch.Generator().manual_seed(100 * rank + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        comm.meter.end_step()
    return [p.detach().clone() for p in params]


def _worker(rank: int, world_size: int) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    torch.set_num_threads(1)
    results = {}
    for aggregate in ("mean", "senders"):
        comm = Communicator()
        param = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
        optimizer = _hand_optimizer(param, comm, aggregate)
        history, payload_bytes = [], []
        for step in range(1, 5):
            grad = STEP4_GRAD_0 if (step == 4 and rank == 0) else GRADS[rank]
            param.grad = torch.tensor(grad, dtype=torch.float64)
            optimizer.step()
            payload_bytes.append(int(comm.meter.end_step()["comm/payload_bytes"]))
            history.append(param.detach().clone())
        results[aggregate] = {"history": history, "payload_bytes": payload_bytes,
                              "error": optimizer.state_dict()["error_feedback"][0]}

    comm = Communicator()
    params = _wide_params()
    straight = _wide_train(params, _wide_optimizer(params, comm), comm, rank, range(1, 8))
    params = _wide_params()
    optimizer = _wide_optimizer(params, comm)
    _wide_train(params, optimizer, comm, rank, range(1, 4))  # stop mid-interval (H = 2)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in WIDE_SHAPES]
    optimizer = _wide_optimizer(params, comm)
    with torch.no_grad():
        for p, value in zip(params, saved["params"], strict=True):
            p.copy_(value)
    optimizer.load_state_dict(saved["optimizer"])
    results["resumed"] = _wide_train(params, optimizer, comm, rank, range(4, 8))
    results["straight"] = straight
    out = io.BytesIO()
    torch.save(results, out)
    return out.getvalue()


@pytest.fixture(scope="module")
def worker_results() -> list[dict]:
    return [torch.load(io.BytesIO(blob)) for blob in spawn_workers(_worker, WORLD)]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.slow
def test_outer_steps_match_the_hand_worked_example_mean_over_workers(worker_results):
    theta_1 = -_t([[4 / 3, -1.0], [0.0, 2 / 3]])
    delta_4 = _t([[0.0, (1.875 - 3.0) / 3], [0.0, 2 / 3]])
    expected = [theta_1, 2 * theta_1, 3 * theta_1, 3 * theta_1 - delta_4]
    for rank in range(WORLD):
        for step, (observed, wanted) in enumerate(zip(worker_results[rank]["mean"]["history"], expected, strict=True)):
            torch.testing.assert_close(observed, wanted, rtol=0, atol=1e-12, msg=f"rank {rank}, step {step + 1}")
    # worker 0 kept 1 at (0,0) after sending 1.875 at (0,1); worker 1 holds 0.5 * 1.75 + 1 at (1,0)
    torch.testing.assert_close(worker_results[0]["mean"]["error"], _t([[1.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(worker_results[1]["mean"]["error"], _t([[0.0, 0.0], [1.875, 0.0]]))


@pytest.mark.slow
def test_outer_steps_match_the_hand_worked_example_mean_over_senders(worker_results):
    theta_1 = -_t([[4.0, -3.0], [0.0, 2.0]])
    # step 4: (0,1) is sent by workers 0 (1.875) and 1 (-3): mean over the two senders
    delta_4 = _t([[0.0, (1.875 - 3.0) / 2], [0.0, 2.0]])
    expected = [theta_1, 2 * theta_1, 3 * theta_1, 3 * theta_1 - delta_4]
    for rank in range(WORLD):
        for observed, wanted in zip(worker_results[rank]["senders"]["history"], expected, strict=True):
            torch.testing.assert_close(observed, wanted, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_each_sync_sends_one_packed_index_and_value_per_block(worker_results):
    # one kept float64 value (8 B) and one 12-bit index padded to a pair (3 B) per step
    for rank in range(WORLD):
        assert worker_results[rank]["mean"]["payload_bytes"] == [11, 11, 11, 11]


@pytest.mark.slow
def test_resume_from_state_dict_mid_interval_is_bit_identical(worker_results):
    for rank in range(WORLD):
        for resumed, straight in zip(worker_results[rank]["resumed"], worker_results[rank]["straight"], strict=True):
            assert torch.equal(resumed, straight)
    assert not torch.equal(worker_results[0]["straight"][0], worker_results[1]["straight"][0])  # step 7: local


# ---------------------------------------------------------------------------- config and strategy
def test_config_file_holds_the_paper_defaults_and_validates():
    fields = OmegaConf.load(CONFIGS / "optimizer" / "sparseloco.yaml")
    assert fields.pop("name") == "sparseloco"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SparseLoCoConfig), fields))
    assert cfg.validate() == []
    assert (cfg.sync_every, cfg.outer_lr, cfg.outer_momentum, cfg.error_feedback) == (15, 1.0, 0.0, 0.95)
    # the released paper sweep's top-128, the reference code's aggregation over senders
    assert (cfg.chunk, cfg.topk, cfg.bits, cfg.wire, cfg.aggregate) == (64, 128, 2, "packed", "senders")
    assert SparseLoCoConfig.defaults(chunk=128, topk=64).validate() == [
        "optimizer.wire=packed sends 12-bit block indices, so chunk must be <= 64, got 128"]
    assert SparseLoCoConfig.defaults(bits=3, aggregate="sum").validate() == [
        "optimizer.bits must be null or one of 2, 4, 8, got 3",
        "optimizer.aggregate must be one of mean, senders, got 'sum'",
    ]
    assert STRATEGIES["sparseloco"] is SparseLoCoStrategy


def test_strategy_reports_amortised_packed_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(64, 128, bias=False))
    strategy = SparseLoCoStrategy(SparseLoCoConfig.defaults(), {"name": "none"}, Communicator())
    wrapped, optimizer = strategy.build(model)
    assert wrapped is model and isinstance(optimizer, SparseLoCo) and strategy.exchange() == "all_gather"
    # each 64x128 / 128x64 weight: two 64x64 blocks x 128 kept = 256 entries: 384 B of indices,
    # 64 B of 2-bit codes, a 16 B table; once per 15 steps
    assert strategy.analytic_payload_bytes(model) == pytest.approx(2 * (384 + 64 + 16) / 15)
    payload, tx, rx, direct = strategy.analytic_traffic(model, 4)
    assert payload == pytest.approx(2 * (384 + 64 + 16) / 15) and tx == rx == pytest.approx(3 * payload) and direct == 0


# ---------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(tmp_path):
    kill_resume_and_compare(tmp_path, "optimizer=sparseloco", "optimizer.sync_every=3", "optimizer.lr=3e-3")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "parameters"), [("olmo_300m", 319_946_752), ("olmo_1b", 1_176_764_416)])
def test_comm_table_rows_for_the_paper_models(model, parameters):
    """Every OLMo dimension is a multiple of 64, so each weight keeps 128/4096 = 1/32 of its
    entries: 1.5 B of index and 2/8 B of code each, plus a 16 B table per tensor, once per H = 15
    steps; the all-gather sends the payload once and receives W-1 of them. templar's wire keeps
    1/64 at 1.5 B of index and a whole byte per 2-bit code."""
    from lowcomm.report.comm_table import build_table  # noqa: PLC0415 - report sits above this test's subject

    rows = {row.label: row for row in build_table(
        [model], 64, [("sparseloco", ["optimizer=sparseloco"], False),
                      ("templar", ["optimizer=sparseloco", "optimizer.topk=64", "optimizer.wire=templar"], False)])}
    tensors = 1 + 4 * (16 if model == "olmo_1b" else 16)  # embedding + 4 weights per block
    expected = (parameters / 32 * 1.75 + 16 * tensors) / 15
    assert rows["sparseloco"].payload_mb * 1e6 == pytest.approx(expected, rel=1e-9)
    assert rows["sparseloco"].rx_mb == pytest.approx(63 * rows["sparseloco"].payload_mb)
    assert rows["templar"].payload_mb * 1e6 == pytest.approx((parameters / 64 * 2.5 + 16 * tensors) / 15)


def test_a_dropped_exchange_gives_the_error_feedback_back_what_it_sent():
    """One worker, H = 1, error feedback beta = 0.5: its first exchange commits (the accumulator
    keeps E_1, the residual), its second is dropped, so the parameters go back to the global
    copy and the accumulator holds all of beta E_1 + Delta_2, the kept entries too (no one
    applied them)."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(64))
    args = SparseLoCoArgs.defaults(sync_every=1, chunk=8, topk=2, bits=None, error_feedback=0.5)
    optimizer = SparseLoCo([param], lambda ps: torch.optim.SGD(ps, lr=1.0), args, comm=DroppingComm(commits=1))
    param.grad = torch.randn(64)
    optimizer.step()
    (error,) = optimizer._error
    residual, start = error.clone(), param.detach().clone()
    assert residual.abs().sum() > 0  # what the first payload did not carry
    gradient = torch.randn(64)
    param.grad = gradient.clone()
    optimizer.step()
    assert torch.equal(param.detach(), start)  # nothing applied: back to the global copy
    # Delta_2 = global - local = start - (start - 1 x g) = g
    torch.testing.assert_close(error, 0.5 * residual + gradient, rtol=0, atol=1e-6)
    assert optimizer.comm.commits == 2


def test_a_heal_does_not_send_the_error_feedback_and_the_healed_worker_empties_its_own():
    strategy = SparseLoCoStrategy(SparseLoCoConfig.defaults(), {"name": "none"}, Communicator())
    param = torch.nn.Parameter(torch.zeros(64))
    optimizer = SparseLoCo([param], lambda ps: torch.optim.SGD(ps, lr=1.0), SparseLoCoArgs.defaults(),
                           comm=Communicator())
    optimizer._error[0].fill_(1.0)
    assert "error_feedback" in strategy.heal_leaves_out and "error_feedback" in optimizer.state_dict()
    strategy.after_heal(optimizer)
    assert torch.equal(optimizer._error[0], torch.zeros(64))
