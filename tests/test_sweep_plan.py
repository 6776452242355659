"""What ``lowcomm-sweep submit`` plans before it submits, and that it submits what it planned.

Without SLURM: the paper's sweeps pass their own checks on the shipped profile (checkpoints
written by the ranks in parallel within the preemption lead time and the collective timeout);
each job's time limit follows from its size and is capped at the profile's, saying so; the plan's
per-job table and totals (GPU-hours, checkpoint time, scratch space); ``--show-script`` prints
the batch script submitit renders; ``--only`` picks jobs by number or label and refuses an
unknown one before anything happens; an unset environment variable in a path is a config error.
With the local SLURM (``slurm``): ``--only`` submits one job of two, and the batch script SLURM
got is the one ``--show-script`` printed.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from lowcomm.cli import sweep as sweep_cli
from lowcomm.config import ConfigError, repo_root, validate
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep, plan_sweep
from lowcomm.launch.estimate import STARTUP_MIN, TIME_MARGIN, TIME_STEP_MIN, checkpoint_count, plan_job
from lowcomm.launch.slurm import batch_script, make_executor, srun_line
from runs import SMALL_SYNTHETIC, TINY, slurm_job_id

# the cluster's data, as the README gives it: the dry run needs no file of it here
DATA = ["data.paths=[/scratch/dolma/train/*.npy]", "data.val_paths=[/scratch/dolma/val/*.npy]"]
SLURM_64GPU_SWEEPS = sorted(path.stem for path in (repo_root() / "sweeps").glob("*.yaml")
                            if "experiment=quickstart" not in load_sweep(path.stem, labelled=False).base)
OLMO_1B_PARAMETERS = 1_176_764_416


def _run(*overrides: str, run_root) -> object:
    return validate(compose(["experiment=paper_table1", "model=olmo_1b", *overrides, *DATA, f"run_root={run_root}"]),
                    check_data_files=False)


def _submit(capsys, *argv: str) -> tuple[int, str, str]:
    code = sweep_cli.main(["submit", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------- the paper's sweeps fit


@pytest.mark.slow
@pytest.mark.parametrize("sweep_name", SLURM_64GPU_SWEEPS)
def test_every_paper_sweep_passes_its_own_checks_on_the_shipped_profile(sweep_name, tmp_path):
    planned = plan_sweep(load_sweep(sweep_name), [*DATA, f"run_root={tmp_path}"], check_data_files=False)
    assert {job.run.cluster.name for job in planned} == {"slurm_64gpu"}
    for job in planned:
        plan = plan_job(job.run)
        assert plan.checkpoint.fits, (job.run.label, plan.checkpoint.describe())
        assert not plan.checkpoint.outlasts_timeout, (job.run.label, plan.checkpoint.describe())
        assert not plan.too_few_requeues, (job.run.label, plan.describe_time())


def test_the_ranks_write_their_checkpoint_shares_in_parallel_at_the_profiles_rate(tmp_path):
    run = _run("optimizer=demo", run_root=tmp_path)
    assert run.cluster.rank_write_MBps == 400  # configs/cluster/slurm_64gpu.yaml, measured by a benchmark

    checkpoint = plan_job(run).checkpoint

    model_bytes = OLMO_1B_PARAMETERS * 4  # fp32; DeMo's momentum is the same size, on every rank
    assert checkpoint.replicated_bytes == model_bytes and checkpoint.per_rank_bytes == model_bytes
    assert checkpoint.total_bytes == 65 * model_bytes
    # rank 0 writes the model and its own momentum, the others only theirs, all at once
    assert checkpoint.write_s == pytest.approx(2 * model_bytes / 400e6)
    assert checkpoint.fits and checkpoint.write_s < run.cluster.signal_delay_s
    # a slower filesystem is one override: the time follows, and the lead time no longer holds
    slow = plan_job(_run("optimizer=demo", "cluster.rank_write_MBps=25", run_root=tmp_path)).checkpoint
    assert slow.write_s == pytest.approx(16 * checkpoint.write_s)
    assert not slow.fits and "WARNING: it does not fit" in slow.describe()


def test_diloco_checkpoints_at_outer_boundaries_hold_no_workers_own_parameters(tmp_path):
    """Issue 46: at an outer boundary a worker's parameters are its global copy, so a checkpoint
    there leaves them out; one between two boundaries (a preemption's) holds them. By hand, for
    OLMo-1B in fp32 (M bytes of parameters) on 64 ranks: once, the model, the global parameters
    and the outer momentum (3M); per rank, AdamW's two moments (2M), and the parameters (M) only
    between boundaries."""
    model_bytes = OLMO_1B_PARAMETERS * 4
    on = plan_job(_run("optimizer=diloco", "optimizer.sync_every=30", "train.checkpoint_every=300",
                       run_root=tmp_path))
    checkpoint = on.checkpoint
    assert checkpoint.replicated_bytes == 3 * model_bytes
    assert checkpoint.periodic_total_bytes == 3 * model_bytes + 64 * 2 * model_bytes
    assert checkpoint.total_bytes == 3 * model_bytes + 64 * 3 * model_bytes
    # the preemption lead time must hold the largest (rank 0: 3M once + its 3M); each periodic one is 3M + 2M
    assert checkpoint.write_s == pytest.approx(6 * model_bytes / 400e6)
    assert checkpoint.periodic_write_s == pytest.approx(5 * model_bytes / 400e6)
    # the final one, at train.max_steps (23,842: not a multiple of 30), between two boundaries
    assert on.checkpoint_s == pytest.approx(((on.checkpoints - 1) * 5 + 6) * model_bytes / 400e6)
    # keep_checkpoints (2) periodic ones on disk, and the next, which may be a preemption's
    assert on.scratch_bytes == 2 * checkpoint.periodic_total_bytes + checkpoint.total_bytes
    assert checkpoint.describe().startswith(f"{checkpoint.periodic_total_bytes / 1e9:,.2f} GB each periodic one, "
                                            "at an outer boundary")

    off = plan_job(_run("optimizer=diloco", "optimizer.sync_every=30", "train.checkpoint_every=250",
                        run_root=tmp_path)).checkpoint
    assert off.periodic_total_bytes == off.total_bytes == checkpoint.total_bytes
    assert (f"at outer boundaries each would be {checkpoint.periodic_total_bytes / 1e9:,.2f} GB (no worker's own "
            "parameters): make train.checkpoint_every a multiple of optimizer.sync_every") in off.describe()
    # a method without outer boundaries says nothing of them
    assert "outer boundar" not in plan_job(_run("optimizer=demo", run_root=tmp_path)).checkpoint.describe()


def test_a_rank_write_rate_that_is_not_positive_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"cluster.rank_write_MBps must be a positive number .* got 0"):
        _run("optimizer=demo", "cluster.rank_write_MBps=0", run_root=tmp_path)


# ------------------------------------------------------------------------ time limit and size


def test_the_time_limit_follows_the_jobs_size_with_a_margin(tmp_path):
    plan = plan_job(_run("optimizer=demo", run_root=tmp_path))

    estimate = plan.estimate
    assert plan.checkpoints == checkpoint_count(plan.run.train) == math.ceil(23842 / 500)
    needed = estimate.wall_hours * 60 * TIME_MARGIN + plan.checkpoints * plan.checkpoint.write_s / 60 + STARTUP_MIN
    assert plan.needed_min == pytest.approx(needed)
    assert plan.time_limit_min == TIME_STEP_MIN * math.ceil(needed / TIME_STEP_MIN) < 24 * 60
    assert not plan.capped
    # the job asks SLURM for it: the batch script's --time, and the config the run directory keeps
    assert f"#SBATCH --time={plan.time_limit_min}\n" in batch_script(plan.run)
    assert plan.run.raw["cluster"]["timeout_min"] == plan.time_limit_min
    assert plan.run.run_name == _run("optimizer=demo", run_root=tmp_path).run_name  # not part of the name


@pytest.mark.slow
def test_a_short_job_asks_for_a_short_time_and_says_why(tmp_path, capsys):
    # the 300M ablations: 20 tokens per parameter, 8 minutes on 64 GPUs
    code, out, _ = _submit(capsys, "demo_momentum_beta", "--dry-run", *DATA, f"run_root={tmp_path}", "--only", "1")
    assert code == 0
    plan = plan_job(plan_sweep(load_sweep("demo_momentum_beta"), [*DATA, f"run_root={tmp_path}"],
                               check_data_files=False)[0].run)
    assert plan.estimate.wall_hours * 60 < 10
    assert plan.time_limit_min == 30
    line = next(line for line in out.splitlines() if line.strip().startswith("time limit"))
    # a checkpoint every 300 steps (configs/experiment/paper_ablation_300m.yaml) and at the end
    assert plan.checkpoints == math.ceil(plan.run.train.max_steps / 300)
    assert f"0:30:00 on 8 nodes ({plan.estimate.wall_hours:,.2f} h of training x 1.5 + checkpoints {plan.checkpoints} x " in line
    assert "the run's 64 ranks (cluster.nodes x cluster.tasks_per_node" in out  # why 8 nodes
    assert "24:00:00" not in out


@pytest.mark.slow
def test_a_job_longer_than_the_profiles_limit_is_capped_and_resumes_across_requeues(tmp_path, capsys):
    plan = plan_job(_run("optimizer=demo", "train.max_steps=80000", run_root=tmp_path))
    assert plan.capped and plan.time_limit_min == 24 * 60
    assert plan.requeues == math.ceil(plan.needed_min / (24 * 60)) - 1 == 1
    assert (f"24:00:00 on 8 nodes: needs {plan.needed_min / 60:,.1f} h (" in plan.describe_time()
            and "capped at 24:00:00 (cluster.timeout_min); it resumes from its checkpoint across 1 time-out requeue"
            in plan.describe_time())
    assert "WARNING" not in plan.describe_time()
    # without requeues for time-outs the job would stop: the plan warns
    code, out, _ = _submit(capsys, "table1_1b", "--dry-run", *DATA, f"run_root={tmp_path}", "--only", "1",
                            "train.max_steps=80000", "cluster.max_requeues=0")
    assert code == 0
    assert "WARNING: cluster.max_requeues is 0: raise it, or submit again when the job stops" in out
    assert "WARNING: 1 of 1 jobs need more time-out requeues than cluster.max_requeues (see above)" in out
    assert "24:00:00 (capped)" in out


# ---------------------------------------------------------------------------- table and totals


@pytest.mark.slow
def test_the_plan_totals_gpu_hours_checkpoint_time_and_scratch_per_job_and_for_the_sweep(tmp_path, capsys):
    code, out, _ = _submit(capsys, "table1_1b", "--dry-run", *DATA, f"run_root={tmp_path}", "--only", "1,11")
    assert code == 0
    planned = plan_sweep(load_sweep("table1_1b"), [*DATA, f"run_root={tmp_path}"], check_data_files=False)
    plans = {1: plan_job(planned[0].run), 11: plan_job(planned[10].run)}
    rows = {line.split()[0]: line for line in out.splitlines() if line[:4].strip() in ("1", "11")}
    for number, plan in plans.items():
        # training, and the job holding its GPUs while it writes its checkpoints
        gpu_hours = plan.estimate.gpu_hours + 64 * plan.checkpoints * plan.checkpoint.write_s / 3600
        assert plan.gpu_hours == pytest.approx(gpu_hours)
        # keep_checkpoints on disk, and one more while the next is written
        assert plan.scratch_bytes == 3 * plan.checkpoint.total_bytes
        row = rows[str(number)]
        assert planned[number - 1].run.label in row
        assert f"{gpu_hours:,.1f}" in row and f"{plan.checkpoints} x {plan.checkpoint.write_s:,.0f} s = " in row
        assert f"{plan.time_limit_min // 60}:{plan.time_limit_min % 60:02d}:00" in row
        assert f"{plan.scratch_bytes / 1e9:,.1f} GB" in row
    total_hours = sum(plan.gpu_hours for plan in plans.values())
    training = sum(plan.estimate.gpu_hours for plan in plans.values())
    scratch = sum(plan.scratch_bytes for plan in plans.values())
    checkpoint_min = sum(plan.checkpoint_s for plan in plans.values()) / 60
    assert (f"total: 2 jobs, {total_hours:,.1f} GPU-hours ({training:,.1f} training + {total_hours - training:,.1f} "
            f"writing 96 checkpoints, {checkpoint_min:,.1f} min in all), scratch {scratch / 1e9:,.1f} GB at the peak"
            in out)
    assert "sweep table1_1b: 11 jobs, 2 selected (--only)" in out
    assert "WARNING" not in out


# ------------------------------------------------------------------------------- --show-script


@pytest.mark.slow
def test_show_script_prints_the_batch_script_and_srun_line_submitit_would_submit(tmp_path, capsys):
    code, out, _ = _submit(capsys, "table1_1b", "--show-script", *DATA, f"run_root={tmp_path / 'runs'}",
                            "--only", "AdamW-DDP")
    assert code == 0
    run = plan_job(plan_sweep(load_sweep("table1_1b"), [*DATA, f"run_root={tmp_path / 'runs'}"],
                              check_data_files=False)[10].run).run
    script = batch_script(run)
    for line in ("#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 f"#SBATCH --time={run.cluster.timeout_min}", f"#SBATCH --job-name={run.run_name}",
                 "#SBATCH --signal=USR2@300", "#SBATCH --exclusive", "export SUBMITIT_PREEMPT_SIGNAL=USR2"):
        assert line in script.splitlines()
        assert f"      {line}" in out.splitlines()
    srun = srun_line(script)
    assert srun.startswith("srun --unbuffered --output ") and srun.endswith(f"-m submitit.core._submit {run.run_dir}/slurm")
    assert f"    srun        {srun}" in out.splitlines()
    assert "dry run: nothing submitted" in out
    assert not (tmp_path / "runs").exists()  # --show-script implies the dry run: nothing written


@pytest.mark.skipif(subprocess.run(["which", "srun"], capture_output=True).returncode != 0,
                    reason="submitit's SLURM executor needs srun on the PATH")
def test_the_shown_script_is_the_one_the_executor_renders(tmp_path):
    run = plan_job(_run("optimizer=demo", run_root=tmp_path)).run
    executor = make_executor(run.run_dir / "slurm", run.cluster, job_name=run.run_name)._executor  # noqa: SLF001
    rendered = executor._make_submission_file_text(executor._submitit_command_str, "x")  # noqa: SLF001
    assert batch_script(run) == rendered


# --------------------------------------------------------------------------------------- --only


@pytest.mark.parametrize("only", [["12"], ["0"], ["DeMo s=64 k=33"], ["1", "13"]])
@pytest.mark.slow
def test_an_unknown_job_in_only_is_refused_naming_the_valid_ones_before_anything(tmp_path, capsys, only):
    argv = ["table1_1b", "--dry-run", *DATA, f"run_root={tmp_path / 'runs'}"]
    for item in only:
        argv += ["--only", item]

    code, out, err = _submit(capsys, *argv)

    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    bad = only[-1]
    assert f"--only: '{bad}' is no job" in err
    assert "the jobs are 1-11 (1 DeMo s=64 k=32; 2 DeMo s=64 k=16;" in err and "; 11 AdamW-DDP)" in err
    if bad == "DeMo s=64 k=33":
        assert "(did you mean DeMo s=64 k=32?)" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_only_takes_numbers_and_labels_repeated_or_comma_separated(tmp_path, capsys):
    code, out, _ = _submit(capsys, "table1_1b", "--dry-run", *DATA, f"run_root={tmp_path}",
                            "--only", "11,DeMo s=128 k=4", "--only", "2")
    assert code == 0
    headers = [line.split(":")[0] for line in out.splitlines() if line.startswith("[")]
    assert headers == ["[ 2/11] DeMo s=64 k=16", "[10/11] DeMo s=128 k=4", "[11/11] AdamW-DDP"]


# ------------------------------------------------------------------ environment variables in paths


@pytest.mark.parametrize(("run_root", "message"), [
    ("/scratch/${oc.env:USER}/lowcomm",
     "run_root: the environment variable USER is not set (${oc.env:USER}); set it, or write the value out"),
    ("/scratch//lowcomm", "run_root=/scratch//lowcomm: an empty directory name ('//'), as an unset environment "
                          "variable leaves it"),
    ("/scratch/$USER/lowcomm", "run_root=/scratch/$USER/lowcomm: $USER was not expanded"),
    ("/scratch/${USER}/lowcomm", "run_root: ${USER} names no config key; for the environment variable write "
                                 "${oc.env:USER}"),
])
@pytest.mark.slow
def test_an_unset_environment_variable_in_a_path_is_a_config_error(monkeypatch, capsys, run_root, message):
    monkeypatch.delenv("USER", raising=False)

    code, out, err = _submit(capsys, "table1_1b", "--dry-run", *DATA, f"run_root={run_root}")

    assert code == 2 and out == ""
    assert message in err
    assert "Traceback" not in err and "full_key" not in err


def test_a_data_path_with_an_unset_variable_is_named_too(monkeypatch):
    monkeypatch.delenv("DOLMA", raising=False)
    with pytest.raises(ConfigError, match=r"data.paths\[0\]: the environment variable DOLMA is not set"):
        validate(compose(["data=memmap", "data.paths=[${oc.env:DOLMA}/train.npy]", "data.val_paths=[/v.npy]"]),
                 check_data_files=False)


def test_a_set_environment_variable_resolves_into_the_path(monkeypatch):
    monkeypatch.setenv("USER", "alice")
    run = _run("optimizer=demo", run_root="/scratch/${oc.env:USER}/lowcomm")
    assert str(run.run_dir).startswith("/scratch/alice/lowcomm/")


# ------------------------------------------------------------------------------- on SLURM


@pytest.mark.slurm
def test_only_submits_one_job_and_slurm_gets_the_script_show_script_printed(local_slurm, tmp_path, capsys):  # noqa: ARG001
    sweep_file = tmp_path / "pair.yaml"
    sweep_file.write_text(json.dumps({"base": [*TINY, *SMALL_SYNTHETIC, "cluster=slurm_debug", "train.max_steps=20"],
                                      "grid": {"optimizer.lr": [2.0e-3, 4.0e-3]}}))
    argv = [str(sweep_file), f"run_root={tmp_path / 'runs'}", "--only", "2"]
    planned = plan_sweep(load_sweep(str(sweep_file)), [f"run_root={tmp_path / 'runs'}"])
    code, shown, _ = _submit(capsys, *argv, "--show-script")
    assert code == 0

    code, out, err = _submit(capsys, *argv)

    assert code == 0, err
    assert out.count("submitted job") == 1 and "[2/2]" in out
    first, second = (job.run.run_dir for job in planned)
    assert not first.exists()  # job 1 was not selected: nothing of it written or submitted
    job_id = slurm_job_id(second)
    try:
        submitted = (second / "slurm" / f"{job_id}_submission.sh").read_text()
        assert submitted == batch_script(plan_job(planned[1].run).run)
        assert all(f"      {line}".rstrip() in shown.splitlines() for line in submitted.splitlines())
        assert f"    srun        {srun_line(submitted)}" in shown.splitlines()
    finally:
        subprocess.run(["scancel", job_id], check=False)
