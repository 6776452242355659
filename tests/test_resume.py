"""Every optimizer resumes exactly: a run stopped at a checkpoint that falls between two
synchronisations continues bit for bit as if it had never stopped.

Parametrised over the quickstart's optimizers (each strategy once more with bf16 weights,
``train.param_dtype=bf16``), and the quickstart must cover every registered strategy, so a new
optimizer cannot skip this test. Each run checkpoints at step 3 of 6, with
the sync periods each strategy declares (``Strategy.mid_period``) so that step 3 is mid-period (workers' parameters, moments and in-flight
exchanges differ from rank 0's there); the final checkpoint is then removed, as if the run had
been killed after step 3, and the rerun must reproduce every file of the final checkpoint
(model, optimizer states of every rank, RNG, meter) and the same loss sequence.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm.rundir import RunDir
from lowcomm.strategies import STRATEGIES
from runs import point_id, quickstart_points, tiny_run, train_in_workers

POINTS = quickstart_points()
# every point in fp32, and each strategy's first point again with bf16 weights (train.param_dtype)
BF16_POINTS = sorted({point.split("|")[0]: point for point in sorted(POINTS, reverse=True)}.values())
# ids: the point's label (as every fp32 case was named before bf16 cases existed), "-bf16" added
CASES = [pytest.param(point, "fp32", id=point_id(point)) for point in sorted(POINTS)] + [
    pytest.param(point, "bf16", id=f"{point_id(point)}-bf16") for point in BF16_POINTS]


def test_the_quickstart_covers_every_registered_optimizer():
    names = {overrides[0].split("=", 1)[1] for overrides in POINTS.values()}
    assert names == set(STRATEGIES)


def _same(a, b, where: str) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and np.array_equal(a, b), where
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{index}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"  # NaN == NaN here


def _final_state(directory: Path) -> dict:
    state = {path.name: torch.load(path, weights_only=False) if path.suffix == ".pt" else path.read_text()
             for path in sorted(directory.iterdir()) if path.name != "manifest.json"}
    for name, content in state.items():
        # the harness's own control traffic differs by the restore's handshake; the data does not
        if name.startswith("rank") and isinstance(content, dict):
            cumulative = content["meter"]["cumulative"]
            content["meter"]["cumulative"] = {key: value for key, value in cumulative.items()
                                              if not key.startswith("control")}
    return state


def test_every_strategy_resumes_with_bf16_weights_too():
    assert {point.split("|")[0] for point in BF16_POINTS} == {point.split("|")[0] for point in POINTS}


def _model_state(state: dict) -> dict[str, torch.Tensor]:
    return state["model.pt"]


@pytest.mark.slow
@pytest.mark.parametrize(("point", "param_dtype"), CASES)
def test_a_run_stopped_mid_period_resumes_bit_for_bit(tmp_path, point, param_dtype):
    overrides = POINTS[point]
    name = overrides[0].split("=", 1)[1]
    run = tiny_run(tmp_path, "experiment=quickstart", *overrides, *STRATEGIES[name].mid_period, "wandb.mode=disabled",
                   f"train.param_dtype={param_dtype}",
                   "train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=2",
                   "train.log_every=1", "train.eval_every=3", "train.eval_instances=16", "train.checkpoint_every=3",
                   "train.keep_checkpoints=3", max_steps=6)
    # each run's ranks are fresh processes (forked from a server that imported torch and OLMo
    # alone): the resume starts from the checkpoint's files as a relaunched run does
    train_in_workers(run)
    run_dir = RunDir(run.run_dir)
    final = run_dir.checkpoints / "step_000000006"
    reference = _final_state(final)
    reference_metrics = run_dir.read_metrics()

    # killed after the step-3 checkpoint: the final one and the summary were never written
    shutil.rmtree(final)
    run_dir.summary.unlink()
    train_in_workers(run)

    weights = {tensor.dtype for key, tensor in _model_state(reference).items() if tensor.is_floating_point()}
    assert weights == {torch.bfloat16 if param_dtype == "bf16" else torch.float32}

    resumed = _final_state(final)
    assert resumed.keys() == reference.keys()
    for file_name in reference:
        _same(resumed[file_name], reference[file_name], file_name)
    metrics = run_dir.read_metrics()
    assert [record["step"] for record in metrics] == [record["step"] for record in reference_metrics]
    assert [record["step"] for record in metrics if "train/loss" in record] == [1, 2, 3, 4, 5, 6]
    for key in ("train/loss", "val/loss", "comm/payload_bytes", "comm/tx_bytes", "comm/messages"):
        assert [r.get(key) for r in metrics] == [r.get(key) for r in reference_metrics], key
