"""``lowcomm-sweep``: a sweep file (``sweeps/<name>.yaml``) to SLURM, one job per point, or
trained here (``run``).

    lowcomm-sweep list
    lowcomm-sweep run table1_tiny                  # here, local workers: tune (widening the grid where
                                                   # the best sits at an edge), seeds, the seed table
    lowcomm-sweep submit table1_1b --dry-run data.paths='[/scratch/dolma/*.npy]' data.val_paths='[...]'
    lowcomm-sweep submit table1_1b data.paths='[/scratch/dolma/*.npy]' data.val_paths='[...]'
    lowcomm-sweep status table1_1b data.paths='[/scratch/dolma/*.npy]' data.val_paths='[...]'

Overrides after the sweep name are added to every job (data paths, ``cluster.partition=gpu``,
``run_root=/scratch/runs``, ...). Give ``status`` the same ones as ``submit``: a run's name
hashes what it trains, data included (``run_root``, ``wandb``, ``label`` and the cluster's
resources other than the world size are not part of it).

``submit`` validates every job first (nothing is submitted if any is invalid), then submits
one SLURM job per run, named after the run, skipping runs that are finished (``summary.json``)
or already pending / running; an interrupted run resumes from its latest checkpoint. Each job
asks for the time its size needs (:func:`lowcomm.launch.estimate.plan_job`: the GPU-hour
estimate from 6 x parameters x tokens at ``--mfu`` of ``--peak-flops`` per GPU, x 1.5, plus its
checkpoints and start-up), at most the profile's ``cluster.timeout_min``. ``--only N|LABEL``
takes a subset (1-based job numbers or labels; repeatable or a comma list).
``--dry-run`` prints every job (its overrides, key resolved values, run directory, time limit
and why, GPU-hours, the size of a checkpoint per rank and in all and the time the ranks take to
write it, in parallel at ``cluster.rank_write_MBps`` each, beside the preemption lead time, with
a warning when it does not fit), a table of the jobs' costs and the sweep's totals (GPU-hours,
checkpoint time, scratch space), and submits nothing; ``--show-script`` adds each job's batch
script and the ``srun`` line that starts its tasks. ``status`` lists each run as done / running / pending /
failed / not submitted with its last logged step and training loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lowcomm.cli.helptext import plain
from lowcomm.hardware import H100_BF16_PEAK_FLOPS as DEFAULT_PEAK_FLOPS
from lowcomm.hardware import TYPICAL_MFU as DEFAULT_MFU
from lowcomm.launch.signals import Terminated, sigterm_as_interrupt, stopped_between_runs
from lowcomm.paths import repo_root
from lowcomm.units import decimal_bytes, slurm_time

if TYPE_CHECKING:
    from lowcomm.config import RunConfig
    from lowcomm.config.sweep import PlannedRun, Sweep
    from lowcomm.launch.estimate import JobPlan
    from lowcomm.launch.slurm import Queue, RunState

PROG = "lowcomm-sweep"


def _read_queue() -> tuple[Queue | None, str]:
    """The queue, or None and why not (then runs that are queued cannot be recognised)."""
    from lowcomm.launch.slurm import Queue, SlurmUnavailable

    try:
        return Queue.read(), ""
    except SlurmUnavailable as exc:
        return None, str(exc).splitlines()[-1]


def _fields(values: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in values.items())


def _describe_run(plan: JobPlan) -> list[tuple[str, str]]:
    """The resolved values that decide what a job trains and what it asks SLURM for, and why."""
    from lowcomm.launch.slurm import lighthouse_shape, submitit_parameters

    run, estimate = plan.run, plan.estimate
    train, cluster = run.train, run.cluster
    optimizer = dataclasses.asdict(run.optimizer)
    lines = [
        ("model", f"{run.model.name}, {estimate.parameters:,} parameters"),
        ("optimizer", f"{run.optimizer_name}: {_fields(optimizer)}"),
    ]
    if run.compression.get("name", "none") != "none":
        compression = {key: value for key, value in run.compression.items() if key != "name"}
        lines.append(("compression", f"{run.compression['name']}: {_fields(compression)}"))
    lines.append((
        "train",
        f"{train.max_steps:,} steps x {train.global_batch_size} sequences x {train.seq_len} tokens = "
        f"{estimate.tokens / 1e9:,.2f}B tokens; micro batch {train.micro_batch_size}, warm-up "
        f"{train.warmup_steps}, cosine to {train.alpha_f} x lr, checkpoint every {train.checkpoint_every}, "
        f"keep {train.keep_checkpoints}",
    ))
    lines += _describe_data(run, estimate.tokens)
    if cluster.launcher == "slurm":
        sbatch = submitit_parameters(cluster, job_name=run.run_name)
        where = " ".join(
            f"{key}={sbatch.get(f'slurm_{key}', '(cluster default)')}" for key in ("partition", "account", "qos")
        )
        gpus = f", {cluster.gpus_per_node} GPUs/node" if cluster.gpus_per_node else ", CPU only"
        whole = ", whole nodes (--exclusive)" if cluster.additional_parameters.get("exclusive") else ""
        lines.append((
            "slurm",
            f"{cluster.nodes} nodes x {cluster.tasks_per_node} tasks{gpus}{whole}: the run's {run.world_size} ranks "
            f"(cluster.nodes x cluster.tasks_per_node, the world size it trains with); {cluster.cpus_per_task} "
            f"CPUs/task, {where}; {cluster.signal} {cluster.signal_delay_s} s before the end, up to "
            f"{cluster.max_requeues} time-out requeues",
        ))
        if cluster.fault_tolerance == "torchft":
            lines.append((
                "torchft",
                f"a job array of {cluster.replica_groups} one-node replica groups, each requeued apart (--requeue), "
                f"and a lighthouse job (1 CPU, {lighthouse_shape(cluster)['timeout_min']} min); an exchange "
                f"commits with {cluster.min_replicas} or more groups",
            ))
        lines.append(("time limit", plan.describe_time()))
    if estimate.gpu_hours is None:
        lines.append(("estimate", "no GPUs requested: no GPU-hours"))
    else:
        lines.append((
            "estimate",
            f"{estimate.gpu_hours:,.1f} GPU-hours of training ({estimate.wall_hours:,.2f} h on {estimate.gpus} "
            f"GPUs), {estimate.flops:.3g} FLOPs",
        ))
    lines.append(("checkpoint", plan.checkpoint.describe()))
    return lines


def _describe_data(run: RunConfig, tokens_needed: int) -> list[tuple[str, str]]:
    """The data a job reads and, where the files are here, how many epochs of it the run takes."""
    from lowcomm.data.memmap import available_tokens

    data = run.data
    if data.name == "synthetic":
        available = data.train_tokens
        lines = [("data", f"synthetic: seed {data.seed}, {available:,} training tokens")]
    else:
        validation = f" (validation: {', '.join(data.val_paths)})" if data.val_paths else ""
        lines = [("data", f"{data.name}: {', '.join(data.paths)}{validation}")]
        found = available_tokens(data.paths, data.dtype) if data.name == "memmap" else None
        if found is None:
            why = ("no file matches on this machine" if data.name == "memmap"
                   else "text is tokenized at launch, so its token count is not known yet")
            lines.append(("data check", f"not checked ({why}): files, dtype, size and epochs are unknown here"))
            return lines
        files, available = found
        lines.append(("data check", f"{files} files, {available:,} tokens of {data.dtype}"))
    epochs = tokens_needed / max(available, 1)
    lines.append(("epochs", f"{epochs:,.2f} ({tokens_needed:,} tokens needed, {available:,} available)"))
    if epochs > 1:
        lines.append(("warning", f"the run repeats its training data {epochs:,.1f} times"))
    return lines


def _state_words(state: RunState) -> str:
    if state.status == "done":
        return "skip: done"
    if state.active:
        return f"skip: {state.status} (job {state.job_id})"
    if state.last_step:
        return f"would submit (resumes; last logged step {state.last_step})"
    return "would submit"


def _jobs(count: int) -> str:
    return f"{count} job{'s' if count != 1 else ''}"


def _gpu_hours(plans: Sequence[JobPlan]) -> float:
    return sum(plan.gpu_hours or 0.0 for plan in plans)


def _seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.0f} s"
    return f"{seconds / 60:,.1f} min" if seconds < 7200 else f"{seconds / 3600:,.1f} h"


def _select(planned: list[PlannedRun], only: Sequence[str] | None) -> list[tuple[int, PlannedRun]]:
    """The jobs ``--only`` names (1-based numbers or labels), with their numbers; all without it.
    Raises ValueError naming what matches no job, or a label several jobs share, and the valid
    numbers and labels."""
    from lowcomm.config.suggest import did_you_mean

    numbered = list(enumerate(planned, start=1))
    if not only:
        return numbered
    by_label: dict[str, list[int]] = {}
    for number, job in numbered:
        by_label.setdefault(job.run.label, []).append(number)
    chosen: dict[int, PlannedRun] = {}
    problems = []
    for item in (part.strip() for value in only for part in value.split(",")):
        if item.isdigit() and 1 <= int(item) <= len(planned):
            chosen[int(item)] = planned[int(item) - 1]
        elif len(by_label.get(item, [])) == 1:
            chosen[by_label[item][0]] = planned[by_label[item][0] - 1]
        elif item in by_label:
            problems.append(f"{item!r} labels jobs {', '.join(map(str, by_label[item]))}: give one's number")
        elif item:
            problems.append(f"{item!r} is no job{did_you_mean(item, list(by_label))}")
    if problems or not chosen:
        labels = "; ".join(f"{', '.join(map(str, numbers))} {label}" for label, numbers in by_label.items())
        raise ValueError(f"--only: {'; '.join(problems) or 'no job given'}; the jobs are 1-{len(planned)} "
                         f"({labels})")
    return sorted(chosen.items())


def _plan(sweep_name: str, overrides: Sequence[str], check_data_files: bool = True,
          ) -> tuple[Sweep, list[PlannedRun]] | None:
    """The sweep and its validated jobs; None (after saying why) when any job is invalid.
    ``check_data_files=False``: the data files need not be here (dry run, status)."""
    from lowcomm.config.sweep import load_sweep, plan_sweep

    try:
        sweep = load_sweep(sweep_name)
        return sweep, plan_sweep(sweep, overrides, check_data_files=check_data_files)
    except (FileNotFoundError, ValueError) as exc:  # ConfigError is a ValueError
        print(f"{PROG}: {exc}", file=sys.stderr)
        return None


def _submit(_parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lowcomm.config import ConfigError
    from lowcomm.config.sweep import job_errors
    from lowcomm.data.memmap import DataError
    from lowcomm.launch.estimate import plan_job
    from lowcomm.launch.slurm import Queue, SlurmUnavailable, check_profile, submit_training

    dry_run = args.dry_run or args.show_script
    plan = _plan(args.sweep, args.overrides, check_data_files=not dry_run)
    if plan is None:
        return 2
    sweep, planned = plan
    errors = []
    for job in planned:
        try:
            check_profile(job.run)
        except ConfigError as exc:
            errors += [(job.number, job.varying, error) for error in exc.errors]
    if errors:
        print(f"{PROG}: {ConfigError(job_errors(errors, len(sweep.jobs)))}", file=sys.stderr)
        return 2
    try:
        selected = _select(planned, args.only)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    jobs = [(number, job, plan_job(job.run, mfu=args.mfu, peak_flops=args.peak_flops)) for number, job in selected]
    if dry_run:
        return _dry_run(sweep, len(planned), jobs, args)

    try:
        queue = Queue.read()
    except SlurmUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    width = len(str(len(planned)))
    outcomes: Counter[str] = Counter()
    submitted_hours = 0.0
    for number, job, job_plan in jobs:
        try:
            submission = submit_training(job_plan.run, queue=queue)
        except SlurmUnavailable as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            print(f"{PROG}: stopped after {outcomes['submitted']} submissions; submit again to continue",
                  file=sys.stderr)
            return 1
        except DataError as exc:  # the data does not fit the model: refused before submitting
            print(f"{PROG}: {job.run.run_name}: {exc}", file=sys.stderr)
            print(f"{PROG}: stopped after {outcomes['submitted']} submissions", file=sys.stderr)
            return 2
        outcomes[submission.action] += 1
        asked = ""
        if submission.action == "submitted":
            submitted_hours += job_plan.gpu_hours or 0.0
            asked = f" (time limit {slurm_time(job_plan.time_limit_min)})"
        print(f"[{number:>{width}}/{len(planned)}] {job.run.label}: {job.run.run_name}: {submission.describe()}"
              f"{asked}", flush=True)
    only = f" --only {','.join(str(number) for number, _job, _plan in jobs)}" if args.only else ""
    print(f"sweep {sweep.name}: submitted {outcomes['submitted']} jobs ({submitted_hours:,.1f} GPU-hours), "
          f"skipped {outcomes['skipped']}{' (of those selected with' + only + ')' if only else ''}; watch them "
          f"with: {PROG} status {args.sweep} {' '.join(args.overrides)}".rstrip())
    return 0


def _plan_table(jobs: list[tuple[int, PlannedRun, JobPlan]]) -> list[str]:
    """One row per job: what it costs and asks for."""
    rows = [("#", "label", "GPU-hours", "checkpoints (count x write)", "time limit", "nodes", "scratch")]
    for number, job, plan in jobs:
        rows.append((
            str(number), job.run.label, "-" if plan.gpu_hours is None else f"{plan.gpu_hours:,.1f}",
            f"{plan.checkpoint.describe_writes(plan.checkpoints)} = {_seconds(plan.checkpoint_s)}",
            slurm_time(plan.time_limit_min) + (" (capped)" if plan.capped else ""), str(plan.run.cluster.nodes),
            decimal_bytes(plan.scratch_bytes),
        ))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    right = {0, 2, 5, 6}
    return ["  " + "  ".join(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
                             for i, cell in enumerate(row)).rstrip() for row in rows]


def _dry_run(sweep: Sweep, count: int, jobs: list[tuple[int, PlannedRun, JobPlan]], args: argparse.Namespace) -> int:
    from lowcomm.launch.estimate import STARTUP_MIN, TIME_MARGIN, TIME_STEP_MIN
    from lowcomm.launch.slurm import batch_script, run_state, srun_line

    queue, queue_problem = _read_queue()
    plans = [plan for _number, _job, plan in jobs]
    described = [_describe_run(plan) for plan in plans]
    # A value every job has is printed once, above the jobs; the costs always per job.
    per_job = ("estimate", "time limit", "checkpoint")
    shared = [(label, value) for label, value in described[0]
              if label not in per_job and all((label, value) in lines for lines in described)]
    chosen = f", {len(jobs)} selected (--only)" if args.only else ""
    print(f"sweep {sweep.name}: {count} jobs{chosen}, one SLURM job each")
    if sweep.description:
        print(f"  {sweep.description}")
    for label, value in [("base", " ".join(sweep.base) or "-"),
                         *([("command line", " ".join(args.overrides))] if args.overrides else []),
                         *shared]:
        print(f"  {label:<12} {value}")
    print(f"  {'estimate':<12} 6 x parameters x training tokens at MFU {args.mfu:g} of "
          f"{args.peak_flops / 1e12:g} TFLOP/s per GPU; a job asks for that x {TIME_MARGIN:g}, plus its "
          f"checkpoints and {STARTUP_MIN} min start-up, in whole {TIME_STEP_MIN} min, at most cluster.timeout_min")
    if queue is None:
        print(f"  queue not read ({queue_problem}): runs already queued are not recognised here")
    width = len(str(count))
    to_submit: list[JobPlan] = []
    for (number, job, plan), lines in zip(jobs, described, strict=True):
        state = run_state(plan.run.run_dir, plan.run.run_name, queue)
        if state.status != "done" and not state.active:
            to_submit.append(plan)
        print()
        print(f"[{number:>{width}}/{count}] {plan.run.label}: {plan.run.run_name}  {_state_words(state)}")
        own = [line for line in lines if line not in shared]
        for label, value in [("overrides", " ".join(job.varying) or "(base only)"),
                             ("run dir", str(plan.run.run_dir)), *own]:
            print(f"    {label:<11} {value}")
        if args.show_script:
            script = batch_script(plan.run)
            print(f"    {'srun':<11} {srun_line(script)}")
            print(f"    batch script (sbatch runs it as {plan.run.run_dir}/slurm/<job id>_submission.sh):")
            print("\n".join(f"      {line}".rstrip() for line in script.rstrip().splitlines()))
    print()
    print("\n".join(_plan_table(jobs)))
    checkpoint_s = sum(plan.checkpoint_s for plan in plans)
    training = sum(plan.estimate.gpu_hours or 0.0 for plan in plans)
    print(f"total: {_jobs(len(jobs))}, {_gpu_hours(plans):,.1f} GPU-hours ({training:,.1f} training + "
          f"{_gpu_hours(plans) - training:,.1f} writing {sum(plan.checkpoints for plan in plans)} checkpoints, "
          f"{_seconds(checkpoint_s)} in all), scratch {decimal_bytes(sum(plan.scratch_bytes for plan in plans))} at the "
          f"peak (keep_checkpoints + 1 each); to submit: {_jobs(len(to_submit))}, {_gpu_hours(to_submit):,.1f} GPU-hours")
    for count_of, what in (
        (sum(not plan.checkpoint.fits for plan in plans), "cannot write a checkpoint within the preemption lead time"),
        (sum(plan.checkpoint.outlasts_timeout for plan in plans),
         "take longer to write a checkpoint than cluster.collective_timeout_s"),
        (sum(plan.too_few_requeues for plan in plans), "need more time-out requeues than cluster.max_requeues"),
    ):
        if count_of:
            print(f"WARNING: {count_of} of {len(jobs)} jobs {what} (see above)")
    print("dry run: nothing submitted")
    return 0


def _status(_parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lowcomm.launch.slurm import run_state

    plan = _plan(args.sweep, args.overrides, check_data_files=False)
    if plan is None:
        return 2
    sweep, planned = plan
    # a local sweep (lowcomm-sweep run) has no queue to read: its runs hold their directory's lock
    on_slurm = any(job.run.cluster.launcher != "local" for job in planned)
    queue, queue_problem = _read_queue() if on_slurm else (None, "")
    states = [run_state(job.run.run_dir, job.run.run_name, queue) for job in planned]
    shown = ["not started" if state.status == "not submitted" and not on_slurm else state.status for state in states]
    counts = Counter(shown)
    order = ("done", "running", "pending", "failed", "stopped", "not submitted", "not started")
    print(f"sweep {sweep.name}: {len(planned)} runs (" +
          ", ".join(f"{counts[status]} {status}" for status in order if counts[status]) + ")")
    if on_slurm and queue is None:
        print(f"  queue not read ({queue_problem}): running and pending jobs cannot be told apart from failed ones")
    rows = [("status", "job", "step", "val loss", "label", "run")]
    for job, state, status in zip(planned, states, shown, strict=True):
        # why it failed; who trains it when no job of this directory's record does (a local run)
        if state.detail and (state.status == "failed" or (state.status == "running" and not state.job_id)):
            status += f" ({state.detail})"
        step = f"{state.last_step}/{job.run.train.max_steps}" if state.last_step is not None else "-"
        loss = "-" if state.val_loss is None else (
            f"{state.val_loss:.4f}" + (f" @{state.val_step}" if state.val_step != state.last_step else ""))
        rows.append((status, state.job_id or "-", step, loss, job.run.label, str(job.run.run_dir)))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    if "stopped" in counts:
        command = "lowcomm-sweep run" if not on_slurm else "lowcomm-sweep submit"
        print(f"  stopped runs resume from their last checkpoint: {command} {args.sweep}")
    return 0


def _list(_parser: argparse.ArgumentParser, _args: argparse.Namespace) -> int:
    from lowcomm.config.sweep import load_sweep

    for path in sorted((repo_root() / "sweeps").glob("*.yaml")):
        sweep = load_sweep(str(path), labelled=False)
        summary = sweep.description if len(sweep.description) <= 80 else sweep.description[:77] + "..."
        print(f"{sweep.name:<26} {len(sweep.jobs):>3} jobs  {summary}")
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _plan_jobs(parser: argparse.ArgumentParser, sweep: Sweep, jobs: list, overrides: list[str]) -> list:
    """Compose and validate ``jobs`` (exits 2 naming every bad job)."""
    from lowcomm.config import ConfigError
    from lowcomm.config.sweep import Sweep as SweepSpec
    from lowcomm.config.sweep import plan_sweep

    try:
        return plan_sweep(SweepSpec(sweep.name, sweep.description, [job.overrides for job in jobs], sweep.base,
                                    laptop=sweep.laptop), overrides)
    except ConfigError as exc:
        parser.exit(2, f"{PROG}: {exc}\n")


def _run_jobs(parser: argparse.ArgumentParser, sweep: Sweep, jobs: list, phase: str, overrides: list[str],
              started: float) -> dict[int, list] | None:
    """Validate every job of one phase, then train them here one after the other; returns
    each point's run configs (with the job), or None after a failure (named on stderr)."""
    from lowcomm.data.memmap import DataError
    from lowcomm.launch.local import WorkerFailure, launch_local
    from lowcomm.rundir import RunDir
    from lowcomm.train.loop import EXIT_DIVERGED, RunDiverged

    planned = _plan_jobs(parser, sweep, jobs, overrides)
    by_point: dict[int, list] = {}
    pending = [p for p in planned if not RunDir(p.run.run_dir).summary.is_file()]
    phase_started, done = time.perf_counter(), 0
    print(f"[{phase}] {len(planned)} runs, {len(planned) - len(pending)} finished before", flush=True)
    for index, plan in enumerate(planned, 1):
        job = jobs[plan.number - 1]
        by_point.setdefault(job.point, []).append((job, plan.run))
        fresh = not RunDir(plan.run.run_dir).summary.is_file()
        label = plan.run.label
        eta = ""
        if done:
            eta = f", ETA {(time.perf_counter() - phase_started) / done * (len(pending) - done) / 60:.0f} min"
        print(f"[{phase}] ({index}/{len(planned)}) {label}: {' '.join(plan.varying[-2:])} "
              f"({(time.perf_counter() - started) / 60:.1f} min in{eta})", flush=True)
        try:
            launch_local(plan.run)
        except RunDiverged:
            pass  # its line is printed; the tuner and the reports rank it worst and say so
        except DataError as exc:  # refused before spawning
            print(f"{PROG}: {label} failed: {exc}", file=sys.stderr)
            return None
        except WorkerFailure as exc:
            if exc.returncode != EXIT_DIVERGED:
                if exc.detail:  # the first failing rank's traceback, for a cause lowcomm does not know
                    print(exc.detail, file=sys.stderr, end="")
                print(f"{PROG}: {label} failed: {exc}", file=sys.stderr)
                return None
        done += fresh
    return by_point


@dataclasses.dataclass
class _Tuned:
    """The tuning phase's outcome: each point's chosen value, and per label the loss at every
    value tried, the value chosen and, where the choice stayed at an edge, why it is doubtful."""

    chosen: dict[int, float]
    grid: dict[str, dict[float, float]]
    best: dict[str, float]
    notes: dict[str, str]


def _tune_phase(parser: argparse.ArgumentParser, sweep: Sweep, overrides: list[str], started: float) -> _Tuned | None:
    """Every job at each factor of its tuned key on the tuning budget; then, round by round, one
    more value a factor of 2 beyond the edge for each job whose best sits at an edge of the values
    tried (at most ``tune.widen`` per side, :func:`~lowcomm.config.sweep.tuning_step`). None after
    a failed run or when every run of a job diverged (named on stderr)."""
    from lowcomm.config.sweep import TuningDiverged, tuning_job, tuning_jobs, tuning_step
    from lowcomm.report.runs import load_run

    key, widen = sweep.tune.key, sweep.tune.widen
    name = key.rsplit(".", 1)[-1]
    losses: dict[int, dict[float, float]] = {}
    labels: dict[int, str] = {}

    def record(by_point: dict[int, list]) -> None:
        for point, entries in by_point.items():
            for job, run in entries:
                labels[point] = run.label
                record = load_run(run.run_dir)
                loss = record.final_val_loss
                losses.setdefault(point, {})[job.value] = math.nan if loss is None else loss
                if not math.isfinite(losses[point][job.value]):
                    why = (f"at step {record.diverged['step']}: {record.diverged['reason']}" if record.diverged
                           else f"(final val loss {loss})")
                    print(f"[tune] {run.label}: {name}={job.value:.3g} diverged {why}: "
                          "never chosen, and the grid does not widen past it", flush=True)

    tuned = _run_jobs(parser, sweep, tuning_jobs(sweep), "tune", overrides, started)
    if tuned is None:
        return None
    record(tuned)
    grids = {point: list(by_value) for point, by_value in losses.items()}
    while True:
        try:
            steps = {point: tuning_step(by_value, grids[point], widen, job=f"job {point + 1} ({labels[point]})")
                     for point, by_value in losses.items()}
        except TuningDiverged as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return None
        widening = {point: step for point, step in steps.items() if step.next is not None}
        if not widening:
            break
        for point, step in widening.items():
            print(f"[widen] {labels[point]}: the best {name}, {step.best:.3g} (final val loss "
                  f"{losses[point][step.best]:.4f}), is the {step.edge} tried: trying {name}={step.next:.3g} "
                  f"(widening {step.widened + 1} of at most {widen} {'down' if step.edge == 'lowest' else 'up'})",
                  flush=True)
        more = _run_jobs(parser, sweep, [tuning_job(sweep, point, step.next) for point, step in widening.items()],
                         "widen", overrides, started)
        if more is None:
            return None
        record(more)
    notes = {labels[point]: step.edge_note(key, widen) for point, step in steps.items() if step.at_edge}
    for label, note in notes.items():
        print(f"[tune] {label}: {note}", flush=True)
    return _Tuned(chosen={point: step.best for point, step in steps.items()},
                  grid={labels[point]: by_value for point, by_value in losses.items()},
                  best={labels[point]: step.best for point, step in steps.items()}, notes=notes)


def _tuning_text(sweep: Sweep, tuned: _Tuned) -> str:
    """The summary's tuning section: how the grid was searched, the grid, the doubtful choices."""
    from lowcomm.report.seeds import grid_table

    tune = sweep.tune
    how = f"{tune.key} over {', '.join(f'{f:g}x' for f in tune.factors)}"
    if tune.widen:
        how += (f", widened one factor of 2 at a time, at most {tune.widen} per side, where the best sat at "
                "an edge")
    text = f"Tuning ({how}, {' '.join(tune.overrides)}):\n\n" + grid_table(tuned.grid, tuned.best)
    if tuned.notes:
        text += "\n\n" + "\n".join(f"{label}: {note}." for label, note in tuned.notes.items())
    return text


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Train a sweep on this machine (local workers, no SLURM). A sweep with ``tune`` runs in two
    phases: every job at each factor of its tuned key on the shorter budget, widened a factor of 2
    at a time where the best sits at an edge (:func:`_tune_phase`), then each at its best value
    (lowest final validation loss, never a diverged run) once per seed; then the seed table is
    written."""
    from lowcomm.config.sweep import choose_baseline, final_jobs, laptop_sweep, load_sweep, select_jobs
    from lowcomm.report.figures import plot_seed_bands
    from lowcomm.report.runs import load_run
    from lowcomm.report.seeds import seed_groups, seed_rows, seed_table
    from lowcomm.report.tables import write_csv

    try:
        sweep = load_sweep(args.sweep)
        if args.laptop:
            sweep = laptop_sweep(sweep)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    if args.only and args.out is None:
        parser.exit(2, f"{PROG}: --only writes a table of some of {sweep.name}'s jobs: give --out DIR, so that it "
                       f"does not replace the table of all of them in results/{sweep.name}\n")
    started = time.perf_counter()
    out = args.out or repo_root() / "results" / sweep.name
    chosen, tuned = None, None
    # The final runs (with tune: differing from these only in the tuned value, a positive factor
    # of a valid one): a bad seed, budget or baseline is named now, not after the runs before it.
    try:
        baseline = choose_baseline(sweep, _plan_jobs(parser, sweep, final_jobs(sweep), args.overrides), args.baseline)
        if args.only:
            sweep = select_jobs(sweep, args.only, keep=baseline)
    except ValueError as exc:
        parser.exit(2, f"{PROG}: {exc}\n")
    if sweep.tune is not None:
        tuned = _tune_phase(parser, sweep, args.overrides, started)
        if tuned is None:
            return 1
        chosen = tuned.chosen
    final = _run_jobs(parser, sweep, final_jobs(sweep, chosen), "final", args.overrides, started)
    if final is None:
        return 1
    # runs that differ in their seed only are one group, from the sweep's seeds: or a grid over seed
    groups = seed_groups([load_run(run.run_dir) for _point, entries in sorted(final.items()) for _job, run in entries])
    rows = seed_rows(groups, baseline, lr_tuned_for=sweep.lr_tuned_models(laptop=args.laptop))
    text = seed_table(rows)
    if args.only:
        text = (f"Some of {sweep.name}'s jobs (--only): {', '.join(g.label for g in groups)}; the runs of the others "
                f"are not in this table.\n\n{text}")
    if tuned is not None:
        text += "\n\n" + _tuning_text(sweep, tuned)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text + "\n")
    write_csv(rows, out / "summary.csv")
    figures = plot_seed_bands([(g.label, g.runs) for g in groups], out, formats=("png",),
                              title=f"{sweep.name}{' (--only)' if args.only else ''}: validation loss over seeds")
    counts = sorted({len(group.runs) for group in groups})
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    print(f"\n[{sweep.name}] {len(groups)} groups of {seeds} seeds, {sum(len(g.runs) for g in groups)} runs, in "
          f"{(time.perf_counter() - started) / 60:.1f} min\n\n{text}\n")
    print(f"table:   {out / 'summary.md'}\ntable:   {out / 'summary.csv'}")
    for path in figures:
        print(f"figure:  {path}")
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def sweep_file_format() -> str:
    """The sweep file's keys, as :mod:`lowcomm.config.sweep` documents them (its docstring's
    example, read from the source: --help stays quick, without importing torch)."""
    import ast

    doc = ast.get_docstring(ast.parse((Path(__file__).parent.parent / "config" / "sweep.py").read_text())) or ""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("    ")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return plain("\n".join(["a sweep file (YAML; every key optional, sweeps/*.yaml are examples):",
                             *lines[start:end]]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Run a sweep file (sweeps/NAME.yaml or any path) here "
                                     "(run), or submit it to SLURM, one job per point (submit; check it first with "
                                     "--dry-run), and follow it (status).",
                                     epilog=sweep_file_format(), formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    overrides_help = "Hydra overrides added to every job (KEY=VALUE), e.g. data.paths='[...]' cluster.partition=gpu"

    submit = commands.add_parser("submit", help="validate every job, then submit the ones not done or queued")
    submit.add_argument("sweep", help="a sweep name (sweeps/NAME.yaml) or a sweep file")
    submit.add_argument("overrides", nargs="*", help=overrides_help)
    submit.add_argument("--dry-run", action="store_true",
                        help="print every job, its run directory, time limit and costs, and the totals; submit nothing")
    submit.add_argument("--show-script", action="store_true",
                        help="with the dry run (implied), print each job's batch script and the srun line that starts "
                             "its tasks, as submitit would submit them")
    submit.add_argument("--only", action="append", metavar="N|LABEL",
                        help="only these jobs: 1-based numbers (as the dry run numbers them) or labels; repeat it or "
                             "give a comma list (--only 1,3)")
    submit.add_argument("--mfu", type=_fraction, default=DEFAULT_MFU,
                        help=f"model FLOP utilisation assumed for the estimate and the time limit (default {DEFAULT_MFU})")
    submit.add_argument("--peak-flops", type=_positive, default=DEFAULT_PEAK_FLOPS,
                        help=f"peak FLOP/s of one GPU (default {DEFAULT_PEAK_FLOPS:.4g}: H100 SXM, dense bf16)")
    submit.set_defaults(handler=_submit)

    status = commands.add_parser("status", help="each run: done / running / pending / failed / not submitted")
    status.add_argument("sweep", help="a sweep name (sweeps/NAME.yaml) or a sweep file")
    status.add_argument("overrides", nargs="*", help=f"{overrides_help}; the same as at submission")
    status.set_defaults(handler=_status)

    run = commands.add_parser(
        "run", help="train a sweep here (local workers): tune, then seeds, then the seed table",
        description="Train every job of a sweep on this machine. With the sweep's tune block, each job first "
                    "runs at every factor of its tuned key on the shorter budget (where the best value is the "
                    "smallest or largest tried, up to tune.widen more values a factor of 2 beyond it, default 2), "
                    "then at the best value once per seed; the table (excess loss over the Bayes floor as mean ± "
                    "std over seeds, bytes, a verdict against the baseline by a stated rule, from 2 seeds), the tuning grid "
                    "and a figure with seed bands go to --out. "
                    "Finished runs are not trained again. Example: lowcomm-sweep run table1_tiny")
    run.add_argument("sweep", help="a sweep name (sweeps/NAME.yaml) or a sweep file")
    run.add_argument("overrides", nargs="*", help="Hydra overrides added to every job, e.g. run_root=/scratch/runs")
    run.add_argument("--out", type=Path, help="where the table and figure go (default: results/<sweep>)")
    run.add_argument("--only", action="append", metavar="LABEL",
                     help="only the jobs with these labels (repeat it or give a comma list) and the baseline, whose "
                          "runs the verdicts need; needs --out")
    run.add_argument("--laptop", action="store_true",
                     help="run every job small here: the tiny model on the synthetic corpus at the quickstart's budget "
                          "(200 steps), local workers, each method at its quickstart learning rate (tuned for the tiny "
                          "model, so verdicts are given); your own data after it: data=memmap data.paths=[...]")
    run.add_argument("--baseline", metavar="LABEL",
                     help="the label of the job every job is compared with (default: the sweep file's baseline, "
                          "else its AdamW-DDP job)")
    run.set_defaults(handler=_run)

    listing = commands.add_parser("list", help="the sweeps in sweeps/")
    listing.set_defaults(handler=_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after the options: argparse leaves those after an option over.
    args, rest = parser.parse_known_args(argv)
    multirun = [arg for arg in rest if arg in ("-m", "--multirun")]
    if multirun:  # Hydra's habit, answered with what lowcomm-sweep does instead
        parser.exit(2, f"{PROG}: {multirun[0]} (Hydra's multirun) is not needed: {PROG} runs every job of the sweep "
                       "file; to run each job with several values of a key, list them in the file's grid: "
                       "{KEY: [VALUE, VALUE]}\n")
    unknown = [arg for arg in rest if arg.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    if getattr(args, "overrides", None):
        from lowcomm.config.compose import value_lists

        lists, _ = value_lists(args.overrides)
        if lists:  # said once, not once per job of the sweep
            listed = " ".join(f"{key}={','.join(values)}" for key, values in lists.items())
            grid = ", ".join(f"{key}: [{', '.join(values)}]" for key, values in lists.items())
            parser.exit(2, f"{PROG}: {listed} on the command line is a list of values, but the command line's "
                           f"overrides go to every job of the sweep alike: to run each job with each value, add "
                           f"grid: {{{grid}}} to the sweep file\n")
    try:
        with sigterm_as_interrupt():
            return args.handler(parser, args)
    except (KeyboardInterrupt, Terminated) as exc:  # planning or between runs: a run interrupted raises Interrupted
        return stopped_between_runs(PROG, exc)
    except Exception as exc:
        from lowcomm.launch.local import Interrupted

        if not isinstance(exc, Interrupted):
            raise
        # one line, the signal's status: a rerun resumes this run and skips the finished ones
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.exit_status


if __name__ == "__main__":
    sys.exit(main())
