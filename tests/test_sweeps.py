"""Sweeps as files, and lowcomm-sweep on a real SLURM.

Without SLURM: the sweep file format, validation of every job before anything runs, the paper's
sweeps (their jobs against the paper's own table), the GPU-hour estimate, the dry run, run
states, and the preemption flag. With the local cluster (``slurm``): a 2-point sweep of tiny
runs, 2 ranks per job, runs to completion; a second submission submits nothing; a run sent the
preemption signal mid-run is requeued, resumes from the checkpoint it wrote on the signal and
ends exactly where an uninterrupted run ends.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from lowcomm.cli import sweep as sweep_cli
from lowcomm.cli.train import run_config
from lowcomm.config import ConfigError, repo_root, validate
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep, plan_sweep
from lowcomm.launch.estimate import compute_estimate
from lowcomm.launch.slurm import PreemptionFlag, Queue, QueuedJob, run_state
from lowcomm.runlock import RunDirLock
from lowcomm.strategies import STRATEGIES
from lowcomm.train.metrics import read_metrics
from runs import (
    SMALL_SYNTHETIC,
    TINY,
    slurm_job_id,
    slurm_logs,
    train_in_workers,
    train_losses,
    wait_for_summaries,
)

SWEEPS = repo_root() / "sweeps"
# The paper-scale sweeps; the laptop ones (quickstart, table1_tiny) build on the quickstart's experiment.
PAPER_SWEEPS = sorted(path.stem for path in SWEEPS.glob("*.yaml")
                      if "experiment=quickstart" not in load_sweep(path.stem, labelled=False).base)
OLMO_1B_PARAMETERS = 1_176_764_416  # configs/model/olmo_1b.yaml
OLMO_300M_PARAMETERS = 319_946_752
PAPER_TOKENS_PER_STEP = 2048 * 2048


def _write_sweep(path: Path, spec: dict) -> Path:
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def token_files(tmp_path_factory) -> list[str]:
    """Tiny OLMo-format token files (uint16, ids below the OLMo vocabulary) for data=memmap."""
    directory = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    paths = []
    for name, count in (("train.bin", 50_000), ("val.bin", 10_000)):
        rng.integers(0, 50_000, size=count, dtype=np.uint16).tofile(directory / name)
        paths.append(str(directory / name))
    return [f"data.paths=[{paths[0]}]", f"data.val_paths=[{paths[1]}]"]


# ------------------------------------------------------------------------------ the file format


def test_points_with_their_own_grids_expand_in_file_order(tmp_path):
    path = _write_sweep(tmp_path / "s.yaml", {
        "base": ["model=tiny", "data=memmap"],
        "points": [
            {"overrides": ["optimizer=demo"], "grid": {"optimizer.compression_topk": [4, 2]}},
            ["optimizer=adamw_ddp"],
        ],
        "grid": {"seed": [0, 1], "data.paths": [["a.bin", "b.bin"]]},  # a list value, not a job of its own
    })

    sweep = load_sweep(str(path))

    shared = [["seed=0", "data.paths=[a.bin,b.bin]"], ["seed=1", "data.paths=[a.bin,b.bin]"]]
    points = [["optimizer=demo", "optimizer.compression_topk=4"], ["optimizer=demo", "optimizer.compression_topk=2"],
              ["optimizer=adamw_ddp"]]
    labels = ["DeMo s=64 k=4", "DeMo s=64 k=2", "AdamW-DDP"]  # the jobs over seeds share one
    assert sweep.jobs == [["model=tiny", "data=memmap", *point, *grid, f"label='{label}'"]
                          for point, label in zip(points, labels, strict=True) for grid in shared]
    assert sweep.base == ["model=tiny", "data=memmap"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"base": ["model=tiny"], "grids": {}}, "unknown keys"),
        ({"points": [{"overrides": ["optimizer=demo"], "sweep": {}}]}, r"points\[0\]: unknown keys"),
        ({"grid": {"seed": 3}}, "grid.seed: give a non-empty list"),
        ({"base": "model=tiny"}, "base: give a list of Hydra overrides"),
    ],
)
def test_malformed_sweep_files_are_rejected_with_the_place(tmp_path, spec, message):
    with pytest.raises(ValueError, match=message):
        load_sweep(str(_write_sweep(tmp_path / "bad.yaml", spec)))


def test_every_invalid_job_is_reported_before_anything_runs(tmp_path):
    path = _write_sweep(tmp_path / "s.yaml", {
        "base": [*TINY, f"run_root={tmp_path}", "train.precision=fp64"],
        "points": [["optimizer=nope"], ["train.warmup_steps=-1"], []],
    })

    with pytest.raises(ConfigError) as info:
        plan_sweep(load_sweep(str(path)))

    errors = sorted(info.value.errors)
    assert len(errors) == 3
    assert errors[0].startswith("job 1 (optimizer=nope): ") and "optimizer/nope" in errors[0]
    assert errors[1].startswith("job 2 (train.warmup_steps=-1): train.warmup_steps=-1 must be in")
    # job 1 is not composed at all; the base's mistake is named once for the others
    assert errors[2].startswith("jobs 2, 3: train.precision='fp64' is not allowed")
    assert list(tmp_path.iterdir()) == [path]  # nothing was created


# ----------------------------------------------------------------------------- the paper's sweeps


def _optimizers_of(sweep_name: str) -> set[str]:
    return {override.split("=", 1)[1] for job in load_sweep(sweep_name).jobs
            for override in job if override.startswith("optimizer=")}


@pytest.mark.slow
@pytest.mark.parametrize("sweep_name", PAPER_SWEEPS)
def test_paper_sweeps_validate_with_the_users_data(sweep_name, token_files, tmp_path):
    missing = _optimizers_of(sweep_name) - set(STRATEGIES)
    if missing:
        pytest.skip(f"optimizers not registered yet: {sorted(missing)}")

    planned = plan_sweep(load_sweep(sweep_name), [*token_files, f"run_root={tmp_path}"])

    assert len(planned) == len(load_sweep(sweep_name).jobs)  # every job is its own run
    for job in planned:
        run = job.run
        assert run.experiment == sweep_name
        assert run.model.name in ("olmo_300m", "olmo_1b")
        assert (run.cluster.nodes, run.cluster.tasks_per_node, run.cluster.gpus_per_node) == (8, 8, 8)
        assert (run.train.global_batch_size, run.train.seq_len, run.train.micro_batch_size) == (2048, 2048, 8)
        # partition, account and qos are never in the files
        assert (run.cluster.partition, run.cluster.account, run.cluster.qos) == (None, None, None)
        parameters = OLMO_1B_PARAMETERS if run.model.name == "olmo_1b" else OLMO_300M_PARAMETERS
        if sweep_name.startswith("table1"):
            assert run.train.max_steps * PAPER_TOKENS_PER_STEP >= 100e9 > (run.train.max_steps - 1) * PAPER_TOKENS_PER_STEP
        else:  # 20 tokens per parameter
            assert run.train.max_steps * PAPER_TOKENS_PER_STEP >= 20 * parameters
            assert (run.train.max_steps - 1) * PAPER_TOKENS_PER_STEP < 20 * parameters


@pytest.mark.slow
@pytest.mark.parametrize(("sweep_name", "paper_model"), [("table1_300m", "300M"), ("table1_1b", "1B")])
def test_table1_sweeps_are_the_papers_rows(sweep_name, paper_model, token_files, tmp_path):
    with (repo_root() / "results" / "paper" / "table1.csv").open() as handle:
        rows = [row for row in csv.DictReader(handle) if row["model"] == paper_model]
    expected = {(row["optimizer"], row["chunk"] or None, row["topk"] or None) for row in rows}

    planned = plan_sweep(load_sweep(sweep_name), [*token_files, f"run_root={tmp_path}"])

    names = {"demo": "DeMo", "adamw_ddp": "AdamW-DDP"}
    found = set()
    for job in planned:
        optimizer = job.run.optimizer
        if job.run.optimizer_name == "demo":
            found.add(("DeMo", str(optimizer.compression_chunk), str(optimizer.compression_topk)))
        else:
            found.add((names[job.run.optimizer_name], None, None))
    assert found == expected
    assert len(planned) == len(expected)


@pytest.mark.slow
def test_gpu_hours_are_six_n_d_at_the_given_utilisation(token_files, tmp_path):
    run = plan_sweep(load_sweep("table1_1b"), [*token_files, f"run_root={tmp_path}"])[0].run

    estimate = compute_estimate(run, mfu=0.5, peak_flops=1e15)

    tokens = 23842 * 2048 * 2048
    assert estimate.parameters == OLMO_1B_PARAMETERS
    assert estimate.tokens == tokens
    assert estimate.gpu_hours == pytest.approx(6 * OLMO_1B_PARAMETERS * tokens / (0.5 * 1e15) / 3600)
    assert estimate.wall_hours == pytest.approx(estimate.gpu_hours / 64)


@pytest.mark.slow
def test_dry_run_lists_every_job_and_the_total_and_submits_nothing(token_files, tmp_path, capsys):
    run_root = tmp_path / "runs"

    code = sweep_cli.main(["submit", "table1_1b", "--dry-run", "--mfu", "0.5", *token_files, f"run_root={run_root}"])

    out = capsys.readouterr().out
    assert code == 0
    # the jobs, as the dry run plans them: without reading the data (a scan would cache in run_root)
    planned = plan_sweep(load_sweep("table1_1b"), [*token_files, f"run_root={run_root}"], check_data_files=False)
    for job in planned:
        assert str(job.run.run_dir) in out
        assert " ".join(job.varying) in out
    per_job = 6 * OLMO_1B_PARAMETERS * 23842 * 2048 * 2048 / (0.5 * 989e12) / 3600
    assert out.count(f"{per_job:,.1f} GPU-hours of training") == len(planned)
    assert f"total: {len(planned)} jobs, " in out and f" GPU-hours ({len(planned) * per_job:,.1f} training + " in out
    assert "1,176,764,416 parameters" in out
    assert not run_root.exists()  # no config written, no job submitted
    # the tiny token files stand for a 100B-token corpus: the plan says how often it repeats them
    assert "warning      the run repeats its training data" in out


@pytest.mark.slow
def test_a_dry_run_plans_from_a_laptop_without_the_data_files(tmp_path, capsys):
    """The README's paths point at the cluster's scratch; the plan must not need them."""
    code = sweep_cli.main(["submit", "table1_1b", "--dry-run", "data.paths=[/scratch/dolma/*.npy]",
                           "data.val_paths=[/scratch/dolma/val/*.npy]", f"run_root={tmp_path / 'runs'}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "not checked (no file matches on this machine)" in out
    assert "dry run: nothing submitted" in out
    # without --dry-run the same command refuses: data must be there to submit
    assert sweep_cli.main(["submit", "table1_1b", "data.paths=[/scratch/dolma/*.npy]",
                           "data.val_paths=[/scratch/dolma/val/*.npy]", f"run_root={tmp_path / 'runs'}"]) == 2
    assert "data.paths: no file matches '/scratch/dolma/*.npy'" in capsys.readouterr().err


# --------------------------------------------------------------------------- states and signals


def _record(run_dir: Path, job_id: str) -> None:
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    with (run_dir / "slurm" / "submissions.jsonl").open("a") as handle:
        handle.write(json.dumps({"job_id": job_id}) + "\n")


def test_run_states_follow_the_run_directory_and_the_queue(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    queue = Queue((QueuedJob("7", "run-a", "COMPLETED"), QueuedJob("8", "run-a", "PENDING"),
                   QueuedJob("9", "other", "RUNNING"), QueuedJob("10", "run-b", "CANCELLED")))

    assert run_state(run_dir, "run-z", queue).status == "not submitted"
    (run_dir / "metrics.jsonl").write_text('{"step": 2, "train/loss": 3.9}\n')
    assert run_state(run_dir, "run-z", queue).status == "stopped"  # trained a while, by no job recorded here
    with RunDirLock(run_dir):  # a launcher trains it now, here or on a machine sharing the filesystem
        running = run_state(run_dir, "run-z", None)
        assert running.status == "running" and running.detail.startswith(f"pid {os.getpid()} on {socket.gethostname()}")
    assert run_state(run_dir, "run-z", queue).status == "stopped"  # released
    # queued from elsewhere (no record here): found by its name
    assert (run_state(run_dir, "run-a", queue).status, run_state(run_dir, "run-a", queue).job_id) == ("pending", "8")
    _record(run_dir, "10")
    (run_dir / "metrics.jsonl").write_text(
        '{"step": 4, "train/loss": 3.5}\n{"step": 4, "val/loss": 3.6}\n{"step": 5, "perf/step_s": 1}\n')
    failed = run_state(run_dir, "run-b", queue)
    assert (failed.status, failed.job_id, failed.detail, failed.last_step, failed.last_loss) == (
        "failed", "10", "CANCELLED", 4, 3.5)
    assert (failed.val_step, failed.val_loss) == (4, 3.6)  # what the tables show
    assert run_state(run_dir, "run-b", None).detail == "queue unknown"
    _record(run_dir, "9")  # resubmitted, now running
    assert run_state(run_dir, "run-b", queue).status == "running"
    (run_dir / "summary.json").write_text("{}")
    assert run_state(run_dir, "run-b", queue).status == "done"


def test_the_preemption_signal_only_sets_a_flag_and_submitit_runs_after_the_checkpoint():
    displaced_calls = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: displaced_calls.append(signum))
    try:
        flag = PreemptionFlag.install("USR1")
        assert not flag()

        os.kill(os.getpid(), signal.SIGUSR1)

        assert flag() and displaced_calls == []  # submitit's handler did not run in the signal
        with pytest.raises(SystemExit) as leaving:
            flag.hand_over()
        assert leaving.value.code == 0
        assert displaced_calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ------------------------------------------------------------------------------- on real SLURM

STEPS = 80
# 2 ranks of one CPU each: the local node's two cores.
SLURM_RUN = [*TINY, *SMALL_SYNTHETIC, "cluster=slurm_debug", f"train.max_steps={STEPS}",
             "train.checkpoint_every=0"]
# Decoupled DiLoCo's learners, each merge waiting for both (quorum 0, wait): the order of
# arrival is then the steps', and a preempted run resumes bit for bit, its synchronizer too
LEARNERS_RUN = [*SLURM_RUN, "optimizer=decoupled_diloco", "optimizer.sync_every=10", "optimizer.num_fragments=2",
                "optimizer.quorum=0", "optimizer.wait=true"]


def _cli(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert sweep_cli.main(list(argv)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def slurm_sweep(local_slurm, tmp_path_factory):  # noqa: ARG001 - needs the cluster up
    """A 2-point sweep submitted with lowcomm-sweep and run to completion; its status on the way."""
    directory = tmp_path_factory.mktemp("slurm_sweep")
    # Decoupled DiLoCo: a job of learners, whose first rank starts their synchronizer on its node
    # (the other methods' SLURM jobs: test_nodes_slurm, test_lost_peers)
    sweep_file = _write_sweep(directory / "tiny_pair.yaml", {
        "description": "two learning rates of the tiny model, 2 learners per job",
        "base": LEARNERS_RUN,
        "grid": {"optimizer.lr": [3.0e-3, 1.0e-3]},
    })
    cli_args = [str(sweep_file), f"run_root={directory / 'runs'}"]
    submitted = _cli("submit", *cli_args)
    status_while_queued = _cli("status", *cli_args)
    run_dirs = [job.run.run_dir for job in plan_sweep(load_sweep(str(sweep_file)), cli_args[1:])]
    wait_for_summaries(run_dirs, timeout_s=240)
    return {"cli_args": cli_args, "run_dirs": run_dirs, "submitted": submitted,
            "status_while_queued": status_while_queued}


@pytest.mark.slow
@pytest.mark.slurm
def test_a_two_point_sweep_runs_one_two_rank_job_per_point(slurm_sweep):
    run_dirs = slurm_sweep["run_dirs"]
    assert len(set(run_dirs)) == 2
    assert slurm_sweep["submitted"].count("submitted job") == 2
    for run_dir in run_dirs:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == STEPS
        assert [step for step, _ in train_losses(run_dir)] == list(range(1, STEPS + 1))
        config = OmegaConf.load(run_dir / "config.yaml")
        assert config.run_name == run_dir.name
        # the job was named after the run, and both of its tasks wrote a log
        submission = (run_dir / "slurm" / f"{slurm_job_id(run_dir)}_submission.sh").read_text()
        assert f"#SBATCH --job-name={run_dir.name}" in submission
        assert "#SBATCH --ntasks-per-node=2" in submission
        assert {path.name for path in (run_dir / "slurm").glob("*_log.out")} == {
            f"{slurm_job_id(run_dir)}_0_log.out", f"{slurm_job_id(run_dir)}_1_log.out"}
        # the job's synchronizer: started by rank 0 under this job's tag, on the node's name, served
        # both learners to their end; learner 1's records its own
        record = json.loads((run_dir / "synchronizer.json").read_text())
        assert record["launch"] == f"{slurm_job_id(run_dir)}.0" and record["finished"] is True
        assert record["address"].startswith(f"{socket.gethostname()}:") and record["learners"] == 2
        assert record["bytes"]["rx"] > 0 and record["bytes"]["tx"] > 0
        assert json.loads((run_dir / "replicas" / "1" / "summary.json").read_text())["learner"] == 1
        assert summary["learner"] == 0
    # the two learning rates trained differently
    assert train_losses(run_dirs[0])[-1] != train_losses(run_dirs[1])[-1]
    queued_lines = [line for line in slurm_sweep["status_while_queued"].splitlines() if str(run_dirs[0].parent) in line]
    assert len(queued_lines) == 2
    assert all(line.split()[0] in ("pending", "running") for line in queued_lines)


@pytest.mark.slurm
def test_status_lists_each_finished_run_with_its_last_step_and_loss(slurm_sweep):
    out = _cli("status", *slurm_sweep["cli_args"])

    assert "2 runs (2 done)" in out
    for run_dir in slurm_sweep["run_dirs"]:
        line = next(line for line in out.splitlines() if str(run_dir) in line)
        step, _ = train_losses(run_dir)[-1]
        val_loss = [r["val/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val/loss" in r][-1]
        assert line.split()[:4] == ["done", slurm_job_id(run_dir), f"{step}/{STEPS}", f"{val_loss:.4f}"]


@pytest.mark.slurm
def test_resubmitting_a_finished_sweep_submits_nothing(slurm_sweep):
    before = subprocess.run(["squeue", "--noheader", "--states=all", "--format=%i"],
                            capture_output=True, text=True, check=True).stdout.split()

    out = _cli("submit", *slurm_sweep["cli_args"])

    after = subprocess.run(["squeue", "--noheader", "--states=all", "--format=%i"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert out.count("skipped: done") == 2 and "submitted job" not in out
    assert sorted(after) == sorted(before)
    for run_dir in slurm_sweep["run_dirs"]:
        assert len((run_dir / "slurm" / "submissions.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.slurm
def test_a_preempted_run_is_requeued_resumes_and_ends_like_an_uninterrupted_one(local_slurm, tmp_path):  # noqa: ARG001
    # AdamW-DDP's two ranks on SLURM, against the same config trained uninterrupted in forked ranks
    # (the sweep's learners need not stop at one step on a signal: nothing joins them)
    overrides = [*SLURM_RUN, "optimizer.lr=0.003"]
    reference = train_in_workers(validate(compose([*overrides, f"run_root={tmp_path / 'reference'}"])))
    run_dir = run_config(compose([*overrides, f"run_root={tmp_path}"]))
    assert run_dir.name == reference.name
    job_id = slurm_job_id(run_dir)
    queued = run_state(run_dir, run_dir.name, Queue.read())
    assert (queued.status, queued.job_id) in {("pending", job_id), ("running", job_id)}

    # Preempt once a few steps are logged: SLURM's --signal=USR2@delay reaches every task.
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").is_file() or len(train_losses(run_dir)) < 3:
        if time.monotonic() > deadline:
            pytest.fail(f"the run did not start logging:\n{slurm_logs(run_dir)}", pytrace=False)
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    wait_for_summaries([run_dir], timeout_s=180)

    task0_log = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    assert task0_log.count(f"Starting with JobEnvironment(job_id={job_id},") == 2, "not requeued under its id"
    resumed = [line for line in task0_log.splitlines() if "resuming from step_" in line]
    assert len(resumed) == 1, f"the requeued job did not resume from a checkpoint:\n{task0_log}"
    resumed_step = int(resumed[0].split("resuming from step_")[1].split(";")[0])
    assert 3 <= resumed_step < STEPS  # the checkpoint written on the signal (periodic ones are off)
    assert len((run_dir / "slurm" / "submissions.jsonl").read_text().splitlines()) == 1
    # Bit for bit what the uninterrupted run did, every step and the final validation.
    assert train_losses(run_dir) == train_losses(reference)
    final = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    assert final == json.loads((reference / "summary.json").read_text())["final_val_loss"]


@pytest.mark.slow
def test_dry_run_prints_checkpoint_size_and_write_time_and_warns_when_it_does_not_fit(token_files, tmp_path, capsys):
    run_root = tmp_path / "runs"
    code = sweep_cli.main(["submit", "table1_1b", "--dry-run", *token_files, f"run_root={run_root}"])
    out = capsys.readouterr().out
    assert code == 0
    params_gb = OLMO_1B_PARAMETERS * 4 / 1e9  # fp32
    # DeMo: the model once (rank 0), each rank's momentum; the ranks write at once, 400 MB/s each
    # (cluster.rank_write_MBps): rank 0, with the model and its momentum, takes longest
    demo_total = 65 * params_gb
    assert (f"{demo_total:,.2f} GB in all: {params_gb:,.2f} GB once (rank 0) + {params_gb:,.2f} GB per rank x 64; "
            f"{2 * params_gb / 0.4:,.0f} s: the ranks write at once at 400 MB/s each (cluster.rank_write_MBps), "
            f"rank 0 the most ({2 * params_gb:,.2f} GB)") in out
    # AdamW-DDP: model and both moments, the same on every rank: written once
    assert f"{3 * params_gb:,.2f} GB in all: {3 * params_gb:,.2f} GB once (rank 0) + 0.00 GB per rank x 64" in out
    assert "WARNING" not in out  # the paper's sweep fits its own profile

    # a filesystem that gives each rank 20 MB/s: DeMo's 9.4 GB take 471 s, AdamW-DDP's 14.1 GB 706 s,
    # past the 300 s lead time, within the 900 s collective timeout
    sweep_cli.main(["submit", "table1_1b", "--dry-run", *token_files, f"run_root={run_root}",
                    "cluster.rank_write_MBps=20"])
    out = capsys.readouterr().out
    assert f"{2 * params_gb / 0.02:,.0f} s: the ranks write at once at 20 MB/s each" in out
    assert "WARNING: 11 of 11 jobs cannot write a checkpoint within the preemption lead time (see above)" in out
    assert "cluster.collective_timeout_s (see above)" not in out
