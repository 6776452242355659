"""The main job (``make quickstart``): train every run of ``sweeps/quickstart.yaml`` on this
machine, then print the comparison table and write it with the figures beside the runs, in
``runs/quickstart/report/``: ``summary.md`` / ``summary.csv``, ``loss_vs_step.png``,
``loss_vs_cum_MB.png`` (the paper's Figure 2) and ``loss_vs_mb.png`` (its Figure 4: final loss
against MB/step, Pareto front). The committed reference in ``results/quickstart/`` is only
rewritten on request (``--out results/quickstart``), so a run leaves the checkout unmodified.

The benchmarks (HellaSwag / ARC-Easy / PIQA) are left out by default: the tiny byte-level
model, trained on Markov text, scores at chance, and a few documents cannot tell runs apart.
``--eval-limit N`` evaluates each final checkpoint on N documents per task and adds the scores,
each with its standard error and n.

    python -m lowcomm.cli.quickstart [--sweep quickstart] [--eval-limit 20] [extra overrides...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lowcomm.cli.helptext import plain
from lowcomm.config import ConfigError, repo_root
from lowcomm.config.sweep import load_sweep, plan_sweep
from lowcomm.launch.local import Interrupted, WorkerFailure, launch_local
from lowcomm.launch.signals import Terminated, sigterm_as_interrupt, stopped_between_runs
from lowcomm.report.figures import plot_loss_curves, plot_loss_vs_mb
from lowcomm.report.runs import load_run
from lowcomm.report.tables import SUMMARY_COLUMNS, markdown_table, summary_columns, summary_rows, write_csv
from lowcomm.rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowcomm-quickstart", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="quickstart")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the table and figures go (default: <run_root>/<sweep>/report/; "
                             "results/<sweep> refreshes the committed reference)")
    parser.add_argument("--eval-limit", type=int, default=0,
                        help="evaluate each final checkpoint on this many documents per benchmark task "
                             "(default 0: none; a byte-level model trained on Markov text scores at chance, "
                             "and 20 documents give a standard error of about 0.11)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every run")
    args = parser.parse_args(argv)
    try:
        with sigterm_as_interrupt():
            return _quickstart(args)
    except (KeyboardInterrupt, Terminated) as exc:  # between runs: a run interrupted raises Interrupted
        return stopped_between_runs("quickstart", exc)


def _quickstart(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep)

    # Validate every run before the first one starts.
    try:
        runs = [planned.run for planned in plan_sweep(sweep, args.overrides)]
    except ConfigError as exc:
        print(f"quickstart: {exc}", file=sys.stderr)
        return 2
    out_dir = args.out or Path(runs[0].run_root) / runs[0].experiment / "report"
    reference = repo_root() / "results" / sweep.name
    print(f"[quickstart] {len(runs)} runs of {sweep.path}, {runs[0].world_size} workers each")
    started = time.perf_counter()
    finished_before = sum(RunDir(run.run_dir).summary.is_file() for run in runs)
    for index, run in enumerate(runs, 1):
        label = run.label
        print(f"\n[quickstart] ({index}/{len(runs)}) {label}: {run.run_dir}", flush=True)
        try:
            launch_local(run)
        except WorkerFailure as exc:
            if exc.detail:  # the first failing rank's traceback, for a cause lowcomm does not know
                print(exc.detail, file=sys.stderr, end="")
            print(f"quickstart: {label} failed: {exc}", file=sys.stderr)
            return 1
        except Interrupted as exc:  # a rerun resumes this run and skips the finished ones
            print(f"quickstart: {exc}", file=sys.stderr)
            return exc.exit_status
    training_s = time.perf_counter() - started

    eval_s = 0.0
    if args.eval_limit > 0:
        from lowcomm.cli.eval import main as eval_main

        # a run evaluated by an earlier quickstart keeps its result (rerunning changes nothing)
        pending = [run for run in runs if not RunDir(run.run_dir).eval_result(run.train.max_steps).is_file()]
        print(f"\n[quickstart] evaluating {len(pending)} final checkpoints, {args.eval_limit} documents per task"
              + (f" ({len(runs) - len(pending)} evaluated before)" if len(pending) < len(runs) else ""), flush=True)
        started = time.perf_counter()
        if pending and eval_main([*(str(run.run_dir) for run in pending), "--limit", str(args.eval_limit)]) != 0:
            print("quickstart: evaluation failed (see above)", file=sys.stderr)
            return 1
        eval_s = time.perf_counter() - started

    records = [load_run(run.run_dir) for run in runs]
    rows = summary_rows(records)
    # benchmark columns only when asked for (they would be chance here), each with its stderr and n
    columns = summary_columns(rows) if args.eval_limit > 0 else SUMMARY_COLUMNS
    table = markdown_table(rows, columns)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.md").write_text(table + "\n")
    write_csv(rows, out_dir / "summary.csv", columns)
    title = f"tiny OLMo, synthetic corpus, {runs[0].world_size} workers"
    figures = plot_loss_curves(records, out_dir, title=title, formats=("png",))
    figures += plot_loss_vs_mb(records, out_dir, title=title, formats=("png",))[0]
    trained = len(runs) - finished_before
    print(f"\n[quickstart] trained {trained} runs in {training_s:.0f} s"
          + (f" ({finished_before} had finished before)" if finished_before else "")
          + (f", evaluated them in {eval_s:.0f} s" if eval_s else "") + "\n")
    print(table)
    if eval_s:
        print(f"\nBenchmarks: zero-shot on the first {args.eval_limit} documents of each task (ARC-Easy on its "
              "validation split; the tiny model is expected near chance).")
    print()
    for name in ("summary.md", "summary.csv"):
        print(f"table:   {out_dir / name}")
    for path in figures:
        print(f"figure:  {path}")
    print(f"runs:    {Path(runs[0].run_root) / runs[0].experiment}/")
    if (reference / "summary.md").is_file() and out_dir.resolve() != reference.resolve():
        print(f"the committed reference to compare with: {reference / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
