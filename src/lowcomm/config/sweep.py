"""Sweeps as files: ``sweeps/<name>.yaml`` lists only what varies.

    description: what the sweep reproduces
    base: [experiment=paper_table1, model=olmo_1b]  # overrides for every job
    methods: quickstart                             # optional: every registered method's runs of this
                                                    # name (Strategy.quickstart, .table1_tiny), first
    points:                                         # explicit jobs (optional; default: one empty point)
      - [optimizer=adamw_ddp]                       # a point: a list of overrides
      - overrides: [optimizer=demo, optimizer.compression_chunk=64]
        grid:                                       # a point with its own grid: one job per combination
          optimizer.compression_topk: [32, 16, 8]
    grid:                                           # cartesian product applied to every point (optional)
      seed: [0, 1]
    tune:                                           # optional: tune one key of each job first
      key: optimizer.lr
      factors: [0.5, 1, 2]                          # x the job's own value of the key
      overrides: [train.max_steps=200]              # the tuning runs' shorter budget
      widen: 2                                      # optional (default 2, 0: off): factors of 2 tried
                                                    # beyond an edge the best sits at
    seeds: [0, 1, 2]                                # optional: the final runs, one per seed
    label: "{name} lr={optimizer.lr}"               # optional: each job's label in tables and figures
                                                    # ({name}: the method's; default: the method's name
                                                    # and what sets the job apart, e.g. DeMo s=32 k=16)
    baseline: AdamW-DDP                             # optional: the label the seed table compares with
                                                    # (default: the sweep's one AdamW-DDP job)
    lr_tuned_for: [olmo_1b]                         # optional: the models the jobs' learning rates
                                                    # were tuned for elsewhere (a verdict needs tuned
                                                    # ones: this, a tune: block on optimizer.lr, or
                                                    # lowcomm-sweep run --laptop)

With ``tune``, each job is first run at every factor of its value on the shorter budget. Where
its best value (lowest final validation loss; a diverged run, nan or inf, is never chosen) is
the smallest or the largest tried, the grid widens on that side one factor of 2 at a time
(smallest / 2, then / 4; largest x 2, then x 4) until the best is inside, at most ``widen``
values per side; a best still at the edge then is reported. The job then runs at its best
value once per seed (``seeds``, default [0]) on the full budget (:func:`tuning_jobs`,
:func:`tuning_step`, :func:`final_jobs`; ``lowcomm-sweep run``).

A point may set its own ``label='...'`` override. Two jobs that train different things under one
label are refused when the file is loaded.

Jobs = for each point, its overrides x its own grid x the sweep's grid, each a list of Hydra
overrides (base first), in file order with the last grid key varying fastest. A grid value that
is a list becomes a list override (``optimizer.betas: [[0.9, 0.95], [0.9, 0.99]]``).

:func:`plan_sweep` composes and validates every job (all problems reported at once, before
anything runs); what a planned run will cost (GPU-hours, checkpoint time) is estimated in
:mod:`lowcomm.launch.estimate`. Running a sweep: ``lowcomm-sweep`` (:mod:`lowcomm.cli.sweep`)
on SLURM, ``make quickstart`` on this machine.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import OmegaConf

from lowcomm.config.compose import compose
from lowcomm.config.data_checks import data_problems
from lowcomm.config.labels import distinct_labels, template_label
from lowcomm.config.naming import changed_keys, what_is_trained
from lowcomm.config.schema import ConfigError, RunConfig
from lowcomm.config.suggest import did_you_mean
from lowcomm.config.validation import validate
from lowcomm.data.memmap import DataError
from lowcomm.paths import config_dir, group_options, repo_root
from lowcomm.strategies import METHOD_SWEEPS, STRATEGIES

SWEEP_KEYS = ("description", "base", "methods", "points", "grid", "tune", "seeds", "label", "baseline", "lr_tuned_for")
TUNE_KEYS = ("key", "factors", "overrides", "widen")
POINT_KEYS = ("overrides", "grid")
WIDEN_FACTOR = 2.0  # each widening tries the edge value / 2 or x 2
DEFAULT_WIDEN = 2  # widenings per side at most, unless the sweep's tune.widen says otherwise


@dataclass(frozen=True)
class Tune:
    """Tune ``key`` of every job over ``factors`` x its value, with ``overrides`` (a shorter budget);
    up to ``widen`` more values per side, a factor of 2 apart, where the best sits at an edge."""

    key: str
    factors: tuple[float, ...]
    overrides: tuple[str, ...] = ()
    widen: int = DEFAULT_WIDEN


@dataclass
class Sweep:
    name: str
    description: str
    jobs: list[list[str]]  # each job's overrides, the base first
    base: list[str] = field(default_factory=list)  # the overrides every job starts with
    path: Path | None = None  # the sweep file
    tune: Tune | None = None
    seeds: list[int] | None = None  # the final runs' seeds (None: the jobs as they are)
    baseline: str | None = None  # the label the seed table compares with (None: inferred)
    # the models its jobs' learning rates were tuned for elsewhere, as the file declares: the
    # seed table's verdicts need tuned ones (report.seeds)
    lr_tuned_for: tuple[str, ...] = ()
    # what :func:`laptop_sweep` added after each job's own overrides (then the method's lr) to run
    # it small here: not what a job varies
    laptop: tuple[str, ...] = ()

    def lr_tuned_models(self, laptop: bool = False) -> frozenset[str] | None:
        """The models a verdict on this sweep's runs may be given for: None (every model) where
        the sweep tunes ``optimizer.lr`` itself; else those it declares, and the tiny model
        under ``lowcomm-sweep run --laptop`` (the quickstart's learning rates, tuned for it)."""
        if self.tune is not None and self.tune.key == "optimizer.lr":
            return None
        return frozenset(self.lr_tuned_for) | ({"tiny"} if laptop else frozenset())


@dataclass(frozen=True)
class TuningJob:
    """One job of a two-phase sweep: ``point`` is its index in ``Sweep.jobs``."""

    point: int
    value: float  # of the tuned key
    seed: int | None
    overrides: list[str]


def tuned_value(sweep: Sweep, point: int) -> float:
    """The tuned key's value in job ``point`` as composed (its own override, else the config's)."""
    value = OmegaConf.select(compose(sweep.jobs[point]), sweep.tune.key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{sweep.name}: job {point + 1} has no number at {sweep.tune.key} to tune ({value!r})")
    return float(value)


def _rounded(value: float) -> float:
    """A tuned value as the runs are named: 6 significant digits (3e-3 x 0.5 is 0.0015, not
    0.0015000000000000001), so a rerun finds the same run directories."""
    return float(f"{value:.6g}")


def tuning_job(sweep: Sweep, point: int, value: float) -> TuningJob:
    """Job ``point`` at ``value`` of the tuned key, on the tuning budget, with the first seed."""
    seed = (sweep.seeds or [None])[0]
    return TuningJob(point, value, seed, [*sweep.jobs[point], *sweep.tune.overrides, _format(sweep.tune.key, value),
                                          *([] if seed is None else [f"seed={seed}"])])


def tuning_jobs(sweep: Sweep) -> list[TuningJob]:
    """Phase 1: every job at every factor of its tuned value, on the tuning budget, first seed."""
    jobs = []
    for point in range(len(sweep.jobs)):
        base_value = tuned_value(sweep, point)
        jobs += [tuning_job(sweep, point, _rounded(base_value * factor)) for factor in sweep.tune.factors]
    return jobs


class TuningDiverged(ValueError):
    """Every tuning run of a job diverged: there is no value to choose."""


def _finite(loss: float | None) -> bool:
    return loss is not None and math.isfinite(loss)


def best_value(losses: Mapping[float, float | None], job: str = "job") -> float:
    """The value with the lowest final validation loss, the smaller value on a tie. A diverged run
    (nan, inf or no loss) is never chosen, wherever it stands in ``losses``; raises
    :class:`TuningDiverged` naming ``job`` when every run diverged."""
    finite = {value: loss for value, loss in losses.items() if _finite(loss)}
    if not finite:
        tried = ", ".join(f"{value:.3g}: {loss}" for value, loss in sorted(losses.items()))
        raise TuningDiverged(f"{job}: every tuning run diverged ({tried or 'no runs'}): there is no value to "
                             "choose; try smaller values of the tuned key (tune.factors) or check the run")
    return min(sorted(finite), key=finite.__getitem__)


@dataclass(frozen=True)
class TuningStep:
    """One job's tuning so far (:func:`tuning_step`): the best value, and the value to try next
    (None: the choice is final)."""

    best: float
    next: float | None = None
    edge: str | None = None  # "lowest" / "highest": the best is that of the values tried; None: inside
    widened: int = 0  # values tried beyond the first grid on the edge's side

    @property
    def at_edge(self) -> bool:
        """The choice is final with the best still at an edge: the grid, widened as far as
        allowed, does not bracket the optimum."""
        return self.next is None and self.edge is not None

    def edge_note(self, key: str, widen: int) -> str:
        """What a final choice at an edge means, for the output and the summary (``key``'s last
        part names the value: ``lr=0.00075``); "" when the best is inside."""
        if not self.at_edge:
            return ""
        name = key.rsplit(".", 1)[-1]
        where = "below" if self.edge == "lowest" else "above"
        if widen == 0:
            how = "at the edge of the grid, not widened (tune.widen: 0)"
        else:
            how = f"still at the edge after {self.widened} widening{'s' if self.widened != 1 else ''}"
        return f"{how}: {name}={self.best:.3g}, the {self.edge} tried; the optimum may lie {where}"


def tuning_step(losses: Mapping[float, float | None], grid: Sequence[float], widen: int = DEFAULT_WIDEN,
                job: str = "job") -> TuningStep:
    """What one job's tuning does next, given the final validation loss at every ``value`` tried
    so far (``losses``), its first-round values (``grid``) and the widenings allowed per side.

    The best value (:func:`best_value`: a diverged run is never chosen) inside the values tried
    is final. At the smallest (largest) tried, the next value is one factor of 2 beyond it, until
    ``widen`` values beyond the grid were tried on that side; then the choice is final and
    :attr:`TuningStep.at_edge`. A diverged run beyond the best bounds that side: the grid never
    widens past it, so never toward a diverged side. Raises :class:`TuningDiverged` when every
    run diverged.
    """
    best = best_value(losses, job)
    values = sorted(losses)
    if best == values[0]:
        edge, step, widened = "lowest", 1 / WIDEN_FACTOR, sum(value < min(grid) for value in values)
    elif best == values[-1]:
        edge, step, widened = "highest", WIDEN_FACTOR, sum(value > max(grid) for value in values)
    else:
        return TuningStep(best)
    return TuningStep(best, _rounded(best * step) if widened < widen else None, edge, widened)


def final_jobs(sweep: Sweep, chosen: Mapping[int, float] | None = None) -> list[TuningJob]:
    """Phase 2: every job at its ``chosen`` value of the tuned key (if tuned), once per seed."""
    jobs = []
    for point, job in enumerate(sweep.jobs):
        value = None if chosen is None else chosen[point]
        tuned = [] if value is None else [_format(sweep.tune.key, value)]
        for seed in sweep.seeds or [None]:
            jobs.append(TuningJob(point, value if value is not None else math.nan, seed,
                                  [*job, *tuned, *([] if seed is None else [f"seed={seed}"])]))
    return jobs


def _tune(spec: Any, where: str) -> Tune | None:
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or set(spec) - set(TUNE_KEYS) or "key" not in spec:
        raise ValueError(f"{where}: tune is a mapping with key (required), factors, overrides and widen, "
                         f"got {spec!r}")
    factors = spec.get("factors")
    if (not isinstance(factors, list) or len(factors) < 2
            or not all(isinstance(f, int | float) and not isinstance(f, bool) and f > 0 for f in factors)):
        raise ValueError(f"{where}.factors: give at least two positive numbers, got {factors!r}")
    widen = spec.get("widen", DEFAULT_WIDEN)
    if not isinstance(widen, int) or isinstance(widen, bool) or widen < 0:
        raise ValueError(f"{where}.widen: give how many factors of 2 to try at most beyond an edge the best sits "
                         f"at, a whole number, 0 for none, got {widen!r}")
    return Tune(str(spec["key"]), tuple(float(f) for f in factors),
                tuple(_overrides(spec.get("overrides") or [], f"{where}.overrides")), widen)


def _lr_tuned_for(spec: Any, where: str) -> tuple[str, ...]:
    if spec is None:
        return ()
    models = group_options()["model"]
    if (not isinstance(spec, list) or not spec or not all(isinstance(m, str) for m in spec)
            or set(spec) - set(models)):
        raise ValueError(f"{where}: the models (configs/model/) this sweep's learning rates were tuned for, as a list "
                         f"such as [tiny]; choose from {', '.join(models)}; got {spec!r}")
    return tuple(spec)


def _seeds(spec: Any, where: str) -> list[int] | None:
    if spec is None:
        return None
    if not isinstance(spec, list) or not spec or not all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
        raise ValueError(f"{where}: give a non-empty list of integer seeds, got {spec!r}")
    return list(spec)


def sweep_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = repo_root() / "sweeps" / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    available = sorted(p.stem for p in (repo_root() / "sweeps").glob("*.yaml"))
    hint = did_you_mean(name_or_path, available) or did_you_mean(name_or_path.replace("-", "_"), available)
    raise FileNotFoundError(f"no sweep {name_or_path!r}{hint}; available: {', '.join(available)}")


def _value(value: Any) -> str:
    """A YAML value written in Hydra's override grammar."""
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(_value, value)) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _format(key: str, value: Any) -> str:
    return f"{key}={_value(value)}"


def _grid_combinations(grid: Any, where: str) -> list[list[str]]:
    """Every combination of a grid mapping (key -> list of values) as lists of overrides."""
    if grid is None:
        return [[]]
    if not isinstance(grid, Mapping):
        raise ValueError(f"{where}: a grid maps override keys to lists of values, got {grid!r}")
    axes = []
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}.{key}: give a non-empty list of values, got {values!r}")
        axes.append([_format(key, value) for value in values])
    return [list(combination) for combination in itertools.product(*axes)]


def _overrides(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{where}: give a list of Hydra overrides (key=value), got {value!r}")
    return list(value)


def _point_jobs(point: Any, where: str) -> list[list[str]]:
    if isinstance(point, Mapping):
        unknown = set(point) - set(POINT_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {', '.join(POINT_KEYS)}")
        overrides = _overrides(point.get("overrides") or [], f"{where}.overrides")
        return [overrides + combination for combination in _grid_combinations(point.get("grid"), f"{where}.grid")]
    return [_overrides(point, where)]


def method_points(methods: Any, where: str) -> list[list[str]]:
    """Every registered method's runs for a sweep (``methods: quickstart``: each strategy's
    ``quickstart`` points), in the registry's order, as lists of overrides."""
    if methods is None:
        return []
    if methods not in METHOD_SWEEPS:
        raise ValueError(f"{where}: {methods!r} is not a sweep the methods declare; choose one of: "
                         f"{', '.join(METHOD_SWEEPS)}")
    return [[f"optimizer={name}", *point.overrides, f"label='{point.label}'"]
            for name, strategy in STRATEGIES.items() for point in getattr(strategy, methods)]


def load_sweep(name_or_path: str, *, labelled: bool = True) -> Sweep:
    """The sweep file's jobs, each with its label (:func:`_labelled`; ``labelled=False`` skips
    composing every job for it, for a listing)."""
    path = sweep_path(name_or_path)
    spec = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a sweep file is a mapping with keys {', '.join(SWEEP_KEYS)}")
    unknown = set(spec) - set(SWEEP_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: {', '.join(SWEEP_KEYS)}")
    base = _overrides(spec.get("base") or [], f"{path}: base")
    points = spec.get("points") or ([] if spec.get("methods") else [[]])
    if not isinstance(points, list):
        raise ValueError(f"{path}: points must be a list, got {points!r}")
    points = method_points(spec.get("methods"), f"{path}: methods") + points
    shared = _grid_combinations(spec.get("grid"), f"{path}: grid")
    jobs = [
        base + point_job + combination
        for index, point in enumerate(points)
        for point_job in _point_jobs(point, f"{path}: points[{index}]")
        for combination in shared
    ]
    template = spec.get("label")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: label is a template such as \"{{name}} lr={{optimizer.lr}}\", got {template!r}")
    baseline = spec.get("baseline")
    if baseline is not None and not isinstance(baseline, str):
        raise ValueError(f"{path}: baseline is the label of the job to compare with, got {baseline!r}")
    return Sweep(name=path.stem, description=str(spec.get("description", "")).strip(),
                 jobs=_labelled(jobs, template, f"{path}") if labelled else jobs, base=base, path=path,
                 tune=_tune(spec.get("tune"), f"{path}: tune"), seeds=_seeds(spec.get("seeds"), f"{path}: seeds"),
                 baseline=baseline, lr_tuned_for=_lr_tuned_for(spec.get("lr_tuned_for"), f"{path}: lr_tuned_for"))


# lowcomm-sweep run --laptop: every job on the tiny model and the synthetic corpus at the
# quickstart's budget (configs/experiment/quickstart.yaml), on local workers; data of one's own
# goes on the command line (data=memmap data.paths=[...]), which comes after these.
LAPTOP = ("experiment=quickstart", "model=tiny", "data=synthetic", "cluster=local")


def laptop_overrides() -> list[str]:
    """:data:`LAPTOP` and the quickstart experiment's ``train`` values as values: Hydra applies
    a job's value overrides (a 1B sweep's ``train.max_steps=5612``) after every group selection,
    so the experiment alone would not set the budget."""
    experiment = OmegaConf.load(config_dir() / "experiment" / "quickstart.yaml")
    return [*LAPTOP, *(f"train.{key}={value}" for key, value in experiment.train.items())]


def quickstart_lr(job: Sequence[str]) -> str:
    """The ``optimizer.lr=`` override of the job's method in the quickstart (each strategy's
    ``quickstart`` points), picked for the tiny model at the quickstart's budget."""
    names = [o.split("=", 1)[1] for o in job if o.startswith("optimizer=")]
    name = names[-1] if names else str(compose(list(job)).optimizer.name)
    points = STRATEGIES[name].quickstart
    return next(o for point in points for o in point.overrides if o.startswith("optimizer.lr="))


def laptop_sweep(sweep: Sweep) -> Sweep:
    """``sweep`` run small on this machine: each job as it is, then :data:`LAPTOP` and its
    method's quickstart learning rate (:func:`quickstart_lr`), so that a verdict may be given
    for the tiny model (:meth:`Sweep.lr_tuned_models`)."""
    laptop = laptop_overrides()
    jobs = [[*job, *laptop, quickstart_lr(job)] for job in sweep.jobs]
    return dataclasses.replace(sweep, jobs=jobs, laptop=tuple(laptop))


def _own(job: Sequence[str], base: Sequence[str], laptop: Sequence[str]) -> list[str]:
    """What ``job`` sets beyond the sweep's ``base``, less what :func:`laptop_sweep` appended
    (``laptop`` where it stands in the job, and the learning rate after it)."""
    own = list(job[len(base):])
    for at in range(len(own) - len(laptop)) if laptop else ():
        if own[at:at + len(laptop)] == list(laptop):
            return own[:at] + own[at + len(laptop) + 1:]
    return own


# Keys a sweep's label never shows: its runs over seeds are one row of a table.
LABEL_IGNORES = ("seed",)


def _job_label(job: Sequence[str]) -> str | None:
    """The label a job's own overrides give it (``label='...'``), if any."""
    for override in reversed(job):
        if override.startswith("label="):
            return override.split("=", 1)[1].strip("'\"")
    return None


def select_jobs(sweep: Sweep, labels: Sequence[str], keep: str | None = None) -> Sweep:
    """The sweep with only the jobs ``labels`` name (comma lists allowed), plus the job labelled
    ``keep`` (the baseline a seed table compares with: its verdicts need it). Raises ValueError
    naming every label that names no job, with the sweep's labels."""
    by_label = {_job_label(job): job for job in sweep.jobs}
    wanted = list(dict.fromkeys(part.strip() for value in labels for part in value.split(",") if part.strip()))
    unknown = [label for label in wanted if label not in by_label]
    if unknown or not wanted:
        named = "; ".join(f"{label!r} labels no job{did_you_mean(label, [str(k) for k in by_label])}"
                          for label in unknown) or "no label given"
        raise ValueError(f"--only: {named}; the jobs of {sweep.name}: {', '.join(repr(k) for k in by_label)}")
    chosen = set(wanted) | ({keep} if keep is not None else set())
    return dataclasses.replace(sweep, jobs=[job for job in sweep.jobs if _job_label(job) in chosen])


def _composed(job: Sequence[str]) -> dict | None:
    """The job's config as a plain mapping; None where it does not compose (plan_sweep names why)."""
    try:
        config = compose(job)
    except ConfigError:
        return None
    try:
        return OmegaConf.to_container(config, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve here (an unset variable)
        return OmegaConf.to_container(config, resolve=False)


def _labelled(jobs: list[list[str]], template: str | None, where: str) -> list[list[str]]:
    """Each job with its label as an override (``label='DeMo s=32 k=16'``): its own ``label=``,
    else the sweep's ``label`` template filled from its config, else the method's name extended
    by what sets it apart from the sweep's other jobs of that method (seeds aside: a job over
    seeds is one row). Raises ValueError where two jobs that train different things would
    share a label: their rows and curves could not be told apart."""
    labels: list[str | None] = [_job_label(job) for job in jobs]
    configs = [None if label is not None else _composed(job) for job, label in zip(jobs, labels, strict=True)]
    if template is not None:
        for i, config in enumerate(configs):
            if config is not None:
                try:
                    labels[i] = template_label(template, config)
                except KeyError as exc:
                    raise ValueError(f"{where}: label {template!r}: job {i + 1} has no key {exc.args[0]!r} "
                                     "(use {name} or a dotted config key such as {optimizer.lr})") from None
    auto = [i for i, config in enumerate(configs) if labels[i] is None and config is not None]
    for i, label in zip(auto, distinct_labels([configs[i] for i in auto], ignore=LABEL_IGNORES, max_details=None),
                        strict=True):
        labels[i] = label
    _check_unique(jobs, labels, where)
    return [job if label is None or _job_label(job) == label else [*job, f"label={_quoted(label)}"]
            for job, label in zip(jobs, labels, strict=True)]


def _quoted(label: str) -> str:
    """A label as a Hydra override value: quoted, its own quotes escaped."""
    return "'" + label.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _check_unique(jobs: list[list[str]], labels: list[str | None], where: str) -> None:
    by_label: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        if label is not None:
            by_label.setdefault(label, []).append(i)
    clashes = []
    for label, members in by_label.items():
        if len(members) < 2:
            continue
        trains = {tuple(o for o in jobs[i] if not o.startswith(("label=", "seed="))) for i in members}
        if len(trains) > 1:  # the same label on jobs that differ in more than the seed
            clashes.append(f"jobs {', '.join(str(i + 1) for i in members)} are all labelled {label!r}")
    if clashes:
        raise ValueError(f"{where}: {'; '.join(clashes)}: give each its own label (label='...' in its point, or a "
                         "label template such as \"{name} lr={optimizer.lr}\" in the sweep file)")


@dataclass
class PlannedRun:
    """One job of a sweep, validated."""

    number: int  # 1-based position in the sweep file
    varying: list[str]  # what this job sets beyond the sweep's base (its point and grid values)
    overrides: list[str]  # everything it was composed from: base, point, grid, the command line's
    run: RunConfig


def plan_sweep(sweep: Sweep, extra_overrides: Sequence[str] = (), *, check_data_files: bool = True,
               require_data: bool = True) -> list[PlannedRun]:
    """Compose and validate every job of ``sweep`` with ``extra_overrides`` appended (the data's
    files and paths as :func:`~lowcomm.config.validation.validate` says).

    Raises :class:`ConfigError` listing the problems of every invalid job (each message prefixed
    by the job's number and overrides), so nothing is started unless all jobs are valid. Jobs
    that resolve to the same run directory are kept once (the first); jobs that would share one run
    directory but train different things (one explicit run_name for all) are an error.
    """
    planned: list[PlannedRun] = []
    errors: list[tuple[int, list[str], str]] = []
    seen: dict[Path, tuple[int, dict]] = {}  # run directory -> the first job in it, what it trains
    for number, job in enumerate(sweep.jobs, start=1):
        # what it trains differently (not what --laptop added to every job)
        varying = [o for o in _own(job, sweep.base, sweep.laptop) if not o.startswith("label=")]
        overrides = [*job, *extra_overrides]
        try:
            run = validate(compose(overrides), check_data_files=check_data_files, require_data=require_data)
        except ConfigError as exc:
            errors += [(number, varying, error) for error in exc.errors]
            continue
        except HydraException as exc:  # an unknown group option or key, a malformed override
            errors.append((number, varying, str(exc).splitlines()[0]))
            continue
        trains = what_is_trained(run.raw)
        if run.run_dir not in seen:
            seen[run.run_dir] = (number, trains)
            planned.append(PlannedRun(number=number, varying=varying, overrides=overrides, run=run))
        elif changes := changed_keys(seen[run.run_dir][1], trains):  # one run_name set for every job
            errors.append((number, varying, f"would train in job {seen[run.run_dir][0]}'s run directory "
                                            f"{run.run_dir} (run_name={run.run_name}) although it changes "
                                            f"{'; '.join(changes)}: give each job its own run_name, or none"))
    if check_data_files and not errors:
        errors += _data_errors(planned)
    if errors:
        raise ConfigError(job_errors(errors, len(sweep.jobs)))
    return planned


def _data_errors(planned: Sequence[PlannedRun]) -> list[tuple[int, list[str], str]]:
    """Each job's data against its model, whole (:func:`data_problems`), once per distinct data,
    sequence length and model: a sweep's jobs mostly share one corpus, scanned once."""
    errors, checked = [], {}
    for plan in planned:
        run = plan.run
        key = (repr(run.raw.get("data")), run.train.seq_len, repr(run.raw.get("model")), str(run.run_root))
        if key not in checked:
            try:
                checked[key] = data_problems(run)
            except DataError as exc:  # a corpus that cannot be generated or read
                checked[key] = [str(exc)]
        errors += [(plan.number, plan.varying, problem) for problem in checked[key]]
    return errors


def choose_baseline(sweep: Sweep, planned: Sequence[PlannedRun], named: str | None = None) -> str:
    """The label a sweep's seed table compares with: ``named`` (the command line's), else the
    sweep file's ``baseline``, else the label of its AdamW-DDP job when it has exactly one. Raises
    ValueError, listing the labels, where the named one is not a label or none can be inferred."""
    labels = list(dict.fromkeys(plan.run.label for plan in planned))
    named = named or sweep.baseline
    if named is not None:
        if named not in labels:
            raise ValueError(f"baseline {named!r} is not the label of a job of {sweep.name}"
                             f"{did_you_mean(named, labels)}; its labels: {', '.join(map(repr, labels))}")
        return named
    adamw = list(dict.fromkeys(plan.run.label for plan in planned if plan.run.optimizer_name == "adamw_ddp"))
    if len(adamw) == 1:
        return adamw[0]
    why = "no AdamW-DDP job" if not adamw else f"{len(adamw)} AdamW-DDP jobs ({', '.join(map(repr, adamw))})"
    raise ValueError(f"{sweep.name} has {why} to compare with: name the baseline (baseline: <label> in the sweep "
                     f"file, or --baseline LABEL); its labels: {', '.join(map(repr, labels))}")


def job_errors(errors: Sequence[tuple[int, list[str], str]], job_count: int) -> list[str]:
    """``(job number, its varying overrides, message)`` as messages naming the jobs, a message
    shared by several jobs once (a missing data path fails every job the same way)."""
    jobs_by_message: dict[str, list[tuple[int, list[str]]]] = {}
    for number, varying, message in errors:
        jobs = jobs_by_message.setdefault(message, [])
        if number not in [seen for seen, _ in jobs]:
            jobs.append((number, varying))
    grouped = []
    for message, jobs in jobs_by_message.items():
        if len(jobs) == 1:
            number, varying = jobs[0]
            where = f"job {number} ({' '.join(varying) or 'base only'})"
        elif len(jobs) == job_count:
            where = "every job"
        else:
            where = "jobs " + ", ".join(str(number) for number, _ in jobs)
        grouped.append(f"{where}: {message}")
    return grouped
