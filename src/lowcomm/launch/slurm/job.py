"""Inside a SLURM job: one lowcomm worker per task, and preemption handled at step boundaries.

Preemption (and the time limit): see :mod:`lowcomm.launch.slurm`. The handler installed here
only sets a flag; the training loop reads it at every step boundary, the ranks agree through
one all-reduce, write a checkpoint together and return, and only then does rank 0 hand over to
submitit's own handler, which requeues the job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

import submitit

from lowcomm.comm.ft import FT_RECORD
from lowcomm.config import load_run_config, validate
from lowcomm.distenv import DistEnv, setup_distributed_from_slurm
from lowcomm.launch.local import replica_lighthouse, start_synchronizer
from lowcomm.launch.slurm.queue import PENDING_STATES, RUNNING_STATES
from lowcomm.train.loop import RunDiverged, train
from lowcomm.train.peers import EXIT_PEERS_LOST, PeersLost
from lowcomm.train.replicas import REPLICA_GROUP_ENV
from lowcomm.train.stop import AnyStop, StopFlag
from lowcomm.train.worker import (
    BAD_INPUT,
    EXIT_BAD_INPUT,
    describe_failure,
    last_words,
    leave_now,
    watch_sigterm,
)


class PreemptionFlag(StopFlag):
    """The stop request of SLURM's preemption signal (:class:`lowcomm.train.stop.StopFlag`).

    Saving, collectives and requeueing all happen later, in the task's normal flow.
    :meth:`install` puts it in place of the handler submitit installed for the same signal and
    keeps that one for :meth:`hand_over`.
    """

    @classmethod
    def install(cls, signal_name: str | None = None) -> PreemptionFlag:
        """Handle ``signal_name`` (default: submitit's, ``$SUBMITIT_PREEMPT_SIGNAL`` else USR2)."""
        name = (signal_name or os.environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2").removeprefix("SIG")
        return super().install(getattr(signal, f"SIG{name}"))

    def hand_over(self) -> NoReturn:
        """After the preemption checkpoint: let submitit requeue the job, then leave.

        On global rank 0 the displaced submitit handler pickles the callable for the requeued
        job, runs ``scontrol requeue`` and exits (or raises when it may not requeue, e.g. too
        many time-outs: the task then ends with that error). On the other ranks it does nothing,
        and the task exits with status 0 and no result, so that neither a result file nor a
        failed task (``srun --kill-on-bad-exit``) can end the job before rank 0 has requeued it.
        """
        (signum,) = self.signums
        if callable(displaced := self._displaced.get(signum)):
            displaced(signum, None)
        raise SystemExit(0)


class TrainingJob(submitit.helpers.Checkpointable):
    """What every task of a lowcomm SLURM job runs: one rank of the run in ``config_path``.

    Checkpointable: submitit resubmits the same callable (the config path is all its state) when
    it requeues the job; the training loop finds its own checkpoints in the run directory.
    Returns the run's summary (the same dict as ``summary.json``) from every rank.

    ``replica_group``: under ``cluster.fault_tolerance=torchft`` the job is that replica group
    alone (a node of the run's ranks, one element of the run's job array), which is requeued
    apart from the others (:func:`lowcomm.launch.slurm.submit.submit_training`).
    """

    def __init__(self, config_path: str, replica_group: int | None = None) -> None:
        self.config_path = config_path
        self.replica_group = replica_group

    def __call__(self) -> dict[str, Any]:
        # First, so that a signal arriving during start-up is not lost; submitit's handler,
        # installed before this call, is kept for after the checkpoint.
        stop = PreemptionFlag.install()
        # SIGTERM: the job is ending (scancel, the time limit reached, a preemption, a node
        # drained), and SIGKILL follows after KillWait. submitit only logs it ("Bypassing signal
        # SIGTERM"), which loses every step since the last periodic checkpoint; here the ranks
        # stop at the next step boundary with a checkpoint, as on the preemption signal, if that
        # boundary comes within TERM_BOUNDARY_S (else each leaves saying so). They do not requeue:
        # SLURM decides (a preempted job under PreemptMode=REQUEUE is requeued by SLURM itself;
        # a cancelled one stays cancelled).
        term = StopFlag.install(signal.SIGTERM)
        rank, _, _, _ = setup_distributed_from_slurm()
        if self.replica_group is not None:  # this job's world is the group's (lowcomm.train.replicas.group_place)
            os.environ[REPLICA_GROUP_ENV] = str(self.replica_group)
        if rank != 0:
            warnings.filterwarnings("ignore")
        # lowcomm's loggers only: submitit's logger writes to the same task log by itself.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        lowcomm_log = logging.getLogger("lowcomm")
        lowcomm_log.addHandler(handler)
        lowcomm_log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        try:
            run = validate(load_run_config(self.config_path))
            watch_sigterm(term, rank, run.run_dir)
            # either flag stops the run; the loop honours both where it leaves (a SIGTERM's deadline)
            # a method of learners: their synchronizer, started by the job's first rank on its node
            synchronizer = start_synchronizer(run, Path(self.config_path), host=socket.gethostname()) \
                if rank == 0 else None
            try:
                result = train(run, DistEnv.from_environ(), should_stop=AnyStop(stop, term))
            finally:
                if synchronizer is not None:
                    synchronizer.stop()
        except PeersLost as lost:
            if term.requested:  # the job is ending anyway: no requeue from here
                if lost.reports:
                    print(lost.line("not requeued: the job is ending (SIGTERM)"), flush=True)
                lost.leave()
                leave_now(128 + signal.SIGTERM)
            leave_after_loss(lost)
        except BAD_INPUT as exc:
            # data or a config that does not fit, found on this node (a file missing here): one
            # line and 2, as before a submission; not requeued, rerunning would find it again
            last_words(rank, describe_failure(exc)[0])
            raise SystemExit(EXIT_BAD_INPUT) from None
        if result.diverged is not None:  # the job fails, not requeued: rerunning it would diverge again
            raise RunDiverged(result.run_dir, result.diverged)
        if result.preempted and stop.requested:
            print(f"[lowcomm] rank {rank}: checkpoint at step {result.final_step} written; "
                  "leaving the job to be requeued", flush=True)
            stop.hand_over()
        if result.preempted:  # SIGTERM alone: no result, so that submitit does not take the run as done
            print(f"[lowcomm] rank {rank}: SIGTERM: checkpoint at step {result.final_step} written; the job is "
                  "ending (cancelled, out of time or preempted); the run resumes from it when SLURM requeues the job "
                  "or the run is submitted again", flush=True)
            raise SystemExit(128 + signal.SIGTERM)
        return result.summary


class LighthouseJob:
    """The torchft lighthouse of a run whose replica groups are SLURM jobs (the elements of a job
    array named after the run, which start once this job has: ``--dependency=after``): one task,
    no GPU. It records its address (this node's hostname) in the run's ``torchft.json``, where
    the groups' workers wait for it, and serves until no other job of the run's name is pending
    or running (having seen one, or after ``UNSEEN_GROUPS_S``); then it removes its record.

    Not checkpointable: at its time limit it ends rather than coming back at another address
    the running groups would not read (a preemption requeues it, as submitit does any job).
    """

    def __init__(self, config_path: str, run_name: str) -> None:
        self.config_path = config_path
        self.run_name = run_name

    def __call__(self) -> dict[str, Any]:
        run = validate(load_run_config(self.config_path))
        job_id = submitit.JobEnvironment().job_id
        lighthouse = replica_lighthouse(run, host=socket.gethostname(), lighthouse_job=job_id)
        started, seen = time.monotonic(), False
        try:
            while True:
                queued = others_queued(self.run_name, job_id)
                seen = seen or queued
                if not queued and (seen or time.monotonic() - started > UNSEEN_GROUPS_S):
                    break
                time.sleep(GROUPS_POLL_S)
        finally:
            lighthouse.shutdown()
            record = Path(run.run_dir) / FT_RECORD
            with contextlib.suppress(OSError, ValueError):
                if json.loads(record.read_text()).get("lighthouse_job") == job_id:
                    record.unlink()  # a group that starts later must not find a dead address
        print(f"[lowcomm] no job named {self.run_name} is pending or running: lighthouse stopped", flush=True)
        return {"lighthouse_job": job_id}


# How often the lighthouse job looks whether any of its replica groups' jobs is still queued, and
# how long it waits for one it has not seen yet (the array is submitted right after it)
GROUPS_POLL_S = 10.0
UNSEEN_GROUPS_S = 300.0


def others_queued(job_name: str, own_id: str) -> bool:
    """Whether a job named ``job_name`` other than ``own_id`` is pending or running; True when
    squeue cannot say (a busy controller must not stop the lighthouse of running groups)."""
    try:
        shown = subprocess.run(["squeue", "--noheader", "--states=all", f"--name={job_name}", "--format=%i|%T"],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if shown.returncode != 0:
        return True
    listed = (line.split("|", 1) for line in shown.stdout.splitlines() if "|" in line)
    return any(job != own_id and (state in PENDING_STATES or state in RUNNING_STATES) for job, state in listed)


def leave_after_loss(lost: PeersLost) -> NoReturn:
    """A task whose collective lost peers (:mod:`lowcomm.train.peers`): the lowest surviving
    rank of each node prints the line, the lowest of all requeues the job, counted like a
    time-out against ``cluster.max_requeues`` (a node that keeps failing must not requeue
    forever); once those are used up it cancels the job, which would otherwise hold its
    allocation until the time limit (a stopped rank, or one on an unreachable node, never
    exits). SLURM's requeue ends every task of the job; the requeued job resumes from the last
    checkpoint. The task leaves without a result, so submitit does not take it for finished."""
    job = submitit.JobEnvironment()
    action = None
    if lost.leads and requeued_since_start(job.job_id):
        # another survivor (across a network partition, each side leads its own) got there first
        next_step = f"job {job.job_id} is already requeued and resumes from it"
    elif lost.leads:
        delayed = submitit.helpers.DelayedSubmission.load(job.paths.submitted_pickle)
        remaining = delayed._timeout_countdown - 1  # noqa: SLF001 - submitit's own count of requeues left
        if remaining >= 0:
            again = delayed._checkpoint_function()  # noqa: SLF001 - what submitit's handler pickles
            again.set_timeout(delayed._timeout_min, remaining)  # noqa: SLF001
            with submitit.core.utils.temporary_save_path(job.paths.submitted_pickle) as tmp:
                again.dump(tmp)
            action = ["scontrol", "requeue", job.job_id]
            next_step = (f"requeueing job {job.job_id}, which resumes from it "
                         f"({remaining} more requeue{'s' if remaining != 1 else ''} allowed, cluster.max_requeues)")
        else:
            action = ["scancel", job.job_id]
            next_step = (f"not requeued: the requeues allowed (cluster.max_requeues) are used up; cancelling job "
                         f"{job.job_id}: submit the run again to resume")
    else:
        next_step = f"rank {lost.diagnosis.survivors[0]} requeues the job"
    if lost.reports:
        print(lost.line(next_step), flush=True)
    if action is not None:  # before the farewells: the other tasks' exit must not end the job first
        done = subprocess.run(action, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            print(f"[lowcomm] {' '.join(action)} failed: {done.stderr.strip()}", flush=True)
    lost.leave()
    # os._exit: the process group's threads may still be tied to the lost peers, and a normal
    # exit would write no result either way
    leave_now(EXIT_PEERS_LOST)


def requeued_since_start(job_id: str) -> bool:
    """Whether SLURM restarted job ``job_id`` since this task started (its ``Restarts`` count is
    above the ``SLURM_RESTART_COUNT`` this task was started with)."""
    started = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    restarts = re.search(r"\bRestarts=(\d+)", shown.stdout)
    return restarts is not None and int(restarts.group(1)) > started
