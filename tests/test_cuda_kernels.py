"""The GPU-only code paths of the per-method speed work, run on a GPU against the CPU's result.

Skipped without a GPU (CI has none). Each path is also exercised on the CPU elsewhere (the same
code with its device switch forced, or the CPU branch beside it); what only a GPU shows is that
the CUDA kernels give the CPU's numbers: DeMo's transforms, two-round top-k and per-worker
``index_add_`` on CUDA, PowerSGD's batched products and QRs, the batched Newton-Schulz of Muon. A session
with a GPU runs this file first: ``python -m pytest tests/test_cuda_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.launch.local import launch_local
from lowcomm.rundir import RunDir
from lowcomm.train.metrics import read_metrics
from runs import at_world_size_one, point_id, quickstart_points, tiny_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
QUICKSTART = quickstart_points()
# each optimizer's alphabetically first quickstart point
ONE_POINT_PER_OPTIMIZER = sorted({point.split("|")[0]: point for point in sorted(QUICKSTART, reverse=True)}.values())

# (rows, cols): stack into one DeMo stack (att_proj / attn_out / ff_proj of OLMo at d_model 128),
# another geometry (ff_out), and a vector
SHAPES = [(384, 128), (128, 128), (1024, 128), (128, 512), (128,)]


def _params(device: str) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64).float().to(device))
            for shape in SHAPES]


def _gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) * 1e-2 for shape in SHAPES]


def _demo_worker(rank: int, world: int, device: str) -> list[torch.Tensor]:  # noqa: ARG001
    from lowcomm.optim import DeMo, DeMoArgs

    torch.backends.cuda.matmul.allow_tf32 = False  # the CPU's float32 products
    params = _params(device)
    optimizer = DeMo(params, DeMoArgs.defaults(), Communicator())
    for step in range(3):
        for param, grad in zip(params, _gradients(step), strict=True):
            param.grad = grad.to(device)
        optimizer.step()
    return [param.detach().cpu() for param in params]


def test_demo_steps_on_cuda_as_on_the_cpu():
    """Sign updates: an entry whose decoded aggregate is within rounding of zero may take the
    other sign on the other device (and the top-k may break an exact tie otherwise); every
    other entry moves identically."""
    from lowcomm.optim import DeMoArgs

    on_cpu = spawn_workers(_demo_worker, 1, "cpu")[0]
    on_cuda = spawn_workers(_demo_worker, 1, "cuda", backend="nccl")[0]
    lr = DeMoArgs.defaults().lr
    for cpu, cuda in zip(on_cpu, on_cuda, strict=True):
        differ = (cpu - cuda).abs() > 1e-6
        assert differ.float().mean() < 1e-3, f"{differ.sum()} of {differ.numel()} entries differ"
        assert (cpu - cuda).abs().max() <= 3 * 2 * lr + 1e-6  # at most one flipped sign per step


def _scheduled_step(optimizer, params: list[torch.nn.Parameter], step: int) -> bool:
    """One step of the schedule: lr 4e-4 x (step + 1), the step's gradients as new tensors;
    whether the optimizer then holds a capture."""
    for group in optimizer.param_groups:
        group["lr"] = 4e-4 * (1 + step)
    for param, grad in zip(params, _gradients(step), strict=True):
        param.grad = grad.cuda()
    optimizer.step()
    return optimizer._graphs is not None


def _graphed_demo_worker(rank: int, world: int, bucket_numel: int) -> dict:  # noqa: ARG001
    """DeMo eager and captured as CUDA graphs (NCCL, W=1) over one schedule: an lr that changes
    every step, weight decay in one of two groups, new gradient tensors every step (as
    ``zero_grad(set_to_none=True)`` leaves them); then a checkpoint of step 4 loaded back."""
    import io

    from lowcomm.optim import DeMo, DeMoArgs

    torch.backends.cuda.matmul.allow_tf32 = False
    steps, results = 8, {}
    for cuda_graph in (False, True):
        comm = Communicator()
        params = _params("cuda")
        groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
        optimizer = DeMo(groups, DeMoArgs.defaults(weight_decay=0.1, bucket_numel=bucket_numel,
                                                   cuda_graph=cuda_graph), comm)
        captured, saved = [], None
        for step in range(steps):
            captured.append(_scheduled_step(optimizer, params, step))
            if step == 3:
                buffer = io.BytesIO()
                torch.save({"optimizer": optimizer.state_dict(), "params": [p.detach().cpu() for p in params]}, buffer)
                saved = buffer.getvalue()
        result = {"params": [param.detach().cpu() for param in params], "captured": captured,
                  "bytes": comm.meter.breakdown(), "steps": [optimizer.state[param]["step"] for param in params]}
        # back to step 4: the momenta move (a capture reading the old ones must go), then 4 steps again
        checkpoint = torch.load(io.BytesIO(saved), weights_only=False)
        optimizer.load_state_dict(checkpoint["optimizer"])
        for param, kept in zip(params, checkpoint["params"], strict=True):
            param.data.copy_(kept)
        resumed = [_scheduled_step(optimizer, params, step) for step in range(4, steps)]
        result.update(resumed_params=[param.detach().cpu() for param in params], resumed_captured=resumed)
        results[cuda_graph] = result
    return results


@pytest.mark.parametrize("bucket_numel", [1, 10**9], ids=["bucket_per_parameter", "one_bucket"])
def test_demo_captured_as_cuda_graphs_steps_as_eager(bucket_numel):
    """After two eager warm-up steps the step is captured and replayed; a replay updates the
    parameters as the eager step does (sign updates: up to a flipped sign where the decoded
    aggregate is within float32 rounding of zero, the momentum's accumulation rounding
    differently: a transform then a multiply-add instead of one scaled product), sends the same
    bytes through the same calls, and counts the steps. A loaded checkpoint drops the capture:
    two eager steps, then a new one; the run goes on as the eager run resumed from there."""
    eager, graphed = spawn_workers(_graphed_demo_worker, 1, bucket_numel, backend="nccl")[0].values()
    assert eager["captured"] == [False] * 8 and eager["resumed_captured"] == [False] * 4
    assert graphed["captured"] == [False, False] + [True] * 6
    assert graphed["resumed_captured"] == [False, False, True, True]
    assert graphed["bytes"] == eager["bytes"] and graphed["steps"] == eager["steps"] == [8] * len(SHAPES)
    largest_lr = 4e-4 * 8
    for key in ("params", "resumed_params"):
        for mine, theirs in zip(graphed[key], eager[key], strict=True):
            differ = (mine - theirs).abs() > 1e-6
            assert differ.float().mean() < 1e-3, f"{key}: {differ.sum()} of {differ.numel()} entries differ"
            assert (mine - theirs).abs().max() <= 8 * 2 * largest_lr + 1e-6


def _runs_on_a_gpu(tmp_path, point: str, key: str, *overrides: str, eval_every: int, max_steps: int,
                   device: str = "cuda") -> dict[str, dict]:
    """A quickstart point at W=1 on the GPU, run with the boolean setting ``key`` false and true:
    per setting its training losses, final validation loss and cumulative payload (MB) by step."""
    results = {}
    for setting in ("false", "true"):
        run = tiny_run(tmp_path / setting, *at_world_size_one(QUICKSTART[point]), f"cluster.device={device}",
                       f"{key}={setting}", *overrides, f"train.eval_every={eval_every}", "train.eval_instances=6",
                       workers=1, max_steps=max_steps)
        launch_local(run)
        records = read_metrics(run.run_dir / "metrics.jsonl")
        results[setting] = {"losses": [r["train/loss"] for r in records if "train/loss" in r],
                            "val": RunDir(run.run_dir).read_summary()["final_val_loss"],
                            "payload_MB": [r["comm/cum_payload_MB"] for r in records if "comm/cum_payload_MB" in r]}
    return results


def test_demo_trains_captured_as_it_trains_eager_on_a_gpu(tmp_path):
    """``optimizer.cuda_graph=true`` through the harness (the loop's lr schedule, clipping,
    ``zero_grad(set_to_none=True)``, validation): the run finishes, its losses and bytes are the
    eager run's (losses within bf16 autocast's rounding). With the model eager, as it passed on
    the H200 (2026-11-28); with it compiled too, not run on a GPU yet."""
    point = next(point for point in ONE_POINT_PER_OPTIMIZER if point.startswith("optimizer=demo|"))
    runs = _runs_on_a_gpu(tmp_path, point, "optimizer.cuda_graph", "train.compile=false", eval_every=3, max_steps=6)
    eager, graphed = runs["false"], runs["true"]
    assert len(graphed["losses"]) == 6
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=2e-2)
    assert graphed["payload_MB"] == eager["payload_MB"]


def test_ordered_index_add_on_cuda_is_the_cpus_sum_bit_for_bit():
    from lowcomm.compress.dct_topk import ordered_index_add_

    generator = torch.Generator().manual_seed(1)
    workers, size, per_worker = 8, 4096, 512
    positions = torch.stack([torch.randperm(size, generator=generator)[:per_worker] for _ in range(workers)])
    values = torch.randn(workers, per_worker, generator=generator)
    on_cpu = ordered_index_add_(torch.zeros(size), positions, values)
    on_cuda = ordered_index_add_(torch.zeros(size, device="cuda"), positions.cuda(), values.cuda())
    assert torch.equal(on_cuda.cpu(), on_cpu)


def test_block_topk_on_cuda_selects_the_cpus_entries():
    from lowcomm.compress.block_topk import block_topk
    from lowcomm.compress.dct import BlockLayout

    generator = torch.Generator().manual_seed(2)
    matrix = torch.randn(1024, 512, generator=generator)  # distinct magnitudes: no ties
    layout = BlockLayout.for_shape(matrix.shape, 64)
    on_cpu = block_topk(matrix, layout, 32)  # the C++ kernel where it is built
    on_cuda = block_topk(matrix.cuda(), layout, 32)
    for mine, theirs in zip(on_cuda, on_cpu, strict=True):  # both in ascending index per block
        assert torch.equal(mine.cpu(), theirs)


def _powersgd_worker(rank: int, world: int, device: str) -> list[dict[str, torch.Tensor]]:  # noqa: ARG001
    from lowcomm.optim.powersgd import PowerSGDArgs, PowerSGDReducer

    shapes = {"a": (300, 64), "b": (300, 64), "c": (64, 200), "d": (300, 64)}
    params = {name: torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64, device=device))
              for name, shape in shapes.items()}
    reducer = PowerSGDReducer(Communicator(), params.items(), PowerSGDArgs.defaults(
        start_powerSGD_iter=0, matrix_approximation_rank=8))
    outputs = []
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        gradients = {name: torch.randn(shape, generator=generator, dtype=torch.float64).to(device)
                     for name, shape in shapes.items()}
        reducer.average_(list(gradients.items()))  # a, b, d: one batch of bmm products and QRs
        reducer.iteration += 1
        outputs.append({name: grad.cpu() for name, grad in gradients.items()})
    return outputs


def test_powersgd_batched_on_cuda_averages_as_on_the_cpu():
    """float64; QR's column signs may differ between solvers, P Q^T does not."""
    on_cpu = spawn_workers(_powersgd_worker, 1, "cpu")[0]
    on_cuda = spawn_workers(_powersgd_worker, 1, "cuda", backend="nccl")[0]
    for cpu, cuda in zip(on_cpu, on_cuda, strict=True):
        for name in cpu:
            torch.testing.assert_close(cuda[name], cpu[name], rtol=1e-9, atol=1e-10)


def test_batched_muon_on_cuda_is_torchs_muon():
    from lowcomm.optim.muon import BatchedMuon

    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(256, 128), (256, 128), (128, 512)]
    generator = torch.Generator().manual_seed(4)
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    results = []
    for optimizer_class in (torch.optim.Muon, BatchedMuon):
        params = [torch.nn.Parameter(weight.cuda()) for weight in weights]
        optimizer = optimizer_class(params, lr=0.02, weight_decay=0.1)
        for _ in range(2):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.cuda()
            optimizer.step()
        results.append([param.detach().cpu() for param in params])
    # Newton-Schulz runs in bf16, and batched products may sum in another order than
    # per-matrix ones: one bf16 step of an update entry (up to 1e-3) x the adjusted lr (0.028),
    # over two steps, bounds the difference
    for reference, batched in zip(*results, strict=True):
        torch.testing.assert_close(batched, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("point", ONE_POINT_PER_OPTIMIZER, ids=point_id)
def test_every_optimizer_trains_compiled_as_it_trains_eager_on_a_gpu(tmp_path, point):
    """train.compile=true on a GPU, for every registered optimizer (the quickstart's first point
    of each: the model is compiled, not the optimizer, so one setting of each is enough),
    validation included (eval mode, no_grad and a last batch of another size each compile anew):
    the run finishes and its losses are the eager run's within bf16 autocast's rounding. Its
    passing on an H200 (2026-11-28, all 13) made train.compile=auto the default. (On the CPU,
    with cluster.device=cpu, AdamW-DDP and FlexDeMo passed it in 37 and 57 s.)"""
    runs = _runs_on_a_gpu(tmp_path, point, "train.compile", eval_every=2, max_steps=4)
    eager, compiled = runs["false"], runs["true"]
    assert len(compiled["losses"]) == 4
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=2e-2)
    assert compiled["val"] == pytest.approx(eager["val"], rel=2e-2)
