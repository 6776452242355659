"""Checkpoints that are complete or absent, and a resume that continues bit-for-bit.

Layout: ``<run_dir>/checkpoints/step_000000100/`` holding
- ``model.pt``: the full model state (rank 0);
- ``optim.pt`` (rank 0): the optimizer state that is the same on every rank (all of it, or
  the strategy's ``replicated_state_keys``), written once;
- ``optim_rank<r>.pt``: each rank's own optimizer state (momenta that differ per worker);
- ``rank<r>.pt``: per rank, RNG states, the Communicator meter, the strategy's extra state;
- ``trainer.json``: step, data position, the world size and per-rank layout it was written with;
- ``manifest.json``: every file above with its size and sha256, written last.

A checkpoint is written into ``.tmp_step_*``: each rank hashes its files while writing them
(no second read) and leaves the hashes beside them; after a barrier rank 0 gathers them into the
manifest and renames the directory, so a directory named ``step_*`` with a manifest is
complete. A write that fails (a full disk) names the file and the cause.

On resume rank 0 removes leftover ``.tmp_step_*`` directories and chooses the candidates, newest
first; every rank checks the one it is given (the manifest's structure, each file it loads
present with its recorded size and content hash, loadable); if any rank finds a problem the
error names the file and all ranks fall back to the previous checkpoint together. When there
were checkpoints and none is usable the run stops with what was found, rather than starting
over.

At another world size than the checkpoint's, rank r loads the shared files and the own files of
rank r mod the old world size (:meth:`lowcomm.strategies.Strategy.elastic_rule`); a checkpoint
whose per-rank layout (``Strategy.layout``: FlexDeMo's shard group size) differs from the run's
is refused. The DiLoCo family's optimizers leave their parameters out of their state at an outer
boundary (they are the global copy there), so a checkpoint written there holds none per rank.

The names and the manifest check are :mod:`lowcomm.rundir`'s, shared with the readers of run
directories (evaluation, reports).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowcomm.comm import Communicator
from lowcomm.data.synthetic import mount_point
from lowcomm.rundir import (
    MANIFEST_FILE,
    MODEL_FILE,
    TRAINER_FILE,
    CheckpointError,
    RunDir,
    check_content,
    list_checkpoints,
    manifest_entry,
    read_manifest,
    step_dir_name,
)
from lowcomm.units import decimal_bytes

OPTIM_FILE = "optim.pt"  # optimizer state the same on every rank, written once


def optim_rank_file(rank: int) -> str:
    return f"optim_rank{rank}.pt"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"

__all__ = ["CheckpointError", "CheckpointManager", "Restored", "list_checkpoints"]

log = logging.getLogger("lowcomm.checkpoint")


def load_file(path: Path, entry: dict | None = None) -> Any:
    """Unpickle a checkpoint file; with its manifest ``entry``, after checking its size and
    content hash on the bytes read (one read of the file)."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from exc
    if entry is not None:
        check_content(path, entry, content)
    try:
        return torch.load(io.BytesIO(content), map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from exc


def layout_refusal(trainer_file: Path, trainer: dict, world_size: int, layout: dict) -> str | None:
    """Why a checkpoint (its ``trainer.json`` record) cannot resume a run of ``world_size`` ranks
    whose method lays its per-rank state out as ``layout``
    (:meth:`lowcomm.strategies.Strategy.layout`), or None: said by the launcher before anything
    spawns and by a rank that finds it anyway. A checkpoint written before layouts were
    recorded is taken as laid out for this run at its own world size, and as having no layout at
    another (which every method but FlexDeMo has)."""
    written = trainer.get("layout")
    if written is None:
        written = layout if trainer["world_size"] == world_size else {}
    if written == layout:
        return None

    def settings(values: dict) -> str:
        return " ".join(f"{key}={value}" for key, value in sorted(values.items())) or "no recorded layout"

    return (f"{trainer_file}: its per-rank state is laid out for {settings(written)} (written by "
            f"{trainer['world_size']} ranks), this run's for {settings(layout)} ({world_size} ranks): resume on "
            f"{trainer['world_size']} ranks, as it was written"
            + (f", or on ranks laid out for {settings(written)}" if written else ""))


def read_trainer_state(path: Path, entry: dict) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from exc
    check_content(path, entry, content)
    try:
        state = json.loads(content)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(state.get(key), int)
                                               for key in ("step", "consumed", "world_size")):
        raise CheckpointError(f"{path} is not a lowcomm trainer state: it needs integer step, consumed, world_size")
    return state


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Restored:
    step: int
    consumed: int
    path: Path
    written_by: int  # the world size the checkpoint was written with
    elastic_rule: str | None = None  # what the resume did, where written_by is not this run's

    def describe(self) -> str:
        """``resuming from step_000000300`` and, at another world size, what that did."""
        text = f"resuming from {self.path.name}"
        if self.elastic_rule:
            text += f" (written by {self.written_by} ranks; on these: {self.elastic_rule})"
        return text


class CheckpointManager:
    def __init__(self, run_dir: Path, comm: Communicator, strategy, keep: int, layout: dict | None = None):
        self.root = RunDir(run_dir).checkpoints
        self.comm = comm
        self.strategy = strategy
        self.keep = keep
        # how the method's per-rank state lies over the ranks (Strategy.layout), in each checkpoint
        self.layout = layout or {}
        # checkpoints this run could not read when it resumed: never kept in place of good ones
        self.unusable: set[str] = set()

    # ------------------------------------------------------------------- save
    def save(self, step: int, model, optimizer, consumed: int) -> Path:
        rank, is_main = self.comm.rank, self.comm.rank == 0
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.comm.barrier()
        model_state = self.strategy.model_state_dict(model)
        written: dict[str, dict] = {}
        if is_main:
            written[MODEL_FILE] = _atomic_save(model_state, tmp / MODEL_FILE)
            trainer = {"step": step, "consumed": consumed, "world_size": self.comm.world_size,
                       "layout": self.layout}
            written[TRAINER_FILE] = _write_bytes(json.dumps(trainer).encode(), tmp / TRAINER_FILE)
        shared, own = self._split(optimizer.state_dict())
        if is_main and shared is not None:
            written[OPTIM_FILE] = _atomic_save(shared, tmp / OPTIM_FILE)
        if own is not None:
            written[optim_rank_file(rank)] = _atomic_save(own, tmp / optim_rank_file(rank))
        written[rank_file(rank)] = _atomic_save({"rng": rng_state(), "meter": self.comm.meter.state_dict(),
                                                 "strategy": self.strategy.extra_state()}, tmp / rank_file(rank))
        _write_bytes(json.dumps(written).encode(), tmp / f".hashes_rank{rank}.json")
        self.comm.barrier()
        if is_main:
            files: dict[str, dict] = {}
            for sidecar in sorted(tmp.glob(".hashes_rank*.json")):
                files.update(json.loads(sidecar.read_text()))
                sidecar.unlink()
            manifest = {"step": step, "world_size": self.comm.world_size, "files": dict(sorted(files.items()))}
            _write_bytes(json.dumps(manifest, indent=1).encode(), tmp / MANIFEST_FILE)
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._retain(final)
        self.comm.barrier()
        return final

    def _retain(self, written: Path) -> None:
        """Keep the newest ``keep`` checkpoints that are not known to be unusable: the one just
        written (hashed as it was written) always among them, a checkpoint this run failed to
        read never one of them. Unusable ones are deleted, with a line naming each: kept, they
        would push the last good checkpoint out (a corrupt step 621 and a new 631 with keep=2
        would leave nothing to fall back to if 631 were damaged next)."""
        kept = [written]
        for path in list_checkpoints(self.root):
            if path == written:
                continue
            if path.name in self.unusable:
                log.warning("deleting %s: it could not be read when this run resumed", path)
                shutil.rmtree(path, ignore_errors=True)
                self.unusable.discard(path.name)
            elif len(kept) < self.keep:
                kept.append(path)
            else:
                shutil.rmtree(path, ignore_errors=True)

    # --------------------------------------------------------------- restore
    def restore_latest(self, model, optimizer, *, root: Path | None = None,
                       at_most: int | None = None) -> Restored | None:
        """Load the newest usable checkpoint into model/optimizer/RNG/meter; None when the run
        has none. Rank 0 chooses the candidates (every rank tries the same ones, in order); a
        run whose checkpoints are all unusable stops with CheckpointError listing them.
        ``root``: another worker's checkpoints to resume from (a learner that has none of its
        own); saves still go to this run's. ``at_most``: the newest of step ``at_most`` or before
        (that other worker may be writing newer ones meanwhile)."""
        root = self.root if root is None else root
        steps: list[int] = []
        if self.comm.rank == 0:
            # (only in its own: another worker's may be writing one now)
            for leftover in root.glob(".tmp_step_*") if root == self.root and root.is_dir() else ():
                log.warning("removing %s, a checkpoint whose writing was interrupted", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
            steps = [int(path.name.split("_")[1]) for path in list_checkpoints(root)]
            steps = [step for step in steps if at_most is None or step <= at_most]
        steps = self.comm.share(steps)
        found = []
        for step in steps:
            directory = root / step_dir_name(step)
            loaded, problem = None, None
            try:
                loaded = self._read(directory)
            except CheckpointError as exc:
                problem = str(exc)
            first = self.comm.first(problem is not None)
            if first is not None:  # said once, by the lowest rank that could not read its files
                self.unusable.add(directory.name)
                found.append(f"{directory.name}: " + (problem if first == self.comm.rank
                                                       else f"rank {first} could not read its files"))
                if first == self.comm.rank:
                    log.error("checkpoint %s unusable (%s); falling back to the previous one", directory.name, problem)
                continue
            self._apply(loaded, model, optimizer)
            trainer = loaded["trainer"]
            written_by = trainer["world_size"]
            rule = self.strategy.elastic_rule(written_by) if written_by != self.comm.world_size else None
            return Restored(step=trainer["step"], consumed=trainer["consumed"], path=directory,
                            written_by=written_by, elastic_rule=rule)
        if found:
            raise CheckpointError(f"no usable checkpoint in {root}; found: " + "; ".join(found)
                                  + ". Restore or remove them to start over")
        return None

    def _read(self, directory: Path) -> dict:
        manifest = read_manifest(directory)
        rank = self.comm.rank

        def load(name: str) -> Any:
            return load_file(directory / name, manifest_entry(manifest, directory, name))

        trainer = read_trainer_state(directory / TRAINER_FILE, manifest_entry(manifest, directory, TRAINER_FILE))
        refusal = layout_refusal(directory / TRAINER_FILE, trainer, self.comm.world_size, self.layout)
        if refusal:
            raise CheckpointError(refusal)
        # at another world size, rank r resumes the own state of rank r mod the world it was
        # written by (Strategy.elastic_rule); at the same, its own
        source = rank % trainer["world_size"]
        optim: dict = {}
        if self.strategy.replicated_optimizer_state or self.strategy.replicated_state_keys:
            optim.update(load(OPTIM_FILE))
        if not self.strategy.replicated_optimizer_state:
            optim.update(load(optim_rank_file(source)))
        return {"trainer": trainer, "model": load(MODEL_FILE), "optim": optim, "rank": load(rank_file(source))}

    def _split(self, state: dict) -> tuple[dict | None, dict | None]:
        """(written once by rank 0, written by every rank): replicated state would otherwise be
        W identical copies (DiLoCo's global parameters and outer momentum: two model-sized
        tensors per rank)."""
        if self.strategy.replicated_optimizer_state:
            return state, None
        keys = self.strategy.replicated_state_keys
        shared = {key: state[key] for key in keys}
        own = {key: value for key, value in state.items() if key not in keys}
        return (shared or None), own

    def _apply(self, loaded: dict, model, optimizer) -> None:
        self.strategy.load_model_state_dict(model, loaded["model"])
        optimizer.load_state_dict(loaded["optim"])
        self.strategy.load_extra_state(loaded["rank"]["strategy"])
        self.comm.meter.load_state_dict(loaded["rank"]["meter"])
        set_rng_state(loaded["rank"]["rng"])


class _HashingWriter:
    """A file that hashes what passes through it, so saving costs no second read."""

    def __init__(self, handle):
        self.handle, self.digest, self.size = handle, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _write_through(path: Path, write) -> dict:
    """Write ``path`` via a ``.part`` file and a rename; return its manifest entry. A failure
    (a full disk, a read-only directory) names the file and the cause."""
    tmp = path.with_name(path.name + ".part")
    try:
        with tmp.open("wb") as handle:
            writer = _HashingWriter(handle)
            write(writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        # the space as the write left it, before its partial file is removed
        cause = _no_space(path.parent) if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"writing {path} failed: {cause}") from exc
    except RuntimeError as exc:  # torch.save reports a failed write of its zip stream this way
        # its words are the zip writer's ("[enforce fail at inline_container.cc:672] . unexpected
        # pos ..."): where the disk is full (measured before the partial file is removed), say that
        full = shutil.disk_usage(path.parent).free < (1 << 20)
        cause = _no_space(path.parent) if full else " ".join(str(exc).split())
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"writing {path} failed: {cause}") from exc
    return {"size": writer.size, "sha256": writer.digest.hexdigest()}


def _no_space(directory: Path) -> str:
    """The disk is full, said with what is left on it (as the failed write left it) and where it
    is mounted."""
    usage = shutil.disk_usage(directory)
    return (f"no space left on the device ({decimal_bytes(usage.free)} free of {decimal_bytes(usage.total)} on the "
            f"filesystem mounted at {mount_point(directory)}); free some space, or set run_root to another disk")


def _atomic_save(obj: Any, path: Path) -> dict:
    return _write_through(path, lambda writer: torch.save(obj, writer))


def _write_bytes(content: bytes, path: Path) -> dict:
    return _write_through(path, lambda writer: writer.write(content))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
