"""A run's synchronizer: ``python -m lowcomm.train.synchronizer RUN_DIR/config.yaml``, the process
that holds the global parameters and the outer optimizer of a method of learners
(:class:`~lowcomm.strategies.learners.LearnerStrategy`: Decoupled DiLoCo, asynchronous DiLoCo).

The launcher starts it before the learners (the local launcher itself; under torchrun start it
first, ``lowcomm-synchronizer RUN_DIR/config.yaml``), like the lighthouse of replica groups. It
listens on a port the kernel picks and writes its address to ``RUN_DIR/synchronizer.json``
(with its pid and learners), where the learners find it unless the launcher hands it to them in
``$LOWCOMM_SYNCHRONIZER``. It serves until every learner has said it is done, then writes what it
sent and received to the same record and exits.

**Its state resumes with the learners'.** Before it changes the global state with a contribution
a learner made after step S, where S is a checkpoint step of the run (``train.checkpoint_every``,
and the last step), it saves its state as of S (``RUN_DIR/synchronizer/step_<S>.pt``, written
atomically, the newest ``train.keep_checkpoints`` kept), and once every learner is done, as of
the step they ended at (the last, or a stop's). Started again, it loads the state saved at the step the learners resume from (the
oldest of their newest checkpoints). Where every merge holds every learner's contribution of the
same step (Decoupled DiLoCo under ``quorum: 0``, or one learner) merges happen in step order, so
that state is exactly the one the learners' checkpoints of step S met, and the run resumes bit for
bit; otherwise it holds what had arrived when the first later contribution did
(:meth:`~lowcomm.strategies.learners.LearnerStrategy.elastic_rule`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from lowcomm.comm.hub import Hub
from lowcomm.comm.meter import CommMeter
from lowcomm.config import RunConfig, load_run_config, validate
from lowcomm.models import build_model
from lowcomm.rundir import RunDir, list_checkpoints, write_json_atomic
from lowcomm.train.checkpoint import CheckpointError, _atomic_save, step_dir_name
from lowcomm.train.replicas import replica_run_dir

SYNCHRONIZER_ENV = "LOWCOMM_SYNCHRONIZER"
SYNCHRONIZER_HOST_ENV = "LOWCOMM_SYNCHRONIZER_HOST"  # the name its learners reach it by (default 127.0.0.1)
RECORD = "synchronizer.json"
STATE_DIR = "synchronizer"


def uses_synchronizer(run: RunConfig) -> bool:
    """Are this run's workers learners around a synchronizer?"""
    return bool(getattr(run.strategy_class, "learners", False))


def learner_dir(run: RunConfig, learner: int) -> Path:
    """Learner ``learner``'s records: the run's directory for learner 0 (what the reports read),
    ``<run_dir>/replicas/<m>`` for the others (as a replica group's)."""
    return replica_run_dir(run.run_dir, learner)


def learners_with_checkpoints(run_dir: Path) -> int:
    """How many learners of an earlier launch left checkpoints (learners 0, 1, ... in turn)."""
    count = 0
    while list_checkpoints(RunDir(replica_run_dir(run_dir, count)).checkpoints):
        count += 1
    return count


def resume_step(run: RunConfig) -> int:
    """The step the learners resume from: the oldest of the newest checkpoints of the learners
    that wrote any (0: none)."""
    written = learners_with_checkpoints(run.run_dir)
    newest = [int(list_checkpoints(RunDir(replica_run_dir(run.run_dir, m)).checkpoints)[0].name.split("_")[1])
              for m in range(written)]
    return min(newest, default=0)


def synchronizer_resumed_from(run_dir: Path) -> tuple[int, int] | None:
    """(the step the run's synchronizer resumed from, how many learners had checkpoints then), by
    its record, written before any learner of this launch started (None: no record). A learner
    that counted for itself could count a peer's first checkpoint of this launch."""
    try:
        found = json.loads((Path(run_dir) / RECORD).read_text())
        return int(found["resumed_from"]), int(found["learners_with_checkpoints"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def state_path(run: RunConfig, step: int) -> Path:
    return Path(run.run_dir) / STATE_DIR / f"{step_dir_name(step)}.pt"


def launch_tag() -> str:
    """Which launch a record belongs to: under SLURM the job and its restart (a requeued job's
    learners must not take its last attempt's address), else empty."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT', '0')}" if job else ""


def synchronizer_address(run_dir: Path, wait_s: float = 0.0) -> str:
    """The run's synchronizer: ``$LOWCOMM_SYNCHRONIZER``, else its record, waited for at most ``wait_s``."""
    if address := os.environ.get(SYNCHRONIZER_ENV):
        return address
    record = Path(run_dir) / RECORD
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = json.loads(record.read_text())
            if "address" in found and "finished" not in found and found.get("launch") == launch_tag():
                return str(found["address"])
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the run's workers are learners of a synchronizer, but none is running: neither "
                               f"${SYNCHRONIZER_ENV} nor a live {record} (the local launcher starts one; under "
                               f"torchrun start `lowcomm-synchronizer RUN_DIR/config.yaml` first)")
        time.sleep(0.2)


class SynchronizerProcess:
    """The synchronizer of ``run``: its state (the strategy's), its hub and its saved states."""

    def __init__(self, run: RunConfig, host: str = "0.0.0.0", advertise: str = "127.0.0.1"):
        self.run = run
        self.learners = run.world_size
        model = build_model(run.model, "cpu", seed=run.seed)  # the learners' initial parameters
        if run.train.param_dtype == "bf16":  # as the learners hold them
            model = model.to(torch.bfloat16)
        self.role = run.strategy_class.make_synchronizer(run.optimizer, model, self.learners)
        train = run.train
        every = train.checkpoint_every or train.max_steps
        self.due = sorted({*range(every, train.max_steps + 1, every), train.max_steps})
        self.resumed_from = resume_step(run)
        self.written_by = learners_with_checkpoints(run.run_dir)
        if self.resumed_from:
            path = state_path(run, self.resumed_from)
            if not path.is_file():
                raise CheckpointError(f"the learners resume from step {self.resumed_from}, but the synchronizer's "
                                      f"state of that step is not there: {path}")
            try:
                self.role.load_state_dict(torch.load(path, weights_only=False))
            except Exception as exc:  # noqa: BLE001 - a file torch cannot read, named
                raise CheckpointError(f"the synchronizer's state {path} cannot be read: {exc}") from exc
        self.due = [step for step in self.due if step > self.resumed_from]
        self.meter = CommMeter()
        self.hub = Hub(host, 0, meter=self.meter)
        self.address = f"{advertise}:{self.hub.port}"

    def _before(self, step: int) -> None:
        """A contribution made after ``step`` is about to change the state: save it as of every
        checkpoint step before that not saved yet."""
        while self.due and self.due[0] < step:
            self._save(self.due.pop(0))

    def _save(self, step: int) -> None:
        path = state_path(self.run, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(self.role.state_dict(), path)
        saved = sorted(path.parent.glob("step_*.pt"))
        for old in saved[:max(0, len(saved) - self.run.train.keep_checkpoints)]:
            old.unlink(missing_ok=True)

    def record(self, **fields) -> None:
        write_json_atomic(Path(self.run.run_dir) / RECORD, {
            "address": self.address, "pid": os.getpid(), "learners": self.learners,
            "method": self.run.strategy_class.name, "resumed_from": self.resumed_from,
            "learners_with_checkpoints": self.written_by, "launch": launch_tag(),
            **fields})

    def serve(self) -> dict:
        """Serve until every learner is done; returns the record's final fields."""
        self.record()
        started = time.monotonic()
        self.role.serve(self.hub, learners=self.learners, before=self._before,
                        idle_timeout_s=self.run.cluster.collective_timeout_s)
        # every learner is done: the state is that of the step they ended at (their newest
        # checkpoints, the last step or a stop's), which a rerun resumes from
        ended = resume_step(self.run)
        while self.due and self.due[0] <= ended:
            self._save(self.due.pop(0))
        if ended and not state_path(self.run, ended).is_file():
            self._save(ended)
        self.hub.close()
        totals = {kind: self.meter.cumulative_bytes(kind) for kind in ("payload", "tx", "rx")}
        control = {kind: self.meter.cumulative_bytes(kind, purpose="control") for kind in ("tx", "rx")}
        final = {"finished": True, "served_s": round(time.monotonic() - started, 3),
                 "sent_MB": totals["tx"] / 1e6, "received_MB": totals["rx"] / 1e6,
                 "bytes": totals, "control_bytes": control}
        self.record(**final)
        return final


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lowcomm.train.synchronizer RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    run = validate(load_run_config(argv[0]))
    try:
        process = SynchronizerProcess(run, advertise=os.environ.get(SYNCHRONIZER_HOST_ENV, "127.0.0.1"))
    except CheckpointError as exc:
        print(f"[lowcomm] synchronizer: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"[lowcomm] synchronizer of {process.learners} learners ({run.strategy_class.name}) at {process.address}"
          + (f", resumed from its state of step {process.resumed_from}" if process.resumed_from else ""), flush=True)
    final = process.serve()
    print(f"[lowcomm] synchronizer done: sent {final['sent_MB']:.2f} MB, received {final['received_MB']:.2f} MB",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
