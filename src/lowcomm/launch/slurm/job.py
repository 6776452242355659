"""Inside a SLURM job: one lowcomm worker per task, and preemption handled at step boundaries.

Preemption (and the time limit): see :mod:`lowcomm.launch.slurm`. The handler installed here
only sets a flag; the training loop reads it at every step boundary, the ranks agree through
one all-reduce, write a checkpoint together and return, and only then does rank 0 hand over to
submitit's own handler, which requeues the job.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings
from typing import Any, NoReturn

import submitit

from lowcomm.config import load_run_config, validate
from lowcomm.distenv import DistEnv, setup_distributed_from_slurm
from lowcomm.train.loop import train
from lowcomm.train.stop import StopFlag


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
        if callable(self._displaced):
            self._displaced(self.signum, None)
        raise SystemExit(0)


class TrainingJob(submitit.helpers.Checkpointable):
    """What every task of a lowcomm SLURM job runs: one rank of the run in ``config_path``.

    Checkpointable: submitit resubmits the same callable (the config path is all its state) when
    it requeues the job; the training loop finds its own checkpoints in the run directory.
    Returns the run's summary (the same dict as ``summary.json``) from every rank.
    """

    def __init__(self, config_path: str) -> None:
        self.config_path = config_path

    def __call__(self) -> dict[str, Any]:
        # First, so that a signal arriving during start-up is not lost; submitit's handler,
        # installed before this call, is kept for after the checkpoint.
        stop = PreemptionFlag.install()
        rank, _, _, _ = setup_distributed_from_slurm()
        if rank != 0:
            warnings.filterwarnings("ignore")
        # lowcomm's loggers only: submitit's logger writes to the same task log by itself.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        lowcomm_log = logging.getLogger("lowcomm")
        lowcomm_log.addHandler(handler)
        lowcomm_log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        run = validate(load_run_config(self.config_path))
        result = train(run, DistEnv.from_environ(), should_stop=stop)
        if result.preempted:
            print(f"[lowcomm] rank {rank}: checkpoint at step {result.final_step} written; "
                  "leaving the job to be requeued", flush=True)
            stop.hand_over()
        return result.summary
