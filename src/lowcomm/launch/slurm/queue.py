"""The SLURM queue as lowcomm reads it, and the state of a run (its directory plus the queue)."""

from __future__ import annotations

import dataclasses
import getpass
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from lowcomm.rundir import SLURM_DIR, SUBMISSIONS_FILE, RunDir
from lowcomm.runlock import holder as lock_holder

# squeue states of a job that is, or will be, running (everything else is final).
PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD"})
RUNNING_STATES = frozenset(
    {"CONFIGURING", "RUNNING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
)


class SlurmUnavailable(RuntimeError):
    """squeue or sbatch cannot be run here (no SLURM client, or the controller does not answer)."""


@dataclasses.dataclass(frozen=True)
class QueuedJob:
    job_id: str
    name: str
    state: str  # squeue's long form: PENDING, RUNNING, COMPLETED, CANCELLED, ...

    @property
    def active(self) -> bool:
        return self.state in PENDING_STATES or self.state in RUNNING_STATES


@dataclasses.dataclass(frozen=True)
class Queue:
    """One squeue listing of the user's jobs, recent finished ones included (MinJobAge)."""

    jobs: tuple[QueuedJob, ...]

    @classmethod
    def read(cls, user: str | None = None) -> Queue:
        if shutil.which("squeue") is None:
            raise SlurmUnavailable("SLURM is not reachable from this machine: squeue is not installed "
                                   "(run this on the cluster's login node, or use cluster=local)")
        listed = subprocess.run(
            ["squeue", "--noheader", "--states=all", f"--user={user or getpass.getuser()}",
             "--format=%i|%T|%j"],
            capture_output=True, text=True, timeout=60,
        )
        if listed.returncode != 0:
            # squeue explains itself over several lines (DNS SRV look-ups ...); its last is the verdict
            lines = [line.strip() for line in listed.stderr.splitlines() if line.strip()]
            said = lines[-1] if lines else f"exit status {listed.returncode}"
            raise SlurmUnavailable(f"SLURM is not reachable from this machine: squeue could not reach a controller "
                                   f"({said}); run this on the cluster's login node, or use cluster=local")
        jobs = []
        for line in listed.stdout.splitlines():
            if line.strip():
                job_id, state, name = line.strip().split("|", 2)
                jobs.append(QueuedJob(job_id=job_id, name=name, state=state))
        return cls(tuple(jobs))

    def find(self, job_id: str | None = None, name: str | None = None, besides: str | None = None) -> QueuedJob | None:
        """The job with this id or name: an active one first (by its id before by its name, the
        newest), else the job with this id in a final state, else None. A job array's id finds
        its elements (``<id>_<i>``); ``besides`` is a job not to find (a run's lighthouse job,
        which has the run's name)."""

        def has_id(job: QueuedJob) -> bool:
            return job_id is not None and (job.job_id == job_id or job.job_id.startswith(f"{job_id}_"))

        by_id = [job for job in self.jobs if has_id(job)]
        by_name = [job for job in self.jobs if name is not None and job.name == name and not has_id(job)
                   and job.job_id != besides]
        for matching in (by_id, by_name):
            if active := [job for job in matching if job.active]:
                return active[-1]
        return by_id[-1] if by_id else None


@dataclasses.dataclass(frozen=True)
class RunState:
    """Where a run stands. ``status``: done | running | pending | failed | stopped (trained for a
    while, not by a job this run directory records, and no longer) | not submitted."""

    status: str
    job_id: str | None = None
    detail: str = ""  # e.g. the final queue state of a failed job, or who runs it here
    last_step: int | None = None
    last_loss: float | None = None  # training loss at last_step
    val_step: int | None = None
    val_loss: float | None = None  # the last validation loss logged (what the tables show)

    @property
    def active(self) -> bool:
        return self.status in ("running", "pending")


def last_submission(run_dir: Path) -> dict[str, Any] | None:
    """The newest record of ``<run_dir>/slurm/submissions.jsonl``, or None."""
    path = Path(run_dir) / SLURM_DIR / SUBMISSIONS_FILE
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else None


def last_logged(run_dir: Path, key: str = "train/loss") -> tuple[int | None, float | None]:
    """Step and value of the last ``key`` record in ``metrics.jsonl`` (default: the training loss)."""
    for record in reversed(RunDir(run_dir).read_metrics()):
        if key in record:
            return int(record["step"]), float(record[key])
    return None, None


def run_state(run_dir: Path, run_name: str, queue: Queue | None) -> RunState:
    """The state of the run in ``run_dir``; ``queue`` None when the queue cannot be read (or a
    local sweep's runs need none: a run training here holds its directory's lock)."""
    run_dir = Path(run_dir)
    step, loss = last_logged(run_dir)
    logged = {"last_step": step, "last_loss": loss}
    logged["val_step"], logged["val_loss"] = last_logged(run_dir, "val/loss")
    record = last_submission(run_dir)
    recorded_id = record["job_id"] if record else None
    if RunDir(run_dir).summary.is_file():
        return RunState("done", recorded_id, **logged)
    job = queue.find(job_id=recorded_id, name=run_name, besides=record.get("lighthouse_job") if record else None) \
        if queue is not None else None
    if job is not None and job.active:
        status = "pending" if job.state in PENDING_STATES else "running"
        return RunState(status, job.job_id, job.state, **logged)
    if (owner := lock_holder(run_dir)) is not None:  # a launcher on this machine, or one sharing the filesystem
        return RunState("running", recorded_id, owner, **logged)
    if record is None:
        return RunState("stopped" if step is not None else "not submitted", **logged)
    if queue is None:
        detail = "queue unknown"
    elif job is not None:
        detail = job.state
    else:
        detail = "no longer in the queue"
    return RunState("failed", recorded_id, detail, **logged)


