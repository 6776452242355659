"""Figures from run directories, each written as PNG and PDF:

- :func:`plot_loss_curves`: loss against steps and against cumulative MB sent (the DeMo paper's
  Figure 2), one line per run;
- :func:`plot_loss_vs_mb`: final validation loss (or perplexity) against MB/step on a log axis,
  one point per group of runs that differ only in their seed (the mean, a bar from the lowest
  seed to the highest), with the Pareto front over the groups drawn (the paper's Figure 4);
- :func:`plot_loss_vs_wallclock`: validation loss against estimated wall-clock time, one panel
  per network link (:mod:`lowcomm.report.wallclock`).

Every figure and table puts a run at the same bytes: its payload, all of it, per worker and step
(the paper's "Tx MB/step", 1 MB = 1e6 bytes), as the axis labels say. A run with two links
(FlexDeMo) also shows the part that crosses between nodes: a hollow marker linked to its filled
one, a note in the legend. Where every run shares the synthetic corpus's Bayes floor, validation
losses are drawn as the excess over it (log axis): the gaps that matter are not squeezed into
the top of an axis that starts at the floor.

A method has one colour and one marker shape in every figure (its strategy's ``display``). Its
groups (DiLoCo H=5 and H=10; the seeds of one are one group) are told apart by shades of that
colour and by how the marker is filled (full, left half, top half, ...), the same in every
figure built from the same runs.
"""

from __future__ import annotations

import colorsys
import math
import statistics
from pathlib import Path

import matplotlib
import matplotlib.colors as mcolors
import matplotlib.ticker as mticker
from matplotlib.markers import MarkerStyle

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lowcomm.report.pareto import loss_mb_points, pareto_front  # noqa: E402
from lowcomm.report.runs import RunRecord, distinct_labels  # noqa: E402
from lowcomm.report.seeds import seed_groups  # noqa: E402
from lowcomm.report.wallclock import Timeline  # noqa: E402
from lowcomm.strategies import STRATEGIES  # noqa: E402

# Each optimizer's marker and fixed colour (each strategy's ``display``), so that DeMo is the
# same colour in every figure of a paper.
FAMILY_MARKERS = {name: strategy.display.marker for name, strategy in STRATEGIES.items()}
FAMILY_COLORS = {name: strategy.display.color for name, strategy in STRATEGIES.items()}
FORMATS = ("png", "pdf")
MB = "1 MB = 1e6 bytes"
# A two-link run's legend entries (FlexDeMo): the curve or point at all of its bytes, and the
# hollow one at the part of them that crosses between nodes.
ALL_BYTES = ": all bytes (filled)"
INTER_NODE = ": inter-node part (hollow, dotted)"
TX_PER_STEP = f"Tx MB/step per worker (payload; {MB})"
CUMULATIVE_TX = f"cumulative Tx MB per worker (payload; {MB})"


# How the marker of a method's second, third, ... group is filled (its first: full).
VARIANT_FILLS = ("full", "left", "top", "right", "bottom")


def _family_groups(runs: list[RunRecord]) -> dict[str, list[list[RunRecord]]]:
    """Each family's groups of runs (:func:`seed_groups`), in the order first seen."""
    families: dict[str, list[list[RunRecord]]] = {}
    for group in seed_groups(runs):
        families.setdefault(group.runs[0].optimizer, []).append(group.runs)
    return families


def run_colors(runs: list[RunRecord]) -> dict[int, tuple[float, float, float]]:
    """One colour per run, the same in every figure: its family's colour, in shades from dark to
    light when a family has several groups (DeMo k=32 and k=4), in the order the groups are
    first seen; the seeds of a group share one."""
    colors: dict[int, tuple[float, float, float]] = {}
    for family, groups in _family_groups(runs).items():
        hue, lightness, saturation = colorsys.rgb_to_hls(*mcolors.to_rgb(FAMILY_COLORS.get(family, "0.4")))
        for index, group in enumerate(groups):
            shade = 0.0 if len(groups) == 1 else (index / (len(groups) - 1) - 0.5) * 0.35
            color = colorsys.hls_to_rgb(hue, min(max(lightness + shade, 0.15), 0.8), saturation)
            colors.update({id(run): color for run in group})
    return colors


def run_fills(runs: list[RunRecord]) -> dict[int, str]:
    """How each run's marker is filled (:data:`VARIANT_FILLS`): full for a family's first group,
    a half for each further one, so that groups of one method differ by more than a shade."""
    return {id(run): VARIANT_FILLS[index % len(VARIANT_FILLS)]
            for groups in _family_groups(runs).values() for index, group in enumerate(groups) for run in group}


def _legend_outside(ax) -> None:
    """The legend to the right of the axes, where it cannot hide a curve's end (none when
    nothing was drawn)."""
    if not ax.get_legend_handles_labels()[0]:
        return
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def _save(fig, out_dir: Path, stem: str, formats: tuple[str, ...]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        fig.savefig(path, dpi=150, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def shared_floor(runs: list[RunRecord]) -> float | None:
    """The Bayes floor every run shares (the same synthetic corpus and slice), else None."""
    floors = {run.bayes_floor for run in runs}
    return floors.pop() if len(floors) == 1 and None not in floors else None


def _loss_axis(ax, quantity: str, floor: float | None, values: list[float]) -> None:
    """The y axis of a loss, its label saying which it is: with ``floor``, the excess over it
    (``values`` already less the floor), on a log scale where all are above it; without, the
    loss itself ("absolute": no floor is known for it, or the runs do not share one)."""
    if floor is None:
        ax.set_ylabel(quantity if "perplexity" in quantity else f"{quantity} (absolute)")
        return
    ax.set_ylabel(f"{quantity} \u2212 Bayes floor ({floor:.3f})")
    if values and min(values) > 0:
        ax.set_yscale("log")
        _log_ticks(ax.yaxis, min(values), max(values))


def _log_ticks(axis, low: float, high: float) -> None:
    """Plain-number ticks on a log axis, enough of them to read every value: less than a decade
    between ``low`` and ``high`` gets evenly spaced ticks (a log locator would label one or two
    there, 1 and nothing above it), a wider range 1, 2 and 5 of each decade."""
    axis.set_major_formatter(mticker.FuncFormatter(lambda value, _position: f"{value:.4g}"))
    axis.set_minor_formatter(mticker.NullFormatter())
    if high < 10 * low:  # no minor ticks: their grid lines would fall between the even ticks
        axis.set_major_locator(mticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        axis.set_minor_locator(mticker.NullLocator())
    else:
        axis.set_major_locator(mticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_minor_locator(mticker.LogLocator(base=10, subs=tuple(range(1, 10))))


def _excess(floor: float | None, values: list[float]) -> list[float]:
    """``values`` less ``floor``; unchanged without one (callers pass None for perplexity)."""
    return values if floor is None else [value - floor for value in values]


def _floor(ax, runs: list[RunRecord], perplexity: bool = False) -> None:
    """The synthetic corpus's Bayes floor, when every run shares one (same corpus and slice).

    The axes frame the data: a floor far below the losses is named in the legend (with its
    value) and marked at the bottom edge rather than stretching the axis down to it."""
    floors = {run.bayes_floor for run in runs if run.bayes_floor is not None}
    if len(floors) != 1:
        return
    floor = floors.pop()
    value = math.exp(floor) if perplexity else floor
    bottom, top = ax.get_ylim()
    if value >= bottom - 0.15 * (top - bottom):
        ax.axhline(value, color="0.3", ls=":", lw=1, label=f"Bayes floor {value:.3f}")
        return
    ax.set_ylim(bottom, top)
    ax.plot([], [], color="0.3", ls=":", lw=1, label=f"Bayes floor {value:.3f} (below the axes)")
    ax.annotate(f"Bayes floor {value:.3f} \u2193", xy=(0.01, 0.01), xycoords="axes fraction", fontsize=7,
                color="0.3", va="bottom")


def _place_labels(ax, texts: list, markers: list[tuple[float, float, float]]) -> None:
    """Put each point label where it overlaps no other label and no marker and stays inside
    the axes: the first free spot of a fixed list, beside its point first (right, then left,
    above, then below), then further up and down. Deterministic (labels placed left to right);
    a label with no free spot takes the one it overlaps least. ``markers``: ``(x, y, radius in
    points)`` in data coordinates, every marker drawn."""
    if not texts:
        return
    from matplotlib.transforms import Bbox

    ax.figure.canvas.draw()  # the axes' final limits, which place the points on the canvas
    renderer = ax.figure.canvas.get_renderer()
    scale = ax.figure.dpi / 72.0  # pixels per point
    inside = ax.get_window_extent(renderer)
    obstacles = []
    for x, y, radius in markers:
        px, py = ax.transData.transform((x, y))
        obstacles.append(Bbox.from_extents(px - radius * scale, py - radius * scale, px + radius * scale,
                                           py + radius * scale))
    for text in sorted(texts, key=lambda text: tuple(ax.transData.transform(text.xy))):
        text.set(ha="left", va="bottom")
        text.xyann = (0, 0)
        size = text.get_window_extent(renderer)
        width, height = size.width / scale, size.height / scale
        costs = []  # (outside the axes, area overlapped): a free spot is (False, 0)
        for offset in _label_spots(width, height):
            text.xyann = offset
            box = text.get_window_extent(renderer)
            costs.append(((not _within(box, inside), sum(_overlap(box, other) for other in obstacles)), offset))
            if costs[-1][0] == (False, 0):
                break
        text.xyann = min(costs, key=lambda cost: cost[0])[1]
        obstacles.append(text.get_window_extent(renderer))


def _label_spots(width: float, height: float, gap: float = 5.0) -> list[tuple[float, float]]:
    """Offsets (points) of a label's lower-left corner from its point, nearest first."""
    spots = []
    for rise in range(12):
        for dx in (gap, -gap - width):
            spots += [(dx, 2.0 + rise * height * 0.75), (dx, -2.0 - height - rise * height * 0.75)]
    return spots


def _overlap(a, b) -> float:
    return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))


def _within(box, outer) -> bool:
    return box.x0 >= outer.x0 and box.x1 <= outer.x1 and box.y0 >= outer.y0 and box.y1 <= outer.y1


def _ema(values: list[float], smoothing: float) -> list[float]:
    """Exponential moving average with weight ``smoothing`` on the past (0: unchanged)."""
    smoothed, average = [], None
    for value in values:
        average = value if average is None else smoothing * average + (1 - smoothing) * value
        smoothed.append(average)
    return smoothed


def plot_loss_curves(runs: list[RunRecord], out_dir: Path, *, key: str = "train/loss",
                     formats: tuple[str, ...] = FORMATS, title: str = "", perplexity: bool = False,
                     smoothing: float = 0.0, log_mb: bool = True) -> list[Path]:
    """Two figures, one line per run: ``<prefix>loss_vs_step`` and ``<prefix>loss_vs_cum_MB``
    (cumulative payload MB per worker, log x unless ``log_mb`` is False). The prefix is empty for
    ``train/loss`` and ``val_`` for ``val/loss``. ``smoothing``: EMA weight in [0, 1) applied to
    the plotted values (noisy training losses)."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    prefix = "" if key == "train/loss" else key.replace("/loss", "").replace("/", "_") + "_"
    quantity = key.replace("/", " ").replace("loss", "perplexity" if perplexity else "loss")
    floor = shared_floor(runs) if key.startswith("val/") and not perplexity else None
    labels = distinct_labels(runs)
    colors, fills = run_colors(runs), run_fills(runs)
    written = []
    for stem, xlabel in (("loss_vs_step", "optimizer step"), ("loss_vs_cum_MB", CUMULATIVE_TX)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        plotted: list[float] = []
        for run, label in zip(runs, labels, strict=True):
            steps, values = run.series(key)
            if not steps:
                continue
            x = steps if stem == "loss_vs_step" else run.cumulative_mb_at(steps)
            y = _excess(floor, _ema(values, smoothing))
            if perplexity:
                y = [math.exp(v) for v in y]
            plotted += y
            split = stem == "loss_vs_cum_MB" and _splits(run)
            style = {"marker": FAMILY_MARKERS.get(run.optimizer, "."), "markevery": max(len(x) // 6, 1), "ms": 5,
                     "color": colors[id(run)], "fillstyle": fills[id(run)]}
            ax.plot(x, y, lw=1.4, label=f"{label}{ALL_BYTES if split else ''}", **style)
            changes = run.membership_changes()
            if changes:
                at = [step for step, _ in changes]
                mark_membership(ax, at if stem == "loss_vs_step" else run.cumulative_mb_at(at),
                                [event for _, event in changes], colors[id(run)])
            if split:
                _inter_node_curve(ax, run.cumulative_mb_at(steps, inter_node=True), x, y, label, style)
        _loss_axis(ax, quantity + (f" (EMA {smoothing:g})" if smoothing else ""), floor, plotted)
        if key.startswith("val/") and floor is None:
            _floor(ax, runs, perplexity)
        if stem == "loss_vs_cum_MB" and log_mb:
            # A step that sent nothing yet (DiLoCo before its first sync) sits at 0 and is masked.
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title or f"{quantity} vs {'optimizer step' if stem == 'loss_vs_step' else 'cumulative MB'}")
        ax.grid(alpha=0.3, which="both")
        _legend_outside(ax)
        written += _save(fig, out_dir, prefix + stem, formats)
    return written


MEMBERSHIP_MARKS = {"heal": "healed", "membership": "groups changed", "exchange_dropped": "exchange dropped"}


def mark_membership(ax, xs: list[float], events: list[str], color) -> None:
    """A run of replica groups' changes (a heal, a quorum that shrank or grew, a dropped
    exchange) as dotted verticals in the run's colour, each named at the foot of the axes."""
    for x, event in zip(xs, events, strict=True):
        ax.axvline(x, color=color, ls=":", lw=1.0, alpha=0.8)
        ax.annotate(MEMBERSHIP_MARKS[event], (x, 0.02), xycoords=("data", "axes fraction"), rotation=90,
                    fontsize=7, color=color, ha="right", va="bottom")


def _splits(run: RunRecord) -> bool:
    """Whether a run has two links with bytes on the inter-node one: drawn twice, at all of its
    bytes and at its inter-node part (the same rule as :func:`loss_mb_points`)."""
    return run.two_links and bool(run.inter_node_payload_mb_per_step)


def _inter_node_curve(ax, inter: list[float], total: list[float], y: list[float], label: str, style: dict) -> None:
    """A two-link run's curve again at its inter-node bytes: thin and dotted, hollow markers of
    its colour, its last point joined to the last point of the curve at all of its bytes (as the
    two points of :func:`plot_loss_vs_mb` are)."""
    keep = [i for i, mb in enumerate(inter) if mb > 0]  # a log axis: from the first inter-node send
    ax.plot([inter[i] for i in keep], [y[i] for i in keep], lw=0.9, ls=":", mfc="none", label=f"{label}{INTER_NODE}",
            **style)
    if keep:
        ax.plot([inter[-1], total[-1]], [y[-1]] * 2, lw=0.6, ls=":", color=style["color"])


def _scatter(ax, x: list[float], y: list[float], marker: str, fill: str, color, size: float, **kwargs) -> None:
    """Markers of one group; a half-filled one (a method's further groups) with its outline."""
    if fill == "full":
        ax.scatter(x, y, s=size, zorder=3, marker=marker, color=[color] * len(x), **kwargs)
        return
    ax.scatter(x, y, s=size, zorder=3, marker=marker, facecolors="none", edgecolors=[color] * len(x), lw=1.0)
    ax.scatter(x, y, s=size, zorder=3, marker=MarkerStyle(marker, fillstyle=fill), color=[color] * len(x), **kwargs)


def _seeds_note(group: dict) -> str:
    """`` (3 seeds)``; `` (2 of 3 seeds)`` where one diverged or has no numbers (see the
    figure's skipped runs); nothing for one seed of one."""
    if group["seeds"] < group["of"]:
        return f" ({group['seeds']} of {group['of']} seeds)"
    return f" ({group['seeds']} seeds)" if group["seeds"] > 1 else ""


def plot_loss_vs_mb(runs: list[RunRecord], out_dir: Path, *, stem: str = "loss_vs_mb", mb: str = "payload",
                    perplexity: bool = False, annotate: bool = True, formats: tuple[str, ...] = FORMATS,
                    title: str = "") -> tuple[list[Path], list[tuple[RunRecord, str]]]:
    """Final validation loss (``perplexity``: its exponential; else the excess over a shared
    Bayes floor) against MB/step, log x: one point per group of runs that differ only in their
    seed, at the mean over its seeds with a bar from the lowest to the highest, and the Pareto
    front over the groups as a staircase (lower left is better; a front of one group is its
    ring alone). A two-link run's inter-node bytes are a hollow marker linked to it by a dotted
    line; point labels are placed where none overlaps another label or a marker
    (:func:`_place_labels`).

    Returns the files written and the runs left out with the reason (no numbers yet, diverged,
    nothing sent)."""
    points, skipped = loss_mb_points(runs, mb=mb, perplexity=perplexity)
    floor = None if perplexity else shared_floor([point.run for point in points])
    colors, fills = run_colors(runs), run_fills(runs)
    by_run = {id(point.run): point for point in points}
    # groups of every run asked for: a seed that diverged or has no numbers is counted against
    # its group (named, off the front), not silently dropped from its mean
    seeded_groups = [group for group in seed_groups(runs) if any(id(run) in by_run for run in group.runs)]
    # a group's label: its runs' (a sweep labels its seeds alike), told apart from another
    # group's by what they differ in other than the seed
    labels = dict(zip((id(group.runs[0]) for group in seeded_groups),
                      distinct_labels([group.runs[0] for group in seeded_groups], ignore=("seed",)), strict=True))
    # one point per group: (its runs' points, mean x, mean y, lowest y, highest y)
    groups = []
    for group in seeded_groups:
        members = [by_run[id(run)] for run in group.runs if id(run) in by_run]
        ys = [point.loss - (floor or 0.0) for point in members]
        inter = [point.inter_node_mb for point in members if point.inter_node_mb is not None]
        groups.append({"first": members[0], "label": labels[id(group.runs[0])], "seeds": len(members),
                       "of": len(group.runs),
                       "x": statistics.fmean(p.mb_per_step for p in members),
                       "y": statistics.fmean(ys), "low": min(ys), "high": max(ys),
                       "inter": statistics.fmean(inter) if inter else None})
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for group in groups:
        run = group["first"].run
        family, color, fill = run.optimizer, colors[id(run)], fills[id(run)]
        marker = FAMILY_MARKERS.get(family, ".")
        # each group by its label, which carries the method's defining constants (MuLoCo 2-bit
        # H=10), also where it is its method's only group
        legend = group["label"]
        split = group["inter"] is not None
        _scatter(ax, [group["x"]], [group["y"]], marker, fill, color, 60, label=legend + (ALL_BYTES if split else ""))
        if group["seeds"] > 1:
            ax.errorbar([group["x"]], [group["y"]], yerr=[[group["y"] - group["low"]], [group["high"] - group["y"]]],
                        fmt="none", ecolor=color, elinewidth=1.0, capsize=2.5, zorder=2)
        if split:
            ax.plot([group["inter"], group["x"]], [group["y"]] * 2, color=color, lw=0.8, ls=":", zorder=2)
            ax.scatter([group["inter"]], [group["y"]], s=60, zorder=3, marker=marker, facecolors="none",
                       edgecolors=[color], label=legend + INTER_NODE)
    whole = [g for g in groups if g["seeds"] == g["of"]]  # a group missing a seed is not on the front
    front = [whole[i] for i in pareto_front([(g["x"], g["y"]) for g in whole])]
    if front:
        if len(front) > 1:
            # Between two front groups the best loss reachable for the bytes is the cheaper one's:
            # a step drawn after each point.
            ax.step([g["x"] for g in front], [g["y"] for g in front], where="post", color="0.25",
                    ls="--", lw=1, zorder=2, label="Pareto front (all bytes)")
        ax.scatter([g["x"] for g in front], [g["y"] for g in front], s=150, facecolors="none",
                   edgecolors="0.25", lw=1, zorder=2, label=None if len(front) > 1 else "the Pareto front (one point)")
    quantity = "final validation perplexity" if perplexity else "final validation loss"
    seeded = any(group["seeds"] > 1 for group in groups)
    _loss_axis(ax, quantity + (" (mean over seeds; bar: min to max)" if seeded else ""), floor,
               [value for group in groups for value in (group["low"], group["high"])])
    if floor is None:
        _floor(ax, [point.run for point in points], perplexity)
    ax.set_xscale("log")
    ax.set_xlabel(TX_PER_STEP if mb == "payload" else f"MB sent per worker per step, ring algorithm ({MB})")
    ax.set_title(title or f"{quantity} vs communication")
    ax.grid(alpha=0.3, which="both")
    if points:
        _legend_outside(ax)
    if annotate:
        texts = [ax.annotate(g["label"] + _seeds_note(g),
                             (g["x"], g["y"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
                 for g in groups]
        # every marker's radius in points (scatter's s is its area in points squared), the
        # front's rings the widest
        on_front = {id(g["first"]) for g in front}
        markers = [(g["x"], g["y"], 0.5 * math.sqrt(150 if id(g["first"]) in on_front else 60)) for g in groups]
        markers += [(g["inter"], g["y"], 0.5 * math.sqrt(60)) for g in groups if g["inter"] is not None]
        _place_labels(ax, texts, markers)
    return _save(fig, out_dir, stem, formats), skipped


def plot_loss_vs_wallclock(panels: list[tuple[str, list[Timeline]]], labels: list[str], out_dir: Path, *,
                           target: float | None = None, stem: str = "loss_vs_wallclock",
                           formats: tuple[str, ...] = FORMATS, title: str = "") -> list[Path]:
    """Validation loss against estimated wall-clock time, one panel per link (``panels``:
    ``(title, timelines)``, each timeline list in the order of ``labels``); log time axis, the
    Bayes floor and the target (floor + ``target``) marked."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 1.8, 4.0), sharey=True, squeeze=False)
    runs = [item.run for item in panels[0][1]] if panels else []
    colors = run_colors(runs)
    floor = shared_floor(runs)
    plotted: list[float] = []
    for ax, (panel, timelines) in zip(axes[0], panels, strict=True):
        for item, label in zip(timelines, labels, strict=True):
            points = item.val_points()
            if not points:
                continue
            values = _excess(floor, [v for _s, _t, v in points])
            plotted += values
            ax.plot([t for _s, t, _v in points], values, label=label, lw=1.4, ms=4,
                    marker=FAMILY_MARKERS.get(item.run.optimizer, "."), color=colors[id(item.run)])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(mticker.NullFormatter())  # decades only: minor labels collide
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("estimated wall-clock time (s)")
        ax.grid(alpha=0.3, which="both")
        if target is not None and floor is not None:
            ax.axhline(target, color="0.5", ls="--", lw=0.8, label=f"target: floor + {target:.3f}")
    _loss_axis(axes[0][0], "validation loss", floor, plotted)
    if floor is None:
        for ax in axes[0]:
            _floor(ax, runs)
    _legend_outside(axes[0][-1])
    if title:
        fig.suptitle(title)
    return _save(fig, out_dir, stem, formats)


def plot_seed_bands(groups: list[tuple[str, list[RunRecord]]], out_dir: Path, *, stem: str = "loss_vs_cum_MB_seeds",
                    title: str = "", formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Validation loss against cumulative MB sent per worker, one line per group of runs that
    differ only in their seed: the mean over seeds, and the band from the lowest to the highest
    seed. Log x; a group that sent nothing before a validation is drawn from its first send."""
    firsts = [runs[0] for _label, runs in groups]
    every = [run for _label, runs in groups for run in runs]
    colors, fills = run_colors(every), run_fills(every)  # as every other figure of these runs
    floor = shared_floor([run for _label, runs in groups for run in runs])
    plotted: list[float] = []
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for (label, runs), first in zip(groups, firsts, strict=True):
        series = [run.series("val/loss") for run in runs]
        steps = sorted(set.intersection(*(set(s) for s, _ in series)))
        if not steps:
            continue
        values = [_excess(floor, [dict(zip(s, v, strict=True))[step] for s, v in series]) for step in steps]
        x = first.cumulative_mb_at(steps)
        keep = [i for i, mb in enumerate(x) if mb > 0]
        x = [x[i] for i in keep]
        low, mean, high = ([min(values[i]) for i in keep], [sum(values[i]) / len(values[i]) for i in keep],
                           [max(values[i]) for i in keep])
        color = colors[id(first)]
        plotted += low
        label = f"{label} ({len(runs)} seed{'s' if len(runs) != 1 else ''})"
        style = {"marker": FAMILY_MARKERS.get(first.optimizer, "."), "ms": 4, "color": color,
                 "fillstyle": fills[id(first)]}
        ax.plot(x, mean, lw=1.4, label=label + (ALL_BYTES if _splits(first) else ""), **style)
        ax.fill_between(x, low, high, color=color, alpha=0.2, lw=0)
        if _splits(first):
            inter = first.cumulative_mb_at([steps[i] for i in keep], inter_node=True)
            _inter_node_curve(ax, inter, x, mean, label, style)
    ax.set_xscale("log")
    ax.set_xlabel(CUMULATIVE_TX)
    _loss_axis(ax, "validation loss (mean over seeds; band: min to max)", floor, plotted)
    ax.set_title(title or "validation loss vs cumulative MB, over seeds")
    ax.grid(alpha=0.3, which="both")
    if floor is None:
        _floor(ax, firsts)
    _legend_outside(ax)
    return _save(fig, out_dir, stem, formats)
