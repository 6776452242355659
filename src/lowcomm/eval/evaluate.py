"""Evaluate one checkpoint on lowcomm's tasks with lm-eval, and store the result in its run.

The result of checkpoint ``step_000000100`` goes to ``<run_dir>/eval/step_000000100.json``,
written atomically (a reader sees the old file or the new one, never half of one). It gathers
every task evaluated on that checkpoint, each with its score, standard error, n and chance level;
each task's entry is also kept in :mod:`lowcomm.eval.cache` for a rerun to reuse.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lm_eval
import lm_eval.api.task
import lm_eval.evaluator
import torch
import tqdm
from lm_eval.evaluator_utils import get_sample_size

from lowcomm.eval.checkpoints import Checkpoint, load_model_spec
from lowcomm.eval.model import LowcommLM
from lowcomm.eval.tasks import TASKS, TaskSpec, task_manager
from lowcomm.models import ModelSpec
from lowcomm.rundir import RunDir, write_json_atomic

# lowcomm scores zero-shot, as the DeMo paper reports (the task YAMLs say so too).
NUM_FEWSHOT = 0


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _silent_tqdm(*args, **kwargs):
    return tqdm.tqdm(*args, **{**kwargs, "disable": True})


@contextlib.contextmanager
def quiet_request_building():
    """lm-eval 0.4.13 draws a progress bar per task while it builds the task's requests
    (``Task.build_all_requests`` calls ``tqdm`` with no ``disable`` and takes no argument that
    would pass one), which would bury lowcomm's one progress line. Its module-level ``tqdm`` is
    swapped for a silent one while an evaluation runs. The model's own bars have a knob,
    ``disable_tqdm``, which :class:`LowcommLM` sets when it reports progress itself."""
    saved = lm_eval.api.task.tqdm
    try:
        lm_eval.api.task.tqdm = _silent_tqdm
        yield
    finally:
        lm_eval.api.task.tqdm = saved


def result_path(checkpoint: Checkpoint) -> Path:
    return RunDir(checkpoint.run_dir).eval_result(checkpoint.step)


def load_tasks(tasks: list[TaskSpec], lm_eval_task_manager=None) -> dict[str, Any]:
    """lm-eval's task objects of ``tasks`` by lowcomm name. Loading reads (and, for HellaSwag,
    reformats) the shipped documents, so one load serves every checkpoint of an invocation."""
    manager = lm_eval_task_manager or task_manager()
    loaded = manager.load([task.lm_eval_task for task in tasks])["tasks"]
    return {task.name: loaded[task.lm_eval_task] for task in tasks}


def chance_level(lm_eval_task, limit: int | None) -> dict[str, Any]:
    """The accuracy of a uniform guess on the documents that ``limit`` selects: the mean over
    them of 1 / (number of choices). HellaSwag has 4 endings and PIQA 2 solutions everywhere, but
    ARC-Easy has 3 to 5 choices, so its chance level depends on the questions scored. The
    documents are lm-eval's own (its document iterator and ``doc_to_choice``), i.e. those scored."""
    documents = [doc for _, doc in lm_eval_task.doc_iterator(limit=get_sample_size(lm_eval_task, limit))]
    counts = [len(lm_eval_task.doc_to_choice(doc)) for doc in documents]
    return {
        "value": sum(1 / count for count in counts) / len(counts),
        "documents": len(counts),
        "choices": {str(count): counts.count(count) for count in sorted(set(counts))},
    }


def evaluate_checkpoint(
    checkpoint: Checkpoint,
    tasks: list[TaskSpec],
    *,
    limit: int | None = None,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    lm_eval_tasks: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Zero-shot lm-eval scores of ``checkpoint`` on ``tasks`` (the first ``limit`` documents of
    each when given): one entry per task, as :mod:`lowcomm.eval.cache` stores it and
    :func:`checkpoint_result` gathers it into the run's ``eval/`` file.

    ``lm_eval_tasks``: :func:`load_tasks` of at least ``tasks``, to reuse across checkpoints
    (loaded here when omitted). ``progress(windows_scored, windows_total)`` is called as the
    model scores, instead of its own progress bar.

    lm-eval's ``evaluate`` is called rather than ``simple_evaluate``: the latter adds a git hash
    (a ``git`` call that prints "fatal: not a git repository" outside one) and torch's
    environment report (about 1.5 s) to each result, neither of which lowcomm keeps.
    """
    started = time.perf_counter()
    device = torch.device(device)
    spec = load_model_spec(checkpoint.run_dir)
    lm = LowcommLM.from_checkpoint(checkpoint, device=device, batch_size=batch_size, spec=spec)
    lm.progress = progress
    loaded = time.perf_counter()
    lm_eval_tasks = lm_eval_tasks or load_tasks(tasks)
    with quiet_request_building():
        output = lm_eval.evaluator.evaluate(
            lm=lm,
            task_dict={"tasks": {task.lm_eval_task: lm_eval_tasks[task.name] for task in tasks}, "groups": {}},
            limit=limit,
            log_samples=False,
        )
    evaluated = time.perf_counter()
    timing = {"load_model": round(loaded - started, 3), "evaluate": round(evaluated - loaded, 3),
              "total": round(evaluated - started, 3), "shared_by": [task.name for task in tasks]}
    config = {**lm.get_model_info(), "batch_size": batch_size, "device": str(device), "limit": limit}
    return {task.name: _task_entry(task, output, lm_eval_tasks[task.name], limit, batch_size, device, timing, config)
            for task in tasks}


def _task_entry(task: TaskSpec, output: dict, lm_eval_task, limit: int | None, batch_size: int,
                device: torch.device, timing: dict, config: dict) -> dict[str, Any]:
    """One task's share of an lm-eval output: lowcomm's summary and lm-eval's raw numbers."""
    name = task.lm_eval_task
    task_results = output["results"][name]
    counts = output["n-samples"][name]
    summary = {
        "metric": task.metric,
        "value": task_results[f"{task.metric},none"],
        "stderr": task_results[f"{task.metric}_stderr,none"],
        **{metric: task_results[f"{metric},none"] for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr")},
        "chance": chance_level(lm_eval_task, limit),
        "lm_eval_task": name,
        "split": task.split,
        "official_split": task.official_split,
        "documents_scored": counts["effective"],
        "documents_in_split": counts["original"],
        "limit": limit,
        "num_fewshot": NUM_FEWSHOT,
        "batch_size": batch_size,
        "device": str(device),
        "timing_s": timing,
    }
    return {
        "summary": summary,
        "lm_eval": {
            "version": lm_eval.__version__,
            **{key: {name: output[source][name]}
               for key, source in (("results", "results"), ("n_samples", "n-samples"), ("versions", "versions"),
                                   ("configs", "configs"))},
            "config": config,
        },
    }


def checkpoint_result(checkpoint: Checkpoint, spec: ModelSpec, entries: dict[str, dict[str, Any]],
                      previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content of ``<run_dir>/eval/step_XXXXXXXXX.json``: ``entries`` (task name -> entry, as
    computed or reused) over the tasks of ``previous`` (that file's content before), so that
    evaluating one more task keeps the others. Each task carries its own limit, n and timing."""
    tasks = dict((previous or {}).get("tasks") or {})
    lm_eval_part: dict[str, Any] = {"version": lm_eval.__version__}
    for key in ("results", "n_samples", "versions", "configs"):
        lm_eval_part[key] = dict(((previous or {}).get("lm_eval") or {}).get(key) or {})
    for name, entry in entries.items():
        tasks[name] = {**entry["summary"], "cache_file": entry.get("cache_file")}
        for key in ("results", "n_samples", "versions", "configs"):
            lm_eval_part[key].update(entry["lm_eval"][key])
    notes = [note for name in tasks if name in TASKS and (note := TASKS[name].split_note)]
    return {
        "run_dir": str(checkpoint.run_dir),
        "step": checkpoint.step,
        "checkpoint": str(checkpoint.path),
        "model": asdict(spec),
        "tasks": tasks,
        "notes": notes,
        "num_fewshot": NUM_FEWSHOT,
        "lm_eval": lm_eval_part,
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Store one evaluation result atomically (lm-eval's outputs hold a few non-JSON values)."""
    from lm_eval.utils import handle_non_serializable

    write_json_atomic(path, result, default=handle_non_serializable)
