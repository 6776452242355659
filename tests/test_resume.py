"""Every optimizer resumes exactly: a run stopped at a checkpoint that falls between two
synchronisations continues bit for bit as if it had never stopped.

Parametrised over the quickstart's optimizers (each strategy once more with bf16 weights,
``train.param_dtype=bf16``), and the quickstart must cover every registered strategy, so a new
optimizer cannot skip this test. Each run checkpoints at step 3 of 6, with
the sync periods each strategy declares (``Strategy.mid_period``) so that step 3 is mid-period (workers' parameters, moments and in-flight
exchanges differ from rank 0's there); the final checkpoint is then removed, as if the run had
been killed after step 3, and the rerun must reproduce every file of the final checkpoint
(model, optimizer states of every rank, RNG, meter) and the same loss sequence.

And at another world size (issue 46): from the same step-3 checkpoint, written by 2 ranks, a run
of 4 loads the state every rank holds alike as written and gives rank r the own state of rank
r mod 2 (``Strategy.elastic_rule``), says so in its first line and in ``metrics.jsonl``, and
trains on; each strategy's first point, the run trained for its bit-for-bit case reused.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm.comm.spawn import spawn_workers
from lowcomm.rundir import RunDir
from lowcomm.strategies import STRATEGIES
from lowcomm.train.synchronizer import learner_dir
from runs import ThreadedSynchronizer, point_id, quickstart_points, tiny_run, train_in_workers

POINTS = quickstart_points()
# each strategy's first point: again with bf16 weights (train.param_dtype), and on twice the ranks
FIRST_POINTS = sorted({point.split("|")[0]: point for point in sorted(POINTS, reverse=True)}.values())
# ids: the point's label (as every fp32 case was named before bf16 cases existed), "-bf16" added
CASES = [pytest.param(point, "fp32", id=point_id(point)) for point in sorted(POINTS)] + [
    pytest.param(point, "bf16", id=f"{point_id(point)}-bf16") for point in FIRST_POINTS]


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
    assert {point.split("|")[0] for point in FIRST_POINTS} == {point.split("|")[0] for point in POINTS}


def _model_state(state: dict) -> dict[str, torch.Tensor]:
    return state["model.pt"]


def _settings(point: str, param_dtype: str, *extra: str) -> list[str]:
    overrides = POINTS[point]
    name = overrides[0].split("=", 1)[1]
    return ["experiment=quickstart", *overrides, *STRATEGIES[name].mid_period, "wandb.mode=disabled",
            f"train.param_dtype={param_dtype}", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.warmup_steps=2", "train.log_every=1", "train.eval_every=3", "train.eval_instances=16",
            "train.checkpoint_every=3", "train.keep_checkpoints=3", *extra]


# (point, dtype) -> a finished 6-step run on 2 ranks, kept for this pytest worker's later tests
# of the same case (a test that changes it for good takes it out)
_FINISHED: dict[tuple[str, str], object] = {}


def _finished(tmp_path_factory: pytest.TempPathFactory, point: str, param_dtype: str):
    if (point, param_dtype) not in _FINISHED:
        run = tiny_run(tmp_path_factory.mktemp("resume"), *_settings(point, param_dtype), max_steps=6)
        # each run's ranks are fresh processes (forked from a server that imported torch and OLMo
        # alone): a resume starts from the checkpoint's files as a relaunched run does
        train_in_workers(run)
        _FINISHED[point, param_dtype] = run
    return _FINISHED[point, param_dtype]


@pytest.mark.slow
@pytest.mark.parametrize(("point", "param_dtype"), CASES)
def test_a_run_stopped_mid_period_resumes_bit_for_bit(tmp_path_factory, point, param_dtype):
    run = _finished(tmp_path_factory, point, param_dtype)
    run_dir = RunDir(run.run_dir)
    final = run_dir.checkpoints / "step_000000006"
    reference = _final_state(final)
    reference_metrics = run_dir.read_metrics()

    # killed after the step-3 checkpoint: the final one and the summary were never written (by
    # any learner of a method of learners, and its synchronizer's state as of step 6 neither)
    for directory in _worker_dirs(run):
        shutil.rmtree(RunDir(directory).checkpoints / "step_000000006")
        RunDir(directory).summary.unlink()
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



def _worker_dirs(run) -> list[Path]:
    """The run directories its workers write checkpoints to: the run's, and under a method of
    learners each learner's (lowcomm.train.synchronizer.learner_dir)."""
    if not STRATEGIES[run.optimizer_name].learners:
        return [Path(run.run_dir)]
    return [learner_dir(run, learner) for learner in range(run.world_size)]


def _restore_then_train(rank: int, world: int, config_path: str) -> dict:  # noqa: ARG001 - spawn_workers' signature
    """A rank of the resumed run: its state right after the restore the run does, then the run."""
    from lowcomm.config import load_run_config, validate
    from lowcomm.distenv import DistEnv
    from lowcomm.train.loop import Trainer

    trainer = Trainer(validate(load_run_config(config_path)), DistEnv.from_environ())
    restored = trainer.restore()
    # (a copy: the state dict holds the optimizer's live tensors, which the run goes on to change)
    state = {"optim": copy.deepcopy(trainer.optimizer.state_dict()), "rng": torch.get_rng_state(),
             "step": restored.step}
    state["final_step"] = trainer.fit().final_step  # restores the same checkpoint again, and trains on
    trainer.close()
    return state


def _peer_state(checkpoint: Path, strategy, rank: int) -> dict:
    """What the rule gives rank ``rank`` of 4, read from the files: the shared ones, and rank
    ``rank % 2``'s own."""
    optim = {}
    if (checkpoint / "optim.pt").is_file():
        optim.update(torch.load(checkpoint / "optim.pt", weights_only=False))
    if not strategy.replicated_optimizer_state:
        optim.update(torch.load(checkpoint / f"optim_rank{rank % 2}.pt", weights_only=False))
    return {"optim": optim, "rng": torch.load(checkpoint / f"rank{rank % 2}.pt", weights_only=False)["rng"]["torch"]}


# Methods whose step depends on the global batch only through its mean gradient (the data-parallel
# all-reduce): on 4 ranks they train what 2 train, to the all-reduce's rounding. An independent
# check of the elastic resume for them: it goes on as the run on 2 ranks went on.
SAME_AT_ANY_WORLD_SIZE = ("adamw_ddp", "muon_ddp")


def test_every_strategy_resumes_at_another_world_size_too():
    assert {POINTS[point][0].split("=", 1)[1] for point in FIRST_POINTS} == set(STRATEGIES)


@pytest.mark.slow
@pytest.mark.parametrize("point", FIRST_POINTS, ids=point_id)
def test_a_run_resumes_mid_period_on_twice_as_many_ranks(tmp_path_factory, point, capfd):
    from lowcomm.launch.local import prepare_run_dir

    strategy = STRATEGIES[POINTS[point][0].split("=", 1)[1]]
    run = _finished(tmp_path_factory, point, "fp32")
    _FINISHED.pop((point, "fp32"))  # its final checkpoint is rewritten by 4 ranks below
    if strategy.learners:
        _learners_resume_on_four(run, strategy, point, capfd)
        return
    run_dir = RunDir(run.run_dir)
    shutil.rmtree(run_dir.checkpoints / "step_000000006")
    run_dir.summary.unlink()
    reference_losses = [r["train/loss"] for r in run_dir.read_metrics() if "train/loss" in r]
    step3 = run_dir.checkpoints / "step_000000003"
    expected = [_peer_state(step3, strategy, rank) for rank in range(4)]
    grown = tiny_run(run.run_root, *_settings(point, "fp32", f"run_name={run.run_name}"), workers=4, max_steps=6)
    assert grown.run_dir == run.run_dir
    capfd.readouterr()

    states = spawn_workers(_restore_then_train, 4, str(prepare_run_dir(grown)), timeout_s=300)

    for rank, (state, want) in enumerate(zip(states, expected, strict=True)):
        assert (state["step"], state["final_step"]) == (3, 6)
        _same(state["optim"], want["optim"], f"rank {rank}'s optimizer state")
        assert torch.equal(state["rng"], want["rng"]), f"rank {rank}'s RNG"
    said = [line for line in capfd.readouterr().out.splitlines() if "resuming from step_000000003" in line]
    assert len(said) == 1 and (f"(written by 2 ranks; on these: {strategy.elastic_rule(2)})" in said[0]), said
    metrics = run_dir.read_metrics()
    assert [r for r in metrics if "event" in r] == [
        {"step": 3, "event": "resume", "world_size": 4, "written_by": 2, "rule": strategy.elastic_rule(2)}]
    losses = [r["train/loss"] for r in metrics if "train/loss" in r]
    assert losses[:3] == reference_losses[:3] and len(losses) == 6 and all(loss == loss for loss in losses)
    if strategy.name in SAME_AT_ANY_WORLD_SIZE:  # the mean gradient of one global batch, however it is split
        # (rounding only: 1e-7 for AdamW; Muon's Newton-Schulz iterations grow it to ~2e-5)
        assert losses == pytest.approx(reference_losses, rel=1e-4, abs=0)
    final = run_dir.checkpoints / "step_000000006"
    assert json.loads((final / "trainer.json").read_text())["world_size"] == 4
    own = sorted(path.name for path in final.glob("optim_rank*.pt"))
    assert own == ([] if strategy.replicated_optimizer_state else [f"optim_rank{rank}.pt" for rank in range(4)])


def _learners_resume_on_four(run, strategy, point: str, capfd) -> None:
    """A method of learners grown to 4: learner r resumes from learner (r mod W)'s checkpoint
    (its optimizer state and RNG), the synchronizer from its state of that step; each learner
    says what it did in its first line and its record."""
    from lowcomm.launch.local import prepare_run_dir
    from lowcomm.train.synchronizer import SYNCHRONIZER_ENV

    written = run.world_size
    for directory in _worker_dirs(run):
        shutil.rmtree(RunDir(directory).checkpoints / "step_000000006")
        RunDir(directory).summary.unlink()
    expected = []
    for learner in range(4):
        step3 = RunDir(learner_dir(run, learner % written)).checkpoints / "step_000000003"
        expected.append({"optim": torch.load(step3 / "optim_rank0.pt", weights_only=False),
                         "rng": torch.load(step3 / "rank0.pt", weights_only=False)["rng"]["torch"]})
    grown = tiny_run(run.run_root, *_settings(point, "fp32", f"run_name={run.run_name}"), "cluster.workers=4",
                     max_steps=6)
    assert grown.run_dir == run.run_dir and grown.world_size == 4
    capfd.readouterr()
    prepare_run_dir(grown)
    synchronizer = ThreadedSynchronizer(grown)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(SYNCHRONIZER_ENV, synchronizer.address)
            states = spawn_workers(_restore_then_train, 4, str(RunDir(grown.run_dir).config), timeout_s=300,
                                   backend=None)
    finally:
        assert synchronizer.stop() == 0
    for learner, (state, want) in enumerate(zip(states, expected, strict=True)):
        assert (state["step"], state["final_step"]) == (3, 6)
        _same(state["optim"], want["optim"], f"learner {learner}'s optimizer state")
        assert torch.equal(state["rng"], want["rng"]), f"learner {learner}'s RNG"
    rule = strategy.elastic_rule(written)
    said = [line for line in capfd.readouterr().out.splitlines() if "resuming from step_000000003" in line]
    assert len(said) == 4 and all(f"(written by {written} ranks; on these: {rule})" in line for line in said), said
    for learner in range(4):
        records = RunDir(learner_dir(grown, learner)).read_metrics()
        assert [r for r in records if "event" in r] == [
            {"step": 3, "event": "resume", "world_size": 4, "written_by": written, "rule": rule}]
        assert len([r for r in records if "train/loss" in r]) == 6 - (3 if learner >= written else 0)
    assert json.loads((Path(grown.run_dir) / "synchronizer.json").read_text())["resumed_from"] == 3
