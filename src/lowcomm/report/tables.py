"""Tables from run summaries, as Markdown and CSV."""

from __future__ import annotations

import csv
from pathlib import Path

from lowcomm.report.runs import RunRecord

SUMMARY_COLUMNS = [
    ("run", "label"), ("final val loss", "final_val_loss"), ("Bayes floor", "bayes_floor"),
    ("payload MB/step", "payload_MB_per_step"), ("tokens/s", "tokens_per_s"), ("steps", "steps"),
]


def summary_rows(runs: list[RunRecord]) -> list[dict]:
    rows = []
    for run in runs:
        if run.summary is None:
            continue
        row = {"label": run.label, **run.summary}
        rows.append(row)
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
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


def write_csv(rows: list[dict], path: Path, columns=SUMMARY_COLUMNS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([key for _, key in columns])
        for row in rows:
            writer.writerow([row.get(key) for _, key in columns])
    return path
