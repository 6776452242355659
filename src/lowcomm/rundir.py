"""The run directory: the seam between training and everything that reads its results.

Everything a run produces lives under ``<run_root>/<experiment>/<run_name>/``::

    config.yaml                    the resolved config (written before any worker starts)
    metrics.jsonl                  one JSON object per logged step and per evaluation
    summary.json                   final numbers, written once the run finished
    checkpoints/step_000000100/    complete checkpoints (manifest.json written last)
    eval/step_000000100.json       lm-eval results of that checkpoint
    eval/cache/step_000000100/     each task's result, kept for a rerun of lowcomm-eval to reuse
    slurm/                         submitit's job files and logs, and the submission record

This module is the one place that knows these names and how to read them. Training writes
through it, and evaluation, reports and the SLURM queue view read through it; it imports
nothing else of lowcomm, so those readers never depend on the training loop or the launchers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
EVAL_DIR = "eval"
EVAL_CACHE_DIR = "cache"  # in EVAL_DIR
SLURM_DIR = "slurm"
SUBMISSIONS_FILE = "submissions.jsonl"  # in SLURM_DIR: one record per submitted job

# Inside one checkpoint directory.
MANIFEST_FILE = "manifest.json"  # written last: its presence makes the directory complete
TRAINER_FILE = "trainer.json"
MODEL_FILE = "model.pt"


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message names the file."""


class MetricsError(ValueError):
    """A ``metrics.jsonl`` that cannot be read or resumed; the message names the file (and line)."""


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created by constructing one)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def eval_dir(self) -> Path:
        return self.path / EVAL_DIR

    @property
    def slurm_dir(self) -> Path:
        return self.path / SLURM_DIR

    def eval_result(self, step: int) -> Path:
        return self.eval_dir / f"{step_dir_name(step)}.json"

    def eval_cache_dir(self, step: int) -> Path:
        return self.eval_dir / EVAL_CACHE_DIR / step_dir_name(step)

    def is_run(self) -> bool:
        """Whether this looks like a lowcomm run directory (it has its config.yaml)."""
        return self.config.is_file()

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics)

    def read_summary(self) -> dict[str, Any] | None:
        """The summary of a finished run, or None while it has none. One that cannot be read
        (empty or cut short: written in place by a version before 2026-12-02, then a full disk
        or a kill) is named in one line on stderr, and the run is taken as unfinished: a launch
        resumes it from its checkpoints and writes the summary again."""
        if not self.summary.is_file():
            return None
        try:
            summary = json.loads(self.summary.read_text())
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not valid JSON"
            print(f"[lowcomm] {self.summary} cannot be read ({reason}): the run is taken as unfinished and "
                  "resumes from its checkpoints", file=sys.stderr, flush=True)
            return None
        return summary if isinstance(summary, dict) else None

    def read_evals(self) -> dict[int, dict[str, Any]]:
        """Stored evaluation results by checkpoint step."""
        # lowcomm-eval writes step_XXXXXXXXX.json through a hidden temporary file that this
        # pattern cannot match, so a half-written result is never read.
        return {int(path.stem.split("_")[1]): json.loads(path.read_text())
                for path in sorted(self.eval_dir.glob("step_*.json"))}


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def list_checkpoints(checkpoint_root: Path) -> list[Path]:
    """Checkpoint directories (named step_*, complete or not), newest first."""
    if not checkpoint_root.is_dir():
        return []
    dirs = [p for p in checkpoint_root.iterdir() if p.is_dir() and p.name.startswith("step_")]
    return sorted(dirs, key=lambda p: int(p.name.split("_")[1]), reverse=True)


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_*`` checkpoint directory."""
    return int(path.name.split("_")[1])


def resume_note(run_dir: Path) -> str:
    """Where a rerun of the run resumes: its newest checkpoint (complete or not: a rerun checks
    it and falls back), for the line that ends an interrupted or failed run."""
    newest = list_checkpoints(RunDir(run_dir).checkpoints)
    if not newest:
        return "no checkpoint was written yet: a rerun starts from step 0"
    return f"the last checkpoint is step {checkpoint_step(newest[0])} ({newest[0]}); rerun the same command to resume"


def file_digest(path: Path) -> str:
    """sha256 of a file's content, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: Path) -> dict:
    """A checkpoint's manifest, checked for its structure: ``{"step": int, "files": {name:
    {"size": int, "sha256": str}}}`` (older checkpoints list sizes alone). Raises naming the file."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (an incomplete checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int) or not isinstance(files, dict):
        raise CheckpointError(f"{path} is not a lowcomm manifest: it needs an integer 'step' and a 'files' map")
    for name, entry in files.items():
        size = entry if isinstance(entry, int) else entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(size, int) or (isinstance(entry, dict) and not isinstance(digest, str)):
            raise CheckpointError(f"{path}: the entry of {name} is malformed: {entry!r}")
    return manifest


def manifest_entry(manifest: dict, directory: Path, name: str) -> dict:
    """``{"size": int, "sha256": str | None}`` of a file the manifest must list."""
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{directory / MANIFEST_FILE} does not list {name}")
    return {"size": entry, "sha256": None} if isinstance(entry, int) else entry


def check_content(path: Path, entry: dict, content: bytes | None = None) -> None:
    """Raise naming ``path`` unless it has the size and content hash its manifest entry records
    (``content``: the file's bytes, when the caller has read them already)."""
    if content is None and not path.is_file():
        raise CheckpointError(f"{path} is missing")
    size = path.stat().st_size if content is None else len(content)
    if size != entry["size"]:
        raise CheckpointError(f"{path} is truncated or altered: {size} bytes, manifest says {entry['size']}")
    if entry.get("sha256"):
        digest = hashlib.sha256(content).hexdigest() if content is not None else file_digest(path)
        if digest != entry["sha256"]:
            raise CheckpointError(f"{path} is altered: its content does not match the hash in its manifest")


def verify_files(directory: Path, only: tuple[str, ...] | None = None) -> dict:
    """Check the manifest and the files it lists (or just ``only``): present, of the recorded
    size and content hash. Returns the manifest or raises naming the file."""
    manifest = read_manifest(directory)
    for name in only if only is not None else tuple(manifest["files"]):
        check_content(directory / name, manifest_entry(manifest, directory, name))
    return manifest


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (none if it does not exist yet). A last line that does
    not parse is one being written right now and is skipped; a bad line anywhere else is an
    error naming the file and line."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    records = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if line_no == len(lines):
                break
            raise MetricsError(f"{path}:{line_no} is not valid JSON: {exc}") from exc
    return records


def write_json_atomic(path: Path, payload: dict[str, Any], default: Callable[[Any], Any] | None = None, *,
                      allow_nan: bool = True) -> None:
    """Write ``payload`` so that a reader sees the old file or the new one, never half of one:
    to a hidden temporary file beside ``path`` (no ``step_*.json`` glob matches it), flushed to
    disk, then renamed. ``default`` serialises what json cannot and ``allow_nan`` (as in
    ``json.dump``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump(payload, handle, indent=2, default=default, allow_nan=allow_nan)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
