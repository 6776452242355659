"""FlexDeMo on 4 real gloo workers: |S| = 1 is DeMo, 2 x 2 hybrid sharding, |S| = W.

Expectations are derived here, not by the code under test: the shard of a parameter is its
``torch.chunk`` slab (FSDP's rule), byte counts come from the tiny OLMo's shapes written out
below with DeMo's chunk rule by search, and DeMo itself (the same steps through
:class:`~lowcomm.strategies.demo.DeMoStrategy` on an unsharded model) is the |S| = 1 reference.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from dct_reference import chunk_by_search
from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.models import ModelSpec, build_model
from lowcomm.optim.flexdemo import hybrid_groups, row_shard
from lowcomm.strategies.demo import DeMoConfig, DeMoStrategy
from lowcomm.strategies.flexdemo import FlexDeMoConfig, FlexDeMoStrategy
from lowcomm.train.checkpoint import CheckpointManager
from lowcomm.train.loop import next_token_loss
from lowcomm.train.metrics import read_metrics
from runs import tiny_run, train_in_workers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORLD, STEPS, MICRO_BATCHES, CHECKPOINT_AT = 4, 4, 2, 2
OPTIONS = {"lr": 1e-3, "compression_topk": 8, "compression_chunk": 32}
MAX_NORM = 0.5  # below the tiny model's gradient norms: clipping is exercised
# the tiny OLMo (ModelSpec defaults, d_model 64, 2 blocks, mlp_ratio 8, 384 embedding rows)
BLOCK_SHAPES = [(192, 64), (64, 64), (512, 64), (64, 256)]  # att_proj, attn_out, ff_proj, ff_out
ROOT_SHAPES = [(384, 64)]  # the tied embedding
N_BLOCKS = 2

# torch.distributed functions that move bytes between processes: every call must come from the
# Communicator (a pass-through spy counts the others; the collectives still run for real)
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "reduce", "gather", "scatter", "barrier", "all_gather_object",
    "broadcast_object_list", "batch_isend_irecv",
)


# ---------------------------------------------------------------- workers
def tokens(rank: int, step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randint(0, 257, (2, 33), generator=generator)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storage behind this rank's parameters and optimizer state tensors."""
    storages = {}
    tensors = [local(p) for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def train_steps(strategy, model, optimizer, rank: int, steps: range) -> list[dict]:
    """The loop's step (no_sync on all but the last micro-batch, clipping, step); per step: this
    rank's parameter shards and the meter's metrics."""
    records = []
    for step in steps:
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            with contextlib.nullcontext() if last else strategy.no_sync(model):
                loss = next_token_loss(model, tokens(rank, step, micro))
            (loss / MICRO_BATCHES).backward()
        strategy.clip_grad_norm(model, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = strategy.comm.meter.end_step()
        shards = {name: local(p).detach().clone() for name, p in model.named_parameters()}
        records.append({"shards": shards, "metrics": metrics})
    return records


def build(strategy_cls, config, seed: int = 0):
    strategy = strategy_cls(config, {"name": "none"}, Communicator())
    model, optimizer = strategy.build(build_model(ModelSpec(), "cpu", seed=seed))
    return strategy, model, optimizer


def _scenarios_worker(rank: int, world: int, run_dir: str) -> bytes:  # noqa: ARG001 - spawn_workers' signature
    unmetered: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def spy(name, function):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.endswith(str(Path("lowcomm", "comm", "communicator.py"))):
                unmetered.append(f"{name} from {caller}")
            return function(*args, **kwargs)

        return call

    for name, function in originals.items():
        setattr(dist, name, spy(name, function))
    results = {}
    try:
        # DeMo on the unsharded model: the |S| = 1 reference and the memory baseline
        strategy, model, optimizer = build(DeMoStrategy, DeMoConfig.defaults(**OPTIONS))
        results["demo"] = train_steps(strategy, model, optimizer, rank, range(STEPS))
        results["demo_bytes"] = held_bytes(model, optimizer)

        strategy, model, optimizer = build(FlexDeMoStrategy, FlexDeMoConfig.defaults(**OPTIONS, shard_group_size=1))
        results["flex1"] = train_steps(strategy, model, optimizer, rank, range(STEPS))

        # 2 x 2, with a checkpoint half-way and a resume into a fresh model and optimizer
        strategy, model, optimizer = build(FlexDeMoStrategy, FlexDeMoConfig.defaults(**OPTIONS, shard_group_size=2))
        first = train_steps(strategy, model, optimizer, rank, range(CHECKPOINT_AT))
        CheckpointManager(Path(run_dir), strategy.comm, strategy, keep=1).save(
            CHECKPOINT_AT, model, optimizer, consumed=0
        )
        results["flex2"] = first + train_steps(strategy, model, optimizer, rank, range(CHECKPOINT_AT, STEPS))
        results["flex2_bytes"] = held_bytes(model, optimizer)
        final_state = strategy.model_state_dict(model)

        strategy, model, optimizer = build(FlexDeMoStrategy, FlexDeMoConfig.defaults(**OPTIONS, shard_group_size=2), seed=1)
        restored = CheckpointManager(Path(run_dir), strategy.comm, strategy, keep=1).restore_latest(model, optimizer)
        assert restored is not None and restored.step == CHECKPOINT_AT
        results["flex2_resumed"] = train_steps(strategy, model, optimizer, rank, range(CHECKPOINT_AT, STEPS))
        results["flex2_final_state"] = final_state

        strategy, model, optimizer = build(FlexDeMoStrategy, FlexDeMoConfig.defaults(**OPTIONS, shard_group_size=4))
        results["flex4"] = train_steps(strategy, model, optimizer, rank, range(2))
        results["flex4_bytes"] = held_bytes(model, optimizer)
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
    results["unmetered"] = unmetered
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("flexdemo_checkpoint")
    return spawn_workers(_scenarios_worker, WORLD, str(run_dir))


# ------------------------------------------------- expected, from shapes
def shard(shape: tuple[int, ...], size: int, index: int) -> tuple[int, ...]:
    return tuple(torch.chunk(torch.empty(shape, device="meta"), size, dim=0)[index].shape)


def demo_payload(shapes, chunk: int, topk: int) -> int:
    """Paper wire: 12 bytes per kept coefficient, min(k, block) kept per block."""
    total = 0
    for rows, cols in shapes:
        chunk_rows, chunk_cols = chunk_by_search(rows, chunk), chunk_by_search(cols, chunk)
        blocks = (rows // chunk_rows) * (cols // chunk_cols)
        total += blocks * min(topk, chunk_rows * chunk_cols) * 12
    return total


def expected_intra_payload(size: int, micro_batches: int) -> int:
    """Blocks gathered in forward and again in backward, the root once, per micro-batch; one
    reduce-scatter of every padded unit per step (fp32)."""
    if size == 1:
        return 0
    block_shard = sum(math.ceil(r / size) * c for r, c in BLOCK_SHAPES) * 4
    root_shard = sum(math.ceil(r / size) * c for r, c in ROOT_SHAPES) * 4
    gathers = micro_batches * (2 * N_BLOCKS * block_shard + root_shard)
    return gathers + size * (N_BLOCKS * block_shard + root_shard)


def expected_inter_payload(size: int, index: int) -> int:
    shapes = [shard(s, size, index) for s in N_BLOCKS * BLOCK_SHAPES + ROOT_SHAPES]
    return demo_payload(shapes, OPTIONS["compression_chunk"], OPTIONS["compression_topk"])


# ------------------------------------------------------------------ tests
def test_hybrid_groups_are_nodes_and_same_shard_index_across_nodes():
    sharding, replication = hybrid_groups(8, 4)
    assert sharding == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replication == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hybrid_groups(4, 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="must divide the world size"):
        hybrid_groups(6, 4)


@pytest.mark.parametrize("rows,size", [(10, 4), (3, 4), (384, 8), (7, 1)])
def test_row_shards_follow_torch_chunk(rows, size):
    chunks = torch.chunk(torch.arange(rows), size)
    for index in range(size):
        start, count = row_shard(rows, size, index)
        expected = chunks[index] if index < len(chunks) else torch.arange(0)
        assert torch.equal(torch.arange(rows)[start : start + count], expected)


def test_config_yaml_matches_the_schema():
    yaml = OmegaConf.to_container(OmegaConf.load(CONFIGS / "optimizer" / "flexdemo.yaml"))
    assert yaml.pop("name") == "flexdemo"
    assert FlexDeMoConfig(**yaml) == FlexDeMoConfig.defaults()
    assert FlexDeMoConfig.defaults().shard_group_size is None
    assert any("optimizer.shard_group_size" in e for e in FlexDeMoConfig.defaults(shard_group_size=0).validate())


def test_analytic_bytes_of_olmo_1b_on_8_nodes_of_8():
    model = build_model(ModelSpec(d_model=2048, n_heads=16, n_layers=16, vocab_size=50280, embedding_size=50304),
                        "meta")
    strategy = FlexDeMoStrategy(FlexDeMoConfig.defaults(shard_group_size=8), {"name": "none"}, Communicator())
    scopes = strategy.analytic_scope_bytes(model, world_size=64, local_world_size=8)
    block = 2048 * (3 * 2048 + 2048 + 2 * 8192 + 8192)  # att_proj, attn_out, ff_proj (SwiGLU), ff_out
    embedding = 50304 * 2048
    shard_bytes = (16 * block + embedding) * 4 // 8
    gathers = (2 * 16 * block + embedding) * 4 // 8
    assert scopes["intra"][0] == gathers + 8 * shard_bytes
    # every shard's rows are a multiple of 64 except the embedding's 6288 = 131 x 48
    demo_blocks = 16 * block // 4096 // 8 + (6288 // 48) * (2048 // 64)
    # a ring all-gather over the 8 replicas: each rank forwards the 7 others' payloads, each way
    assert scopes["inter"] == (demo_blocks * 32 * 12, 7 * demo_blocks * 32 * 12, 7 * demo_blocks * 32 * 12)


@pytest.mark.slow
def test_one_rank_per_shard_group_is_demo(runs):
    for rank in range(WORLD):
        for step, (demo, flex) in enumerate(zip(runs[rank]["demo"], runs[rank]["flex1"], strict=True)):
            for name, expected in demo["shards"].items():
                assert torch.equal(flex["shards"][name], expected), f"rank {rank} step {step}: {name}"
            assert flex["metrics"]["comm/intra_payload_bytes"] == 0  # FSDP does not gather in a group of one
            assert flex["metrics"]["comm/inter_payload_bytes"] == demo["metrics"]["comm/payload_bytes"]
    initial = build_model(ModelSpec(), "cpu", seed=0).state_dict()
    assert not torch.equal(runs[0]["flex1"][-1]["shards"]["transformer.wte.weight"], initial["transformer.wte.weight"])


@pytest.mark.slow
def test_two_by_two_replicas_agree_and_hold_their_torch_chunk_rows(runs):
    full = runs[0]["flex2_final_state"]
    assert all(run["flex2_final_state"] == {} for run in runs[1:])  # the checkpoint's model.pt is rank 0's
    for step in range(STEPS):
        for rank in range(WORLD):
            replica = (rank + 2) % WORLD  # same shard index on the other node
            for name, tensor in runs[rank]["flex2"][step]["shards"].items():
                assert torch.equal(tensor, runs[replica]["flex2"][step]["shards"][name]), f"step {step}: {name}"
    for rank in range(WORLD):
        for name, tensor in runs[rank]["flex2"][-1]["shards"].items():
            assert torch.equal(tensor, torch.chunk(full[name], 2)[rank % 2]), name
    assert not torch.equal(runs[0]["flex2"][-1]["shards"]["transformer.wte.weight"],
                           runs[1]["flex2"][-1]["shards"]["transformer.wte.weight"])


@pytest.mark.slow
def test_intra_and_inter_bytes_match_the_shapes(runs):
    for rank in range(WORLD):
        for record in runs[rank]["flex2"]:
            metrics = record["metrics"]
            intra = expected_intra_payload(2, MICRO_BATCHES)
            inter = expected_inter_payload(2, rank % 2)
            assert metrics["comm/intra_payload_bytes"] == intra
            assert metrics["comm/inter_payload_bytes"] == inter
            # ring all-gather over |R| = 2: (|R|-1) x payload each way
            assert metrics["comm/inter_tx_bytes"] == inter and metrics["comm/inter_rx_bytes"] == inter
            assert metrics["comm/payload_bytes"] == intra + inter
    # DeMo over W = 4 sends the full matrices' payload; each 2 x 2 rank half of it (rows divide)
    assert 2 * expected_inter_payload(2, 0) == runs[0]["demo"][0]["metrics"]["comm/payload_bytes"]


@pytest.mark.slow
def test_one_shard_group_for_the_whole_world_sends_nothing_across(runs):
    for rank in range(WORLD):
        for record in runs[rank]["flex4"]:
            metrics = record["metrics"]
            assert metrics["comm/inter_tx_bytes"] == metrics["comm/inter_rx_bytes"] == 0
            assert metrics["comm/intra_payload_bytes"] == expected_intra_payload(4, MICRO_BATCHES)


@pytest.mark.slow
def test_parameters_and_state_held_per_rank_shrink_with_the_shard_group(runs):
    for run in runs:
        assert run["flex2_bytes"] == run["demo_bytes"] // 2
        assert run["flex4_bytes"] == run["demo_bytes"] // 4


@pytest.mark.slow
def test_resume_from_a_checkpoint_continues_bit_for_bit(runs):
    for rank in range(WORLD):
        continued, resumed = runs[rank]["flex2"][CHECKPOINT_AT:], runs[rank]["flex2_resumed"]
        for step, (a, b) in enumerate(zip(continued, resumed, strict=True)):
            for name, tensor in a["shards"].items():
                assert torch.equal(tensor, b["shards"][name]), f"rank {rank} step {CHECKPOINT_AT + step}: {name}"


@pytest.mark.slow
def test_no_collective_bypasses_the_communicator(runs):
    for rank, run in enumerate(runs):
        assert run["unmetered"] == [], f"rank {rank}: {run['unmetered'][:5]}"


@pytest.mark.slow
def test_training_run_logs_intra_and_inter_bytes_and_a_full_model(tmp_path):
    run = tiny_run(tmp_path, "optimizer=flexdemo", "optimizer.shard_group_size=2", "optimizer.compression_chunk=32",
                   "optimizer.compression_topk=8", "train.checkpoint_every=2", "train.eval_every=1", "train.global_batch_size=16", workers=WORLD,
                   max_steps=2)
    train_in_workers(run)
    micro_batches = run.train.global_batch_size // (WORLD * run.train.micro_batch_size)
    records = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:  # step 2 follows a validation, whose gathers are control traffic
        assert "val/loss" in record
        assert record["comm/intra_payload_bytes"] == expected_intra_payload(2, micro_batches)
        assert record["comm/inter_payload_bytes"] == expected_inter_payload(2, 0)  # rank 0 writes metrics
    model = torch.load(run.run_dir / "checkpoints" / "step_000000002" / "model.pt")
    reference = build_model(run.model, "meta").state_dict()
    assert {k: tuple(v.shape) for k, v in model.items()} == {k: tuple(v.shape) for k, v in reference.items()}


@pytest.mark.parametrize(("ours", "interface"), [("MeteredAllGather", "AllGather"),
                                                 ("MeteredReduceScatter", "ReduceScatter")])
def test_the_metered_collectives_implement_fsdps_interfaces(ours, interface):
    """Not subclassed (that would import FSDP with lowcomm), so checked here: each method the
    interface requires, with its parameters (names, kinds, defaults), against this torch."""
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    from lowcomm.comm import fsdp

    theirs, mine = getattr(_fsdp_api, interface), getattr(fsdp, ours)
    assert theirs.__abstractmethods__ == {"__call__", "allocate"}
    for name in theirs.__abstractmethods__:
        expected = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(theirs, name)).parameters.values()]
        found = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(mine, name)).parameters.values()]
        assert found == expected, f"{ours}.{name}"


@pytest.mark.slow
def test_no_process_imports_fsdp_before_a_run_shards():
    """The launcher's and a worker's imports leave FSDP and DTensor out (half a second of every
    process's start); FlexDeMo imports them when it builds."""
    code = ("import sys, lowcomm.config, lowcomm.strategies, lowcomm.train.worker, lowcomm.cli.train\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.tensor', 'torch.distributed.fsdp'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[]"
