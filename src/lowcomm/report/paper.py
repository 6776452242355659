"""The papers' reference numbers, kept in ``results/paper/*.csv``, and matching them to runs.

``results/paper/table1.csv`` holds the DeMo paper's Table 1 (and its appendix table), one row per
(model, optimizer, chunk, k), with the columns::

    model, optimizer, chunk, topk, final_loss, hellaswag_acc_norm, arc_easy_acc, piqa_acc_norm,
    tx_MB_per_step

Blank cells are missing values (the AdamW rows have no chunk or k). Other columns are allowed
and ignored. Names are compared loosely, so ``300M``, ``OLMo-300M`` and ``olmo_300m`` are the
same model and ``AdamW-DDP`` and ``adamw_ddp`` the same optimizer.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from lowcomm.config import repo_root

KEY_COLUMNS = ("model", "optimizer", "chunk", "topk")
# The numbers Table 1 reports, as named in the CSV; lowcomm's table uses the same names.
VALUE_COLUMNS = ("final_loss", "hellaswag_acc_norm", "arc_easy_acc", "piqa_acc_norm", "tx_MB_per_step")


@dataclass(frozen=True)
class PaperRow:
    model: str
    optimizer: str
    chunk: int | None
    topk: int | None
    values: dict[str, float | None]  # keyed by VALUE_COLUMNS
    printed: dict[str, str]  # the same cells as written in the CSV ("0.70", not 0.7), for tables

    def matches(self, model: str, optimizer: str, chunk: int | None, topk: int | None) -> bool:
        """Same model and optimizer (names compared loosely) and the same chunk and k."""
        return (canonical_model(self.model) == canonical_model(model)
                and canonical_optimizer(self.optimizer) == canonical_optimizer(optimizer)
                and self.chunk == chunk and self.topk == topk)


def paper_table1_path() -> Path:
    return repo_root() / "results" / "paper" / "table1.csv"


def canonical_model(name: str) -> str:
    """``OLMo-300M``, ``olmo_300m`` and ``300M`` -> ``300m``."""
    return re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("olmo") or name.lower()


def canonical_optimizer(name: str) -> str:
    """``AdamW-DDP`` and ``adamw_ddp`` -> ``adamwddp``; ``DES-LOC`` and ``desloc`` -> ``desloc``."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def load_paper_table1(path: str | Path | None = None) -> list[PaperRow]:
    """The rows of the paper's Table 1 (default: ``results/paper/table1.csv``)."""
    path = Path(path) if path is not None else paper_table1_path()
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        absent = [c for c in (*KEY_COLUMNS, *VALUE_COLUMNS) if c not in (reader.fieldnames or [])]
        if absent:
            raise ValueError(f"{path}: missing column(s) {', '.join(absent)}; "
                             f"expected {', '.join((*KEY_COLUMNS, *VALUE_COLUMNS))}")
        rows = []
        for line_no, record in enumerate(reader, 2):
            try:
                rows.append(PaperRow(
                    model=record["model"].strip(),
                    optimizer=record["optimizer"].strip(),
                    chunk=_optional_int(record["chunk"]),
                    topk=_optional_int(record["topk"]),
                    values={column: _optional_float(record[column]) for column in VALUE_COLUMNS},
                    printed={column: (record[column] or "").strip() for column in VALUE_COLUMNS},
                ))
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from exc
    return rows


def match_paper_row(rows: list[PaperRow], model: str, optimizer: str, chunk: int | None,
                    topk: int | None) -> PaperRow | None:
    """The paper's row for this model, optimizer, chunk and k, if the paper has one."""
    return next((row for row in rows if row.matches(model, optimizer, chunk, topk)), None)


def _optional_float(cell: str | None) -> float | None:
    cell = (cell or "").strip()
    return float(cell) if cell else None


def _optional_int(cell: str | None) -> int | None:
    value = _optional_float(cell)
    if value is None:
        return None
    if value != int(value):
        raise ValueError(f"{cell!r} is not a whole number")
    return int(value)
