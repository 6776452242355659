"""Tables from run summaries, as Markdown and CSV."""

from __future__ import annotations

import csv
from pathlib import Path

from lowcomm.report.evals import Score, task_score
from lowcomm.report.runs import RunRecord

SUMMARY_COLUMNS = [
    ("run", "label"), ("final val loss", "final_val_loss"), ("Bayes floor", "bayes_floor"),
    ("payload MB/step", "payload_MB_per_step"), ("inter-node MB/step", "inter_node_payload_MB_per_step"),
    ("tokens/s", "tokens_per_s"), ("steps", "steps"),
]
# The paper's zero-shot metric of each benchmark, as Table 1 reports it.
BENCHMARK_COLUMNS = [("HellaSwag acc_n", "hellaswag", "acc_norm"), ("ARC-Easy acc", "arc_easy", "acc"),
                     ("PIQA acc_n", "piqa", "acc_norm")]


def summary_rows(runs: list[RunRecord]) -> list[dict]:
    """One row per finished run: its summary.json and, if it was evaluated, the latest scores."""
    rows = []
    for run in runs:
        if run.summary is None:
            continue
        row = {"label": run.label, **run.summary}
        if run.evals:
            latest = run.evals[max(run.evals)]
            for _, task, metric in BENCHMARK_COLUMNS:
                score = task_score(latest, task, metric)
                key = f"{task}_{metric}"
                row[key] = score
                row[f"{key}_stderr"] = score.stderr if score else None
                row[f"{key}_n"] = score.n if score else None
        rows.append(row)
    return rows


def summary_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """The summary columns, plus the benchmark columns when any row has scores (Markdown shows
    each as ``value ± stderr (n=N)``; the CSV gives value, stderr and n their own columns)."""
    benchmarks = [(title, f"{task}_{metric}") for title, task, metric in BENCHMARK_COLUMNS
                  if any(row.get(f"{task}_{metric}") is not None for row in rows)]
    return SUMMARY_COLUMNS + benchmarks


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, Score):
        return value.describe()
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}" if abs(value) < 0.01 else f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def markdown_table(rows: list[dict], columns=SUMMARY_COLUMNS) -> str:
    header = "| " + " | ".join(title for title, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(row.get(key)) for _, key in columns) + " |" for row in rows]
    return "\n".join([header, rule, *body])


def write_csv(rows: list[dict], path: Path, columns=None) -> Path:
    """Numbers at full precision; a benchmark score as three columns: value, stderr, n.
    ``columns``: ``(title, key)`` pairs (default: every key of the first row, in order)."""
    keys = []
    for _, key in columns if columns is not None else [(key, key) for key in rows[0]]:
        keys.append(key)
        if any(isinstance(row.get(key), Score) for row in rows):
            keys += [f"{key}_stderr", f"{key}_n"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(keys)
        for row in rows:
            writer.writerow([row[key].value if isinstance(row.get(key), Score) else row.get(key) for key in keys])
    return path
