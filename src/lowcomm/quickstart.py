"""The main job (``make quickstart``): run ``sweeps/quickstart.yaml`` on this machine, then
print the comparison table and write it with the loss plots to ``results/quickstart/``.

    python -m lowcomm.quickstart [--sweep quickstart] [--out results/quickstart] [extra overrides...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lowcomm.config import ConfigError, repo_root, validate
from lowcomm.launch.local import WorkerFailure, launch_local
from lowcomm.launch.sweep import load_sweep
from lowcomm.report.figures import plot_loss_curves
from lowcomm.report.runs import load_run
from lowcomm.report.tables import markdown_table, summary_rows, write_csv
from lowcomm.train.cli import compose


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowcomm-quickstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="quickstart")
    parser.add_argument("--out", type=Path, default=None, help="default: results/<sweep>/")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every run")
    args = parser.parse_args(argv)
    sweep = load_sweep(args.sweep)
    out_dir = args.out or repo_root() / "results" / sweep.name

    # Validate every run before the first one starts.
    try:
        runs = [validate(compose(job + args.overrides)) for job in sweep.jobs]
    except ConfigError as exc:
        print(f"quickstart: {exc}", file=sys.stderr)
        return 2
    print(f"[quickstart] {len(runs)} runs of sweeps/{sweep.name}.yaml, {runs[0].world_size} workers each")
    started = time.perf_counter()
    for index, run in enumerate(runs, 1):
        label = run.raw.get("label") or run.optimizer_name
        print(f"\n[quickstart] ({index}/{len(runs)}) {label}: {run.run_dir}", flush=True)
        try:
            launch_local(run)
        except WorkerFailure as exc:
            print(f"quickstart: {label} failed: {exc}", file=sys.stderr)
            return 1
    training_s = time.perf_counter() - started

    records = [load_run(run.run_dir) for run in runs]
    rows = summary_rows(records)
    table = markdown_table(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.md").write_text(table + "\n")
    write_csv(rows, out_dir / "summary.csv")
    figures = plot_loss_curves(records, out_dir, title=f"tiny OLMo, synthetic corpus, {runs[0].world_size} workers",
                               formats=("png",))
    print(f"\n[quickstart] trained {len(runs)} runs in {training_s:.0f} s\n")
    print(table)
    print(f"\ntable:   {out_dir / 'summary.md'} (and summary.csv)")
    for path in figures:
        print(f"figure:  {path}")
    print(f"runs:    {Path(runs[0].run_root) / runs[0].experiment}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
