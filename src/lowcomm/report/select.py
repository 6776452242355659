"""Choosing the runs a table or figure is built from: by glob, or by the sweep that made them.

A sweep names its runs exactly: each job's config is composed and validated as at launch, and
its deterministic run directory (``<run_root>/<experiment_name>/<run_name>``) is looked up, so a
job that has not run (or not started writing) is reported as missing rather than silently absent.
The data files are not looked at (a run's name does not depend on them): run directories copied
off a cluster build their tables and figures on a laptop that has none of the training data.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path

from lowcomm.config.sweep import load_sweep, plan_sweep
from lowcomm.report.runs import RunRecord, load_run
from lowcomm.rundir import RunDir


@dataclass
class Selection:
    runs: list[RunRecord]
    missing: list[str] = field(default_factory=list)  # what was asked for but holds no run, and why


def select_by_globs(patterns: list[str]) -> Selection:
    """Run directories (holding a ``config.yaml``) matching any of ``patterns``, sorted by path."""
    found: set[Path] = set()
    missing = []
    for pattern in patterns:
        matches = {Path(p) for p in glob.glob(pattern) if RunDir(Path(p)).is_run()}
        if not matches:
            missing.append(f"{pattern} (matches no run directory)")
        found |= matches
    return Selection([load_run(path) for path in sorted(found)], missing)


def sweep_run_dirs(sweep: str, overrides: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """The run directory of every job of ``sweeps/<sweep>.yaml`` (or a sweep file's path), in the
    sweep's order, with ``overrides`` added to every job (e.g. ``run_root=/scratch/runs``).

    Raises :class:`lowcomm.config.ConfigError` when a job's config is invalid; its data files
    need not exist here."""
    # plan_sweep keeps one job per run directory (two jobs with the same config share one)
    return [planned.run.run_dir for planned in plan_sweep(load_sweep(sweep), overrides, check_data_files=False)]


def select_by_sweep(sweep: str, overrides: list[str] | tuple[str, ...] = ()) -> Selection:
    """The runs of a sweep that exist; the others listed as missing."""
    runs, missing = [], []
    for run_dir in sweep_run_dirs(sweep, overrides):
        if RunDir(run_dir).is_run():
            runs.append(load_run(run_dir))
        else:
            missing.append(f"{run_dir} (not run yet)")
    return Selection(runs, missing)
