"""The GPU path without a GPU: what a 64-GPU NCCL run needs from the harness, checked on CPU.

NCCL serves CUDA tensors only. ``init_process_group("cuda:gloo")`` registers gloo for the cuda
device type alone, so a CPU tensor in a collective raises exactly NCCL's error (``No backend
type associated with device type cpu``): the harness's own collectives are run under such a
group. The GPU itself is mocked only where a test needs one (``torch.cuda.synchronize``, the
number of visible GPUs).
"""

from __future__ import annotations

import math
import shutil
import time

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.data import materialize, open_data
from lowcomm.distenv import DistEnv
from lowcomm.launch.estimate import checkpoint_estimate
from lowcomm.launch.local import launch_local
from lowcomm.models import ModelSpec, build_model
from lowcomm.rundir import RunDir
from lowcomm.train.boundary import Boundary, BoundaryAgreement
from lowcomm.train.checkpoint import list_checkpoints
from lowcomm.train.loop import DeviceClock, Trainer, next_token_loss, pick_device, validation_batches
from runs import at_world_size_one, point_id, quickstart_points, tiny_run, train_in_workers

CUDA_ONLY = "cuda:gloo"  # like "nccl": the group's only backend is registered for cuda
QUICKSTART = quickstart_points()


def _control_traffic_worker(rank: int, world: int, run) -> dict:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    trainer = Trainer(run, env)
    out = {"val_loss": trainer.validate()}
    # the per-step agreement (stop, divergence, the logged loss) and the checkpoint's flag
    boundary = Boundary(1, float(rank), requested=rank == world - 1, acceptable=True, lr=0.0, logged=True)
    (agreed,) = BoundaryAgreement(trainer.comm).submit(boundary)
    out["mean"], out["stop"] = agreed.mean_loss, agreed.stop
    out["agree"] = trainer.comm.agree(rank == world - 1)
    trainer.checkpoints.save(1, trainer.model, trainer.optimizer, consumed=run.train.global_batch_size)
    out["control_device"] = str(trainer.comm.control_device)
    out["breakdown"] = trainer.comm.meter.breakdown()  # before the restore resets the meter
    restored = trainer.checkpoints.restore_latest(trainer.model, trainer.optimizer)
    out["restored_step"] = restored.step
    # the data path is NCCL's: a CPU tensor is refused before it reaches the backend, by name
    try:
        trainer.comm.all_reduce(torch.zeros(4))
    except RuntimeError as exc:
        out["data_error"] = str(exc)
    trainer.close()
    return out


@pytest.mark.slow
def test_harness_collectives_run_beside_a_backend_that_accepts_only_cuda_tensors(tmp_path):
    run = tiny_run(tmp_path, "optimizer=demo", "train.eval_instances=6", workers=2)
    materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    results = spawn_workers(_control_traffic_worker, 2, run, backend=CUDA_ONLY, timeout_s=180)
    for rank, out in enumerate(results):
        assert out["control_device"] == "cpu"
        assert math.isfinite(out["val_loss"]) and out["val_loss"] == results[0]["val_loss"]
        assert out["mean"] == 0.5
        assert out["stop"] is True and out["agree"] is True
        assert out["restored_step"] == 1
        assert "all_reduce (data, scope world): tensor on cpu" in out["data_error"]
        assert "cuda:gloo" in out["data_error"], out["data_error"]
        # every control byte was metered (validation totals, flags, barriers)
        control = {k: v for k, v in out["breakdown"].items() if k.startswith("control/")}
        assert control and all(v["payload"] > 0 for v in control.values()), (rank, control)
    assert [p.name for p in list_checkpoints(run.run_dir / "checkpoints")] == ["step_000000001"]


def test_communicator_refuses_data_on_a_device_its_backend_does_not_serve():
    comm = Communicator(device="cuda")  # a GPU run's communicator, here without a process group
    with pytest.raises(RuntimeError, match=r"all_gather \(data, scope world\): tensor on cpu.*data device is cuda"):
        comm.all_gather(torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"all_reduce \(data"):
        comm.all_reduce(torch.zeros(3), op="avg")
    assert comm.meter.step_bytes() == 0  # nothing refused was counted as sent
    # an optimizer used outside the harness builds its own Communicator: no device is imposed
    assert Communicator().device is None and len(Communicator().all_gather(torch.zeros(3))) == 1


def test_timer_waits_for_queued_device_work(monkeypatch):
    queued_s = 0.2
    calls = []

    def synchronize(device=None):
        calls.append(device)
        time.sleep(queued_s)  # the GPU finishing the step's kernels and all-gathers

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    clock = DeviceClock(torch.device("cuda", 0))
    start = clock()
    elapsed = clock() - start
    assert calls == [torch.device("cuda", 0)] * 2
    assert elapsed >= queued_s  # the second reading waited for the queue to drain
    cpu_clock = DeviceClock(torch.device("cpu"))
    cpu_clock()
    assert len(calls) == 2  # nothing to wait for on the CPU


@pytest.mark.parametrize(("instances", "micro_batch", "world"), [(6, 4, 4), (3, 1, 2), (16, 2, 3), (2, 1, 4)])
def test_every_rank_runs_the_same_number_of_validation_forwards(instances, micro_batch, world):
    per_rank = [validation_batches(1000, instances, micro_batch, rank, world) for rank in range(world)]
    assert len({len(batches) for batches in per_rank}) == 1
    counted = sorted(int(i) for batches in per_rank for indices, used in batches if used for i in indices)
    assert counted == list(range(instances))  # each instance counted once, padding never


def test_local_launcher_refuses_more_gpu_ranks_than_gpus_before_spawning(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    run = tiny_run(tmp_path, "cluster.device=auto", workers=4)
    with pytest.raises(ValueError, match=r"cluster.workers=4 .* 2 are visible"):
        launch_local(run)
    assert not run.run_dir.exists()  # refused before the config was written or a worker started
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU of its own"):
        pick_device("auto", local_rank=2)


def _validate_worker(rank: int, world: int, run) -> dict:
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    trainer = Trainer(run, env)
    loss = trainer.validate()
    gathers = trainer.comm.meter.breakdown(cumulative=False)["control/intra/all_gather"]["calls"]
    return {"loss": loss, "gathers": gathers}


@pytest.mark.slow
def test_flexdemo_validation_with_an_uneven_split_finishes_and_counts_each_instance_once(tmp_path):
    # 3 instances over 2 ranks, one per micro-batch: rank 0 has two forwards' worth, rank 1 one.
    # Each FSDP forward all-gathers the parameters: with unequal forwards the ranks' collectives
    # no longer pair up (a hang, or gloo's size mismatch).
    run = tiny_run(tmp_path, "optimizer=flexdemo", "optimizer.shard_group_size=2", "train.eval_instances=3",
                   "train.micro_batch_size=1", workers=2)
    materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    results = spawn_workers(_validate_worker, 2, run, timeout_s=120)  # today: no answer (a hang)
    assert results[0] == results[1]
    assert results[0]["gathers"] > 0

    model = build_model(run.model, torch.device("cpu"), seed=run.seed).eval()
    val = open_data(run.data, run.train.seq_len, run.run_root, run.model.tokenizer).val
    with torch.no_grad():
        tokens = val.batch(range(3))
        expected = float(next_token_loss(model, tokens))
    assert results[0]["loss"] == pytest.approx(expected, rel=1e-5)


def _file_bytes(directory, *names: str) -> int:
    return sum((directory / name).stat().st_size for name in names if (directory / name).exists())


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "overrides"), [
    ("adamw_ddp", []),
    ("demo", []),
    ("diloco", ["optimizer.sync_every=1"]),  # every checkpoint at an outer boundary
    ("diloco", ["optimizer.sync_every=2"]),  # the step-1 checkpoint between two
])
def test_checkpoint_size_estimate_matches_the_files_and_replicated_state_is_written_once(
    tmp_path, optimizer, overrides
):
    run = tiny_run(tmp_path, f"optimizer={optimizer}", *overrides, "train.checkpoint_every=1",
                   "train.keep_checkpoints=2", workers=2, max_steps=2)
    train_in_workers(run)
    directory = run.run_dir / "checkpoints" / "step_000000001"
    estimate = checkpoint_estimate(run)
    written_once = _file_bytes(directory, "model.pt", "optim.pt")
    per_rank = [_file_bytes(directory, f"optim_rank{rank}.pt") for rank in range(2)]
    # tensor bytes; the files add their framing (a zip entry per tensor, the pickled structure)
    assert estimate.replicated_bytes <= written_once <= 1.05 * estimate.replicated_bytes + 32_000
    for own in per_rank:
        expected = estimate.periodic_per_rank_bytes  # (the step-1 checkpoint is a periodic one)
        assert expected <= own <= 1.05 * expected + 32_000, (own, estimate)
    if optimizer != "diloco":
        return
    # the global copy and the outer momentum are the same on every rank: in optim.pt once
    shared = torch.load(directory / "optim.pt")
    assert sorted(shared) == ["global_params", "outer_momentum"]
    assert all("global_params" not in torch.load(directory / f"optim_rank{r}.pt") for r in range(2))
    params = estimate.replicated_bytes / 3  # model + global copy + outer momentum
    # per rank: AdamW's two moments, and the worker's own parameters only between two outer steps
    assert estimate.per_rank_bytes == 3 * params and estimate.boundary_per_rank_bytes == 2 * params
    at_boundary = overrides == ["optimizer.sync_every=1"]
    assert estimate.periodic_per_rank_bytes == (2 if at_boundary else 3) * params
    assert all(("local_params" in torch.load(directory / f"optim_rank{r}.pt")) != at_boundary for r in range(2))
    # a resume reads the split files back and continues bit for bit
    final = run.run_dir / "checkpoints" / "step_000000002"
    uninterrupted = torch.load(final / "model.pt")
    shutil.rmtree(final)
    (run.run_dir / "summary.json").unlink()
    train_in_workers(run)
    resumed = torch.load(final / "model.pt")
    assert all(torch.equal(resumed[name], tensor) for name, tensor in uninterrupted.items())


def _average_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - spawn_workers' signature
    import torch.distributed as dist

    seen = []
    originals = dist.all_reduce, dist.reduce_scatter_single

    def all_reduce(tensor, op=dist.ReduceOp.SUM, **kwargs):
        seen.append(("all_reduce", op, tensor.data_ptr()))
        return originals[0](tensor, op=op, **kwargs)

    def reduce_scatter_single(output, tensor, op=dist.ReduceOp.SUM, **kwargs):
        seen.append(("reduce_scatter", op, tensor.data_ptr()))
        return originals[1](output, tensor, op=op, **kwargs)

    dist.all_reduce, dist.reduce_scatter_single = all_reduce, reduce_scatter_single
    try:
        comm = Communicator(device="cpu")
        gradient = torch.full((6,), float(rank + 1))
        comm.all_reduce(gradient, op="avg")
        unsharded = torch.arange(4.0) * (rank + 1)
        shard = torch.empty(2)
        comm.reduce_scatter(shard, unsharded, op="avg")
    finally:
        dist.all_reduce, dist.reduce_scatter_single = originals
    return {"seen": [(name, str(op)) for name, op, _ in seen], "gradient": gradient, "shard": shard,
            "no_copy": seen[1][2] == unsharded.data_ptr()}


def test_averages_use_the_backends_avg_without_a_divided_copy():
    results = spawn_workers(_average_worker, 2)
    for rank, out in enumerate(results):
        assert [name for name, _ in out["seen"]] == ["all_reduce", "reduce_scatter"]
        assert all(op.endswith("AVG") for _, op in out["seen"]), out["seen"]
        assert out["no_copy"]  # the unsharded gradient went to the backend itself
        assert torch.equal(out["gradient"], torch.full((6,), 1.5))
        assert torch.equal(out["shard"], (torch.arange(4.0) * 1.5)[2 * rank : 2 * rank + 2])


@pytest.mark.slow
@pytest.mark.parametrize("point", sorted(QUICKSTART), ids=point_id)
def test_every_optimizer_trains_at_world_size_one(trained_run, point):
    """One GPU is how a GPU is tried first: a process group of one rank (NCCL there, gloo here),
    whose collectives are local copies. Every registered optimizer must train and account for
    its validation there; FlexDeMo's sharding group of one rank is a real group (FSDP's device mesh is
    built from it; it was None before, and FlexDeMo died in ``DeviceMesh.from_group``). Found on
    an H100 with the quickstart's optimizers at world size 1."""
    run = trained_run(*at_world_size_one(QUICKSTART[point]), workers=1, max_steps=3)
    summary = RunDir(run.run_dir).read_summary()
    assert summary["steps"] == 3 and summary["world_size"] == 1
    assert math.isfinite(summary["final_val_loss"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: fused AdamW is the GPU's choice"))])
def test_adamw_is_fused_on_a_gpu_and_the_for_loop_on_cpu(device):
    """Fused on a GPU (one kernel per group); on CPU the for-loop default, whose numbers the
    committed tables hold (fused orders the arithmetic differently)."""
    from lowcomm.optim.grouping import AdamWArgs, adamw

    model = build_model(ModelSpec(), device, seed=0)
    optimizer = adamw(model, AdamWArgs.defaults())
    assert optimizer.defaults["fused"] is (True if device == "cuda" else None)
