"""The DeMo paper's Table 1 built from run directories, with the paper's numbers beside ours.

One row per run: model, optimizer, DCT chunk and k, then the final validation loss, HellaSwag
acc_norm, ARC-Easy acc, PIQA acc_norm (zero-shot, from ``eval/step_*.json``) and Tx MB/step
(the payload one worker contributes per step, the paper's convention). A run is matched to the
paper's row with the same model, optimizer, chunk and k; rows without a counterpart show "-".

The paper's final loss is the training loss at the end of a single pass over the data; ours is
the final validation loss by default (less noisy than one step's training loss, and equal to it
in expectation without repeated data), or the last logged training loss with ``loss="train"``.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from lowcomm.report.evals import Score, task_score
from lowcomm.report.paper import PaperRow, canonical_model, match_paper_row
from lowcomm.report.runs import OPTIMIZER_NAMES, RunRecord, distinct_labels


@dataclass(frozen=True)
class Column:
    key: str  # the CSV column, the same as results/paper/table1.csv's
    title: str
    decimals: int | None  # fixed decimals; None: 4 significant digits (MB/step spans 0.2 to 2400)


# Benchmarks in the paper's column order: (name in the eval files, metric the paper reports).
BENCHMARKS = (("hellaswag", "acc_norm"), ("arc_easy", "acc"), ("piqa", "acc_norm"))
COLUMNS = (
    Column("final_loss", "Final loss", 3),
    Column("hellaswag_acc_norm", "HellaSwag acc_norm", 3),
    Column("arc_easy_acc", "ARC-Easy acc", 3),
    Column("piqa_acc_norm", "PIQA acc_norm", 3),
    Column("tx_MB_per_step", "Tx MB/step", None),
)
# Beside Tx MB/step where a run has two links (FlexDeMo): the part of it that crosses between
# nodes, so that the table marks both of its numbers, as the figures do. Not a paper column.
INTER_NODE = Column("inter_node_tx_MB_per_step", "inter-node Tx MB/step", None)


@dataclass
class Table1Row:
    model: str
    optimizer: str
    chunk: int | None
    topk: int | None
    label: str
    run_dir: Path | None  # None: a paper row no run reproduces (``include_unmatched_paper``)
    values: dict[str, float | None] = field(default_factory=dict)  # ours, keyed by COLUMNS' keys
    stderr: dict[str, float | None] = field(default_factory=dict)  # of the benchmark values
    n: dict[str, int | None] = field(default_factory=dict)  # documents behind each benchmark value
    paper: PaperRow | None = None
    final_step: int | None = None
    eval_step: int | None = None
    ring_tx_mb_per_step: float | None = None  # bytes sent under the ring algorithm, for the CSV
    # the part of its Tx MB/step that crosses between nodes: a run with two links (FlexDeMo) sends
    # the rest inside a node; a run with one link, all of it on that link
    inter_node_mb_per_step: float | None = None


@dataclass
class Table1:
    rows: list[Table1Row]
    notes: list[str]  # what a reader must know about the numbers (partial runs, eval splits)
    loss: str = "val"  # which of our losses the final-loss column holds: "val" or "train"

    @property
    def two_links(self) -> bool:
        """Whether a run sends part of its bytes inside a node: then the table has the
        inter-node column too."""
        return any(row.inter_node_mb_per_step is not None and row.inter_node_mb_per_step != row.values.get(
            "tx_MB_per_step") for row in self.rows)

    def _inter_node(self, row: Table1Row) -> list[str]:
        return [format_value(row.inter_node_mb_per_step, INTER_NODE)] if self.two_links else []

    def to_markdown(self) -> str:
        """Each cell ``ours (paper)``; the notes follow as a list."""
        header = ["Model", "Optimizer", "chunk", "k", *(column.title for column in COLUMNS)]
        header += [INTER_NODE.title] if self.two_links else []
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for row in self.rows:
            cells = [row.model, row.label, _int(row.chunk), _int(row.topk)]
            cells += [_pair(row, column) for column in COLUMNS] + self._inter_node(row)
            lines.append("| " + " | ".join(cells) + " |")
        loss = "validation loss" if self.loss == "val" else "last logged training loss"
        caption = (f"Cells: ours (the paper's). Final loss: our final {loss}, the paper's final training "
                   "loss. Tx MB/step: payload per worker per step, all of its bytes, MB = 1e6 bytes"
                   + ("; inter-node: the part of it that crosses between nodes (a run with one link sends all "
                      "of it there)" if self.two_links else "")
                   + ". Benchmarks zero-shot, ours ± standard error (n documents).")
        return "\n".join([*lines, "", caption, *(f"- {note}" for note in self.notes)])

    def to_latex(self) -> str:
        """A booktabs ``tabular``; the paper's numbers in parentheses after ours."""
        columns = [*COLUMNS, INTER_NODE] if self.two_links else list(COLUMNS)
        spec = "llrr" + "r" * len(columns)
        header = ["Model", "Optimizer", "chunk", "$k$", *(_latex_escape(c.title) for c in columns)]
        lines = [f"\\begin{{tabular}}{{{spec}}}", "\\toprule", " & ".join(header) + " \\\\", "\\midrule"]
        previous_model = None
        for row in self.rows:
            if previous_model is not None and row.model != previous_model:
                lines.append("\\midrule")
            previous_model = row.model
            cells = [_latex_escape(row.model), _latex_escape(row.label), _int(row.chunk), _int(row.topk)]
            cells += [_pair(row, column, paper_format="{{\\small ({})}}", plus_minus="$\\pm$") for column in COLUMNS]
            cells += self._inter_node(row)
            lines.append(" & ".join(cells) + " \\\\")
        lines += ["\\bottomrule", "\\end{tabular}"]
        return "\n".join(lines)

    def write_csv(self, path: str | Path) -> Path:
        """Full precision: for each number ours, its stderr (benchmarks) and the paper's."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        benchmark_keys = {f"{task}_{metric}" for task, metric in BENCHMARKS}
        header = ["model", "optimizer", "label", "chunk", "topk", "run_dir", "final_step", "eval_step"]
        for column in COLUMNS:
            header.append(column.key)
            if column.key in benchmark_keys:
                header += [f"{column.key}_stderr", f"{column.key}_n"]
            header.append(f"{column.key}_paper")
        header += ["ring_tx_MB_per_step", "inter_node_tx_MB_per_step"]
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            for row in self.rows:
                record = [row.model, row.optimizer, row.label, row.chunk, row.topk, row.run_dir or "",
                          row.final_step, row.eval_step]
                for column in COLUMNS:
                    record.append(row.values.get(column.key))
                    if column.key in benchmark_keys:
                        record += [row.stderr.get(column.key), row.n.get(column.key)]
                    record.append(row.paper.values.get(column.key) if row.paper else None)
                record += [row.ring_tx_mb_per_step, row.inter_node_mb_per_step]
                writer.writerow(["" if cell is None else cell for cell in record])
        return path


def build_table1(runs: list[RunRecord], paper_rows: list[PaperRow] | None = None, *,
                 eval_step: int | None = None, include_unmatched_paper: bool = False,
                 loss: str = "val") -> Table1:
    """Table 1 of ``runs``: benchmarks from each run's evaluation at ``eval_step`` (default: its
    latest); final loss the validation loss (``loss="val"``) or the last training loss
    (``"train"``). With ``include_unmatched_paper``, the paper's rows for the same models that no
    run matches are listed too, with "-" for ours: what is left to reproduce."""
    if loss not in ("val", "train"):
        raise ValueError(f"loss={loss!r}; choose val or train")
    paper_rows = paper_rows or []
    rows, notes = [], []
    for run, label in zip(runs, distinct_labels(runs), strict=True):
        row = Table1Row(model=run.model, optimizer=run.optimizer, chunk=run.chunk, topk=run.topk,
                        label=label, run_dir=run.path, final_step=run.final_step,
                        ring_tx_mb_per_step=run.tx_mb_per_step)
        row.values["final_loss"] = run.final_val_loss if loss == "val" else run.final_train_loss
        row.values["tx_MB_per_step"] = run.payload_mb_per_step
        row.inter_node_mb_per_step = run.inter_node_payload_mb_per_step
        if run.two_links and run.inter_node_payload_mb_per_step is not None:
            notes.append(f"{label}: Tx MB/step counts all of its bytes ({run.payload_mb_per_step:.4g}); "
                         f"{run.inter_node_payload_mb_per_step:.3g} of them cross between nodes, the rest stays "
                         "inside a node (the inter-node column; the figures mark both)")
        row.paper = match_paper_row(paper_rows, run.model, run.optimizer, run.chunk, run.topk)
        if run.diverged:
            notes.append(f"{run.path}: diverged at step {run.diverged['step']} ({run.diverged['reason']}): "
                         "no final loss, ranked worst")
        elif not run.complete:
            notes.append(f"{run.path}: no summary.json (running or stopped early); "
                         f"numbers at step {run.final_step}")
        evaluation = run.eval_result(eval_step)
        if evaluation is None:
            wanted = f"at step {eval_step}" if eval_step is not None else "yet"
            notes.append(f"{run.path}: not evaluated {wanted} (lowcomm-eval {run.path})")
        else:
            row.eval_step, result = evaluation
            for task, metric in BENCHMARKS:
                score: Score | None = task_score(result, task, metric)
                key = f"{task}_{metric}"
                row.values[key] = score.value if score else None
                row.stderr[key] = score.stderr if score else None
                row.n[key] = score.n if score else None
            if run.final_step is not None and row.eval_step != run.final_step:
                notes.append(f"{run.path}: benchmarks at step {row.eval_step} of {run.final_step}")
            notes += [note for note in result.get("notes", []) if note not in notes]
        rows.append(row)
    if include_unmatched_paper:
        # Shown under the runs' model name, so that a model's rows read as one block.
        models = {canonical_model(run.model): run.model for run in runs}
        matched = {id(row.paper) for row in rows if row.paper is not None}
        for paper in paper_rows:
            model = models.get(canonical_model(paper.model))
            if model is not None and id(paper) not in matched:
                rows.append(Table1Row(model=model, optimizer=paper.optimizer, chunk=paper.chunk,
                                      topk=paper.topk, label=OPTIMIZER_NAMES.get(paper.optimizer, paper.optimizer),
                                      run_dir=None, paper=paper))
    rows.sort(key=_paper_order)
    return Table1(rows, notes, loss)


def _paper_order(row: Table1Row) -> tuple:
    """The paper's order: by model, then the chunked (DCT) rows by chunk ascending and k
    descending, then the uncompressed baselines."""
    return (canonical_model(row.model), row.chunk is None, row.chunk or 0, -(row.topk or 0),
            row.optimizer, row.label, str(row.run_dir or ""))


def format_value(value: float | None, column: Column) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if column.decimals is not None:
        return f"{value:.{column.decimals}f}"
    return f"{value:.4g}"


def _pair(row: Table1Row, column: Column, paper_format: str = "({})", plus_minus: str = "±") -> str:
    ours = format_value(row.values.get(column.key), column)
    if row.stderr.get(column.key) is not None:
        # an accuracy always with its standard error and the documents behind it
        ours += f" {plus_minus} {format_value(row.stderr[column.key], column)}"
        if row.n.get(column.key) is not None:
            ours += f", n={row.n[column.key]}"
    paper = row.paper.printed.get(column.key) if row.paper else None
    if not paper:
        return ours
    # The paper's numbers as printed (it truncates to 2 decimals), not re-rounded to our precision.
    return f"{ours} {paper_format.format(paper)}"


def _int(value: int | None) -> str:
    return "-" if value is None else str(value)


_LATEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                  "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(char, char) for char in text)
