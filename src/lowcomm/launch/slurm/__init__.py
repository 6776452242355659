"""SLURM through submitit: submission of training runs, the job and its preemption, the queue.

- :mod:`.submit` (on the submitting machine): :func:`submitit_parameters` turns a cluster
  profile (``configs/cluster/*.yaml``, checked by :func:`lowcomm.config.slurm_profile`) into the
  keyword arguments of ``submitit.AutoExecutor.update_parameters`` and :func:`make_executor`
  builds the executor;
- :func:`submit_training` sends one validated run to SLURM as one job (``lowcomm-train
  cluster=slurm_64gpu ...`` goes through :func:`submit_run`; ``lowcomm-sweep`` submits a sweep,
  one job per point): it materialises the data and writes the run's ``config.yaml`` first, so
  the ranks never race to build them, and skips a run that is finished (``summary.json``) or
  already queued (a job named after the run, or the job id recorded in the run directory);
- :mod:`.queue`: :func:`run_state` says where a run stands (done / running / pending / failed /
  not submitted) from ``squeue`` and the run directory.
- :mod:`.job`: inside every task of the job, :class:`TrainingJob` runs one lowcomm worker:
  :func:`lowcomm.distenv.setup_distributed_from_slurm` exports the ``env://`` variables
  torch.distributed reads (rank and world from SLURM; NCCL on GPUs, gloo otherwise).

Why a thin launcher of our own rather than Hydra multirun with hydra-submitit-launcher: that
launcher runs the ``@hydra.main`` task function in every SLURM task, so every rank re-composes
the config and writes its own ``.hydra/`` output (racing on a shared filesystem), while lowcomm
composes and validates once, in the submitting process, before anything is submitted. Its
sweeps are one job array built from the command line, so a job cannot carry its run's name,
finished or queued runs cannot be skipped on resubmission, and an invalid point is only found
on the cluster. Its ``checkpoint()`` requeues from a signal handler on rank 0, which cannot
write a checkpoint all ranks take part in. Here a sweep is a file (``sweeps/``), each job is
named after its deterministic run name, and preemption is handled as below.

Preemption (and the time limit): SLURM sends ``signal`` (``--signal=USR2@<signal_delay_s>``,
without ``B:``, so every task gets it) ``signal_delay_s`` seconds before it stops the job.
submitit's own handler would checkpoint the callable and ``scontrol requeue`` the job right
there, on rank 0 only, while training goes on: everything since the last periodic checkpoint
would be lost, and a checkpoint cannot be written from a signal handler (all ranks write it
together). So :class:`TrainingJob` replaces that handler with one that only sets a flag
(:class:`PreemptionFlag`); the training loop reads it at every step boundary, the ranks agree
through one all-reduce, write a checkpoint together and return. Only then does rank 0 call the
submitit handler it displaced, which counts a time-out against ``max_requeues`` (preemptions
are requeued without limit), pickles the same callable (``checkpoint()``), requeues the job
(same job id) and exits; the other ranks exit without a result. The requeued job starts from
scratch and the training loop resumes from that checkpoint.
"""

from __future__ import annotations

from lowcomm.config import slurm_profile
from lowcomm.distenv import setup_distributed_from_slurm
from lowcomm.launch.slurm.job import LighthouseJob, PreemptionFlag, TrainingJob
from lowcomm.launch.slurm.queue import (
    PENDING_STATES,
    RUNNING_STATES,
    Queue,
    QueuedJob,
    RunState,
    SlurmUnavailable,
    last_logged,
    last_submission,
    run_state,
)
from lowcomm.launch.slurm.submit import (
    ENVIRONMENT_DEFAULTS,
    Submission,
    batch_script,
    check_profile,
    lighthouse_shape,
    make_executor,
    replica_group_shape,
    srun_line,
    submit_run,
    submit_training,
    submitit_parameters,
)

__all__ = [
    "ENVIRONMENT_DEFAULTS", "PENDING_STATES", "RUNNING_STATES", "LighthouseJob", "PreemptionFlag", "Queue", "QueuedJob",
    "RunState", "SlurmUnavailable", "Submission", "TrainingJob", "batch_script", "check_profile", "last_logged",
    "last_submission", "lighthouse_shape", "make_executor", "replica_group_shape", "run_state", "setup_distributed_from_slurm", "slurm_profile",
    "srun_line", "submit_run", "submit_training", "submitit_parameters",
]
