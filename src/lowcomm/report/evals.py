"""Benchmark scores from ``<run_dir>/eval/step_XXXXXXXXX.json``.

Such a file is written by ``lowcomm-eval`` (:mod:`lowcomm.eval`); a results file of lm-eval's own
CLI placed there is read too. The keys read, in order of preference, for task ``T`` and metric ``M``:

1. ``tasks[T][M]``, ``tasks[T][M + "_stderr"]`` and ``tasks[T]["documents_scored"]`` (n):
   lowcomm-eval's per-task summary;
2. ``lm_eval.results[R]["M,none"]`` and ``["M_stderr,none"]``, with ``R`` = ``lowcomm_T`` or ``T``:
   lm-eval's raw results as lowcomm-eval stores them beside the summary;
3. ``results[R]["M,none"]`` / ``["M_stderr,none"]``: a file of lm-eval's CLI (``--output_path``);
   ``results[R][M]`` / ``[M + "_stderr"]`` for lm-eval before 0.4, which had no filter suffix.

lm-eval writes the stderr as the string ``"N/A"`` when it cannot compute one (a single document);
that reads as None.

A task's chance level (``tasks[T]["chance"]``, written by lowcomm-eval) is the mean over the
documents scored of 1 / (number of choices): :func:`task_chance`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Score:
    """One benchmark metric: the mean over ``n`` documents and its standard error (each None if
    unknown)."""

    value: float
    stderr: float | None
    n: int | None = None

    def describe(self, digits: int = 3) -> str:
        """How every accuracy lowcomm prints reads: ``0.450 ± 0.114, n=20``. With 20 documents
        the standard error is about 0.11: differences smaller than that say nothing."""
        text = f"{self.value:.{digits}f}"
        if self.stderr is not None:
            text += f" ± {self.stderr:.{digits}f}"
        return text + (f", n={self.n}" if self.n is not None else "")


def task_score(result: dict[str, Any], task: str, metric: str) -> Score | None:
    """``metric`` (e.g. ``acc_norm``) of ``task`` (e.g. ``hellaswag``) in one evaluation file's
    content, or None when the file does not have it."""
    summary = (result.get("tasks") or {}).get(task)
    if isinstance(summary, dict) and _number(summary.get(metric)) is not None:
        n = summary.get("documents_scored")
        return Score(_number(summary[metric]), _number(summary.get(f"{metric}_stderr")),
                     n if isinstance(n, int) and not isinstance(n, bool) else None)
    for results in ((result.get("lm_eval") or {}).get("results"), result.get("results")):
        if not isinstance(results, dict):
            continue
        for name in (f"lowcomm_{task}", task):
            entry = results.get(name)
            if not isinstance(entry, dict):
                continue
            for value_key, stderr_key in ((f"{metric},none", f"{metric}_stderr,none"),
                                          (metric, f"{metric}_stderr")):
                value = _number(entry.get(value_key))
                if value is not None:
                    return Score(value, _number(entry.get(stderr_key)))
    return None


@dataclass(frozen=True)
class Chance:
    """The accuracy of a uniform guess on the documents scored, and how many had each number of
    choices (``{"4": 567, "5": 2, "3": 1}``)."""

    value: float
    documents: int
    choices: dict[str, int]

    def describe(self) -> str:
        """``0.2500 (4 choices each, n=4)``, or where the number of choices varies (ARC-Easy)
        ``0.2500 (mean of 1/choices over n=570: 1 with 3, 567 with 4, 2 with 5)``."""
        if len(self.choices) == 1:
            (count,) = self.choices
            return f"{self.value:.4f} ({count} choices each, n={self.documents})"
        counts = ", ".join(f"{n} with {count}" for count, n in self.choices.items())
        return f"{self.value:.4f} (mean of 1/choices over n={self.documents}: {counts})"


def task_chance(result: dict[str, Any], task: str) -> Chance | None:
    """The chance level lowcomm-eval stored for ``task``, or None (a file without one)."""
    chance = ((result.get("tasks") or {}).get(task) or {}).get("chance")
    if not isinstance(chance, dict) or _number(chance.get("value")) is None:
        return None
    return Chance(_number(chance["value"]), chance.get("documents"), dict(chance.get("choices") or {}))


def _number(value: Any) -> float | None:
    """A finite float, or None for a missing key, ``"N/A"`` or NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
