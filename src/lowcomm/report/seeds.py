"""A laptop Table 1 that can say yes or no: runs repeated over seeds, compared with a baseline
(AdamW-DDP in the paper's sweeps; a sweep file may name another) by a rule stated before the
numbers.

Per run group (one sweep point at its tuned learning rate, several seeds): the excess
validation loss over the corpus's Bayes floor as mean ± sample standard deviation over seeds,
the payload MB per worker and step, the tx per rank at W = 64 under the ring algorithm (the
comm table's formula: an all-gather's (W-1) x payload), the bytes' ratio to the baseline's, and
a verdict:

    comparable  if |gap| <= 2 x pooled seed std  and  |gap| <= 5 % of the baseline's mean excess
    better / worse otherwise, by the gap's sign

where gap = mean excess - the baseline's mean excess and pooled std = sqrt((s^2 + s_base^2) / 2).
A verdict needs at least two seeds on both sides (one seed has no spread to compare a gap with),
and learning rates tuned for the model the runs trained: by the sweep's ``tune:`` block on
``optimizer.lr`` (at the sweep's own budget), by ``lowcomm-sweep run --laptop`` (the
quickstart's learning rates, picked for the tiny model at 200 steps), or declared in the sweep
file (``lr_tuned_for: [olmo_1b]``). A method at a learning rate tuned for another model is not
compared: where either side's was not tuned, the row says so ("lr not tuned for model=tiny")
and gives none. The gate checks the model, not the budget: a shortened run keeps its verdict.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from lowcomm.config.naming import what_is_trained
from lowcomm.config.sweep import best_value
from lowcomm.report.comm_table import config_traffic_function
from lowcomm.report.runs import RunRecord

RULE = ("Verdict rule (fixed before the runs): comparable if |gap| <= 2 x pooled seed std and |gap| <= 5% of "
        "the baseline's mean excess loss; otherwise better or worse by the gap's sign. gap = mean excess - "
        "the baseline's mean excess; excess = final validation loss - Bayes floor (the loss itself on data with "
        "no known floor); pooled std = "
        "sqrt((s^2 + s_base^2) / 2), s the sample standard deviation over seeds; no verdict with fewer than "
        "2 seeds, nor where the learning rates were not tuned for the model (a tune: block on "
        "optimizer.lr, lowcomm-sweep run --laptop, or lr_tuned_for: [MODEL] in the sweep file).")
REFERENCE_WORLD = 64  # the paper's 8 nodes x 8 GPUs
MIN_SEEDS = 2  # a sample standard deviation needs two


@dataclass
class Group:
    """One sweep point's runs over seeds."""

    label: str
    runs: list[RunRecord]

    @property
    def excess(self) -> list[float]:
        """Each seed's final validation loss over the Bayes floor; infinite for a seed that
        diverged (the worst a run can do: a group with one is never the better)."""
        return [math.inf if run.diverged else run.final_val_loss - (run.bayes_floor or 0.0) for run in self.runs]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.excess)

    @property
    def std(self) -> float:
        return statistics.stdev(self.excess) if len(self.runs) > 1 else math.nan

    @property
    def payload_mb(self) -> float:
        return self.runs[0].payload_mb_per_step

    @property
    def tokens_per_parameter(self) -> float:
        """Training tokens per model parameter of the group's first run (nan without a summary)."""
        summary = self.runs[0].summary or {}
        if not summary.get("tokens") or not summary.get("parameters"):
            return math.nan
        return summary["tokens"] / summary["parameters"]

    def tx_mb_at(self, world_size: int = REFERENCE_WORLD) -> float:
        """tx per rank and step at ``world_size`` for this config on its own model, in MB."""
        return config_traffic_function(self.runs[0].config)(world_size)[1] / 1e6


def seed_groups(runs: list[RunRecord]) -> list[Group]:
    """``runs`` as groups of runs that differ in their seed only (and share their label), in the
    order first seen, each under its label: a sweep's ``seeds:`` and a grid over ``seed`` group
    alike."""
    groups: dict[str, Group] = {}
    for run in runs:
        trains = {key: value for key, value in what_is_trained(run.config).items() if key != "seed"}
        key = json.dumps({**trains, "cluster": run.config.get("cluster"), "label": run.label}, sort_keys=True,
                         default=str)
        groups.setdefault(key, Group(run.label, [])).runs.append(run)
    return list(groups.values())


def verdict(group: Group, baseline: Group) -> str:
    """The stated rule (module doc); "1 seed: no verdict" where either side has fewer than
    :data:`MIN_SEEDS` seeds."""
    seeds = min(len(group.runs), len(baseline.runs))
    if seeds < MIN_SEEDS:
        return f"{seeds} seed{'s' if seeds != 1 else ''}: no verdict"
    gap = group.mean - baseline.mean
    pooled = math.sqrt((group.std ** 2 + baseline.std ** 2) / 2)
    if abs(gap) <= 2 * pooled and abs(gap) <= 0.05 * baseline.mean:
        return "comparable"
    return "better" if gap < 0 else "worse"


def untuned(groups: list[Group], lr_tuned_for: Collection[str] | None) -> str | None:
    """Why ``groups``' learning rates cannot carry a verdict (``lr not tuned for model=tiny``),
    or None where they can: ``lr_tuned_for`` names the models the sweep's learning rates were
    tuned for (None: every model, a sweep that tuned them itself)."""
    if lr_tuned_for is None:
        return None
    models = sorted({str((group.runs[0].config.get("model") or {}).get("name", "?")) for group in groups})
    untuned_models = [model for model in models if model not in lr_tuned_for]
    return f"lr not tuned for {', '.join(f'model={m}' for m in untuned_models)}" if untuned_models else None


def seed_rows(groups: list[Group], baseline_label: str = "AdamW-DDP", *,
              lr_tuned_for: Collection[str] | None) -> list[dict]:
    """One row per group, the baseline's first; a verdict where both sides have the seeds
    (:func:`verdict`) and learning rates tuned for their model (:func:`untuned`)."""
    baseline = next((g for g in groups if g.label == baseline_label), None)
    if baseline is None:
        raise ValueError(f"no group labelled {baseline_label!r} to compare with; groups: {[g.label for g in groups]}")
    base_tx = baseline.tx_mb_at()
    rows = []
    for group in sorted(groups, key=lambda g: g is not baseline):
        tx = group.tx_mb_at()
        rows.append({
            "label": group.label, "seeds": len(group.runs), "lr": group.runs[0].config["optimizer"]["lr"],
            "parameters": (group.runs[0].summary or {}).get("parameters"),
            "tokens": (group.runs[0].summary or {}).get("tokens"),
            "tokens_per_parameter": group.tokens_per_parameter,
            "excess_mean": group.mean, "excess_std": group.std, "baseline": baseline.label,
            "bayes_floor": all(run.bayes_floor is not None for run in group.runs),
            "gap_to_baseline": group.mean - baseline.mean,
            "payload_MB_per_step": group.payload_mb, f"tx_MB_per_rank_at_W{REFERENCE_WORLD}": tx,
            "payload_ratio_to_baseline": baseline.payload_mb / group.payload_mb if group.payload_mb else math.inf,
            f"tx_ratio_to_baseline_at_W{REFERENCE_WORLD}": base_tx / tx if tx else math.inf,
            "verdict": "baseline" if group is baseline else _gated(group, baseline, lr_tuned_for),
        })
    return rows


def _gated(group: Group, baseline: Group, lr_tuned_for: Collection[str] | None) -> str:
    said = verdict(group, baseline)
    if said.endswith("no verdict"):
        return said
    return untuned([group, baseline], lr_tuned_for) or said


def seed_table(rows: list[dict]) -> str:
    """Markdown: the rule first, then the budget (tokens per parameter), then the table."""
    base = rows[0]["baseline"] if rows else "the baseline"
    # over the Bayes floor where the data has one (the synthetic corpus), else the loss itself
    loss = "excess loss" if all(row.get("bayes_floor", True) for row in rows) else "final val loss"
    lines = [RULE, "", budget_line(rows), "",
             f"| run | lr | seeds | {loss} (mean ± std) | gap to {base} | payload MB/step | "
             f"tx MB/rank at W={REFERENCE_WORLD} | fewer bytes than {base} (payload / tx at W={REFERENCE_WORLD}) "
             "| verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        spread = f" ± {row['excess_std']:.4f}" if math.isfinite(row["excess_std"]) else " (1 seed)"
        lines.append(
            f"| {row['label']} | {row['lr']:.3g} | {row['seeds']} | {row['excess_mean']:.4f}{spread} "
            f"| {row['gap_to_baseline']:+.4f} | {row['payload_MB_per_step']:.4g} "
            f"| {row[f'tx_MB_per_rank_at_W{REFERENCE_WORLD}']:.4g} "
            f"| {row['payload_ratio_to_baseline']:.3g}x / {row[f'tx_ratio_to_baseline_at_W{REFERENCE_WORLD}']:.3g}x "
            f"| {row['verdict']} |")
    return "\n".join(lines)


def budget_line(rows: list[dict]) -> str:
    """The training budget of the table's runs, in tokens per parameter (the runs of a sweep
    share model and budget; a table that mixes them says so)."""
    budgets = {(row["parameters"], row["tokens"]) for row in rows}
    if len(budgets) != 1 or None in next(iter(budgets)):
        return "Budget: differs between rows (see summary.csv: parameters, tokens, tokens_per_parameter)."
    parameters, tokens = next(iter(budgets))
    return (f"Budget: {parameters:,} parameters, {tokens:,} training tokens per run, "
            f"{tokens / parameters:.1f} tokens per parameter.")


def grid_table(results: dict[str, dict[float, float]], chosen: Mapping[str, float] | None = None) -> str:
    """Markdown: the tuning runs' final validation loss, one row per label, one cell per value
    tried, in order (the chosen value in bold: ``chosen``'s, else the lowest finite loss; a
    diverged run, nan or inf, is never chosen)."""
    lines = ["| run | final val loss at each lr (tuning budget; bold: chosen) |", "|---|---|"]
    for label, by_value in results.items():
        best = chosen[label] if chosen is not None and label in chosen else best_value(by_value, label)
        cells = [f"**{value:.3g}: {loss:.4f}**" if value == best else f"{value:.3g}: {loss:.4f}"
                 for value, loss in sorted(by_value.items())]
        lines.append(f"| {label} | {', '.join(cells)} |")
    return "\n".join(lines)
