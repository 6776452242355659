"""Choosing the runs a table or figure is built from: by glob, or by the sweep that made them.

A sweep names its runs exactly: each job's config is composed and validated as at launch, and
its deterministic run directory (``<run_root>/<experiment_name>/<run_name>``) is looked up, so a
job that has not run (or not started writing) is reported as missing rather than silently absent.
The data files are not looked at: run directories copied off a cluster build their tables and
figures on a laptop that has none of the training data.

Where a job's run directory is not there (the sweep ran with command-line overrides that the
analysis does not repeat: the cluster's data paths, a laptop's shorter budget), the job's run is
found by its recorded config instead: the one run directory under the job's experiment whose
``config.yaml`` sets what the job sets beyond the sweep's base. A run found that way is named,
with how it differs from the job as composed here; a job that matches several is not guessed.
"""

from __future__ import annotations

import functools
import glob
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lowcomm.config.naming import changed_keys, what_is_trained
from lowcomm.config.sweep import PlannedRun, load_sweep, plan_sweep
from lowcomm.report.runs import RunRecord, load_run
from lowcomm.rundir import RunDir


@dataclass
class Selection:
    runs: list[RunRecord]
    missing: list[str] = field(default_factory=list)  # what was asked for but holds no run, and why
    # jobs whose run was found by its recorded config: (the job, its run, the keys they differ in)
    found_by_config: list[tuple[str, Path, list[str]]] = field(default_factory=list)

    def found_lines(self, verbose: bool = False) -> list[str]:
        """What was found by recorded config, in one line: how many jobs, and the keys their runs
        differ in from the jobs as composed here (once for all: mostly the overrides the sweep
        ran with); with ``verbose`` each job and its run below it."""
        if not self.found_by_config:
            return []
        keys = list(dict.fromkeys(key for _job, _path, differs in self.found_by_config for key in differs))
        shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        header = (f"note: {len(self.found_by_config)} jobs found by their runs' recorded configs, which differ from "
                  f"the jobs as composed here in {shown or 'nothing trained'} (the overrides they ran with; "
                  f"{'' if verbose else '--verbose lists them; '}--override the same to match them exactly)")
        return [header, *(f"  {job}: {path}" for job, path, _differs in self.found_by_config)] if verbose else [header]


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


def _planned(sweep: str, overrides: list[str] | tuple[str, ...]) -> list[PlannedRun]:
    # plan_sweep keeps one job per run directory (two jobs with the same config share one)
    return plan_sweep(load_sweep(sweep), overrides, check_data_files=False, require_data=False)


def sweep_run_dirs(sweep: str, overrides: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """The run directory of every job of ``sweeps/<sweep>.yaml`` (or a sweep file's path), in the
    sweep's order, with ``overrides`` added to every job (e.g. ``run_root=/scratch/runs``).

    Raises :class:`lowcomm.config.ConfigError` when a job's config is invalid; its data files
    need not exist here."""
    return [planned.run.run_dir for planned in _planned(sweep, overrides)]


_ABSENT = object()  # a key a config does not have: equal to nothing, None included


def _value(config: dict, dotted: str) -> object:
    node: object = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _sets(job: PlannedRun) -> dict[str, object]:
    """What ``job`` sets beyond the sweep's base, as resolved values of its composed config: a
    group choice (``optimizer=demo``) by the group's ``name``, a key (``optimizer.compression_topk=8``,
    ``seed=1``) by its value."""
    wanted = {}
    for override in job.varying:
        key = override.split("=", 1)[0].lstrip("+~")
        if "." not in key and isinstance(job.run.raw.get(key), dict):
            key = f"{key}.name"
        wanted[key] = _value(job.run.raw, key)
    return wanted


def _by_recorded_config(job: PlannedRun, taken: set[Path],
                        load: Callable[[Path], RunRecord]) -> tuple[RunRecord | None, str, list[str]]:
    """The one run under the job's experiment whose recorded config sets what the job sets (and
    not taken by another job), or None; what to say about the job; the keys they differ in.
    ``load`` reads a run directory (each at most once per selection)."""
    where = job.run.run_dir.parent
    wanted = _sets(job)
    candidates = sorted(path for path in where.iterdir() if path not in taken and RunDir(path).is_run()) \
        if where.is_dir() else []
    matches = [run for run in map(load, candidates)
               if all(_value(run.config, key) == value for key, value in wanted.items())]
    label = f"job {job.number} ({job.run.label}: {' '.join(job.varying) or 'the base'})"
    if not matches:
        return None, f"{job.run.run_dir} (not run yet; no run in {where} sets what {label} sets)", []
    if len(matches) > 1:
        names = ", ".join(run.path.name for run in matches)
        return None, (f"{job.run.run_dir} (not there; {len(matches)} runs in {where} set what {label} sets: "
                      f"{names}; pass the overrides the sweep ran with, --override KEY=VALUE, to name one)"), []
    differs = changed_keys(what_is_trained(job.run.raw), what_is_trained(matches[0].config))
    return matches[0], label, [line.split(":", 1)[0] for line in differs]


def select_by_sweep(sweep: str, overrides: list[str] | tuple[str, ...] = ()) -> Selection:
    """The runs of a sweep that exist, each at its run directory or else found by its recorded
    config (module doc); the others listed as missing."""
    planned = _planned(sweep, overrides)
    exact = {job.run.run_dir for job in planned if RunDir(job.run.run_dir).is_run()}
    load = functools.cache(load_run)  # several jobs look through the same experiment's runs
    selection = Selection([])
    for job in planned:
        if job.run.run_dir in exact:
            selection.runs.append(load(job.run.run_dir))
            continue
        run, said, differs = _by_recorded_config(job, exact | {run.path for run in selection.runs}, load)
        if run is None:
            selection.missing.append(said)
        else:
            selection.runs.append(run)
            selection.found_by_config.append((said, run.path, differs))
    return selection
