"""The local launcher: W worker subprocesses on this machine, joined by gloo (NCCL on GPUs).

Like torchrun, but it validates and materialises everything first (config, data) in the
parent, so a bad config fails before any worker starts, and W workers never race to build
the synthetic corpus. If any worker dies the others are stopped and the error names the rank.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lowcomm.comm.spawn import free_port
from lowcomm.config import ConfigError, RunConfig, load_run_config
from lowcomm.config.naming import changed_keys, what_is_trained
from lowcomm.data import materialize
from lowcomm.data.fingerprint import check_unchanged
from lowcomm.launch.lock import RunDirLock
from lowcomm.rundir import RunDir, list_checkpoints
from lowcomm.train.loop import EXIT_DIVERGED, RunDiverged
from lowcomm.train.peers import EXIT_PEERS_LOST
from lowcomm.train.worker import LAUNCHED_LOCALLY


class Interrupted(RuntimeError):
    """Ctrl-C (SIGINT) or SIGTERM: the workers stopped at a step boundary with a checkpoint, or,
    when they could not reach one in time, were stopped with the checkpoints they had."""

    def __init__(self, run_dir: Path, checkpoint: Path | None, signum: int = signal.SIGINT, *,
                 in_time: bool = True):
        self.run_dir, self.checkpoint, self.signum = run_dir, checkpoint, signum
        name = signal.Signals(signum).name
        if checkpoint is None:
            where = f"stopped before a checkpoint was written ({run_dir}); nothing to resume yet"
        elif in_time:
            where = f"stopped with a checkpoint at {checkpoint}; run the same command to resume"
        else:
            where = (f"the workers did not reach a step boundary in time and were stopped; the latest checkpoint "
                     f"is {checkpoint}; run the same command to resume from it")
        super().__init__(f"interrupted ({name}): {where}" if signum != signal.SIGINT else f"interrupted: {where}")

    @property
    def exit_status(self) -> int:
        """The shell's status for death by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


class _Terminated(BaseException):
    """SIGTERM reached the launcher (``kill``, ``timeout``, ``docker stop``, systemd, SLURM's end
    of a job): handled as Ctrl-C is."""


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise _Terminated


class WorkerFailure(RuntimeError):
    def __init__(self, rank: int, returncode: int):
        self.rank, self.returncode = rank, returncode
        # a worker that lost its peers, or whose run diverged, has printed the line that says so
        self.reported = returncode in (EXIT_PEERS_LOST, EXIT_DIVERGED)
        how = f"killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        if self.reported:
            how = ("stopped: the run diverged (see the line above)" if returncode == EXIT_DIVERGED
                   else "stopped: it lost peers (see the line above)")
        if returncode == -signal.SIGBUS:
            how += " (SIGBUS: a memory-mapped data file shrank or changed while the run read it)"
        super().__init__(f"worker rank {rank} {how}")


# What a resume that changed where or how the run logs (cluster, wandb, logistics) gives its
# workers; config.yaml stays the record of how the run started.
RESUME_CONFIG = "config.resume.yaml"


def check_same_run(run: RunConfig) -> None:
    """Before anything is written: a run directory that already holds a run (its config.yaml)
    takes only that run. Raises ConfigError listing what changed (``optimizer.lr: 0.0004 ->
    0.1``). Without an explicit run_name a changed config gets another name, hence another
    directory; this is for the run_name a user chose."""
    saved_path = RunDir(run.run_dir).config
    if not saved_path.is_file():
        return
    saved = OmegaConf.to_container(load_run_config(saved_path), resolve=True)
    changes = changed_keys(what_is_trained(saved), what_is_trained(run.raw))
    if changes:
        raise ConfigError([f"{run.run_dir} holds another run (run_name={run.run_name}); this config changes "
                           + "; ".join(changes) + ". Choose another run_name for it, or remove the directory "
                           "to start that run again"])


def write_run_config(run: RunConfig) -> Path:
    """The config the workers read. A new run's is ``config.yaml``, the record of the run, which
    a resume never rewrites: a resume that changed where or how the run logs writes its own
    beside it (:data:`RESUME_CONFIG`)."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    path = RunDir(run.run_dir).config
    if path.is_file():
        if OmegaConf.to_container(OmegaConf.load(path), resolve=True) == run.raw:
            return path
        path = run.run_dir / RESUME_CONFIG
    tmp = path.with_suffix(".yaml.tmp")
    OmegaConf.save(OmegaConf.create(run.raw), tmp)
    os.replace(tmp, path)
    return path


def check_gpus(run: RunConfig) -> None:
    """Refuse, before anything is spawned, more GPU ranks than visible GPUs: a rank per GPU is
    NCCL's rule (two communicators on one device are rejected), and the default config asks for
    4 workers on ``device: auto``."""
    device, workers = run.cluster.device, run.cluster.workers
    if device == "cpu" or not (device == "cuda" or torch.cuda.is_available()):
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if workers > visible:
        raise ValueError(
            f"cluster.workers={workers} with cluster.device={device} needs one GPU per worker, but "
            f"{visible} {'is' if visible == 1 else 'are'} visible: set cluster.workers<={visible} "
            "or cluster.device=cpu"
        )


def launch_local(run: RunConfig, *, extra_env: dict[str, str] | None = None) -> Path:
    """Run ``run`` on ``cluster.workers`` local processes; return the run directory.

    A finished run (it has its summary) is not started again: rerunning a command changes
    nothing. The run directory is locked for this launch (:mod:`lowcomm.launch.lock`)."""
    check_gpus(run)
    run_dir = RunDir(run.run_dir)
    if (summary := run_dir.read_summary()) is not None:
        if summary.get("diverged"):
            raise RunDiverged(run.run_dir, summary["diverged"])
        print(f"[lowcomm] {run.run_name} is complete ({run_dir.summary}): {summary['steps']} steps, "
              f"final val loss {summary['final_val_loss']:.4f}; nothing to do", flush=True)
        return run.run_dir
    with RunDirLock(run.run_dir):
        return _launch(run, extra_env)


def prepare_run_dir(run: RunConfig) -> Path:
    """Before any worker starts: the data exists (generated or tokenized once), is the data the
    run's checkpoints were trained on, the directory holds no other run, and the config is
    written. Returns the path of the config the workers read."""
    check_same_run(run)
    files = materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    resuming = bool(list_checkpoints(RunDir(run.run_dir).checkpoints))
    check_unchanged(run.run_dir, [*files["train"], *files["val"]], resuming=resuming)
    return write_run_config(run)


def _launch(run: RunConfig, extra_env: dict[str, str] | None) -> Path:
    config_path = prepare_run_dir(run)
    world = run.cluster.workers
    base_env = {**os.environ, **(extra_env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), LAUNCHED_LOCALLY: "1"}
    procs = []
    for rank in range(world):
        env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, "-m", "lowcomm.train.worker", str(config_path)], env=env,
                                      preexec_fn=_die_with_parent))
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        try:
            _wait_all(procs)
        except (KeyboardInterrupt, _Terminated, WorkerFailure) as exc:
            if isinstance(exc, WorkerFailure) and exc.returncode not in _STOPPED_BY_SIGNAL:
                raise
            # Ctrl-C, SIGTERM, or workers that a signal stopped by themselves (the launcher did
            # not see it): every worker checkpoints at the same step boundary
            signum = (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
                      if isinstance(exc, KeyboardInterrupt) else exc.returncode - 128)
            in_time = _finish_interrupted(procs, signum, interrupt_grace_s(run, signum))
            checkpoints = list_checkpoints(RunDir(run.run_dir).checkpoints)
            raise Interrupted(run.run_dir, checkpoints[0] if checkpoints else None, signum,
                              in_time=in_time) from None
    except BaseException:
        _stop_all(procs)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return run.run_dir


# A worker that a stop signal reached checkpoints at the next step boundary and exits with the
# signal's conventional status (lowcomm.train.worker).
_STOPPED_BY_SIGNAL = (128 + signal.SIGINT, 128 + signal.SIGTERM)
# How long the workers may take to reach a step boundary and write their checkpoint after
# SIGTERM: under SLURM's default KillWait (30 s) and systemd's stop timeout (90 s), so that the
# checkpoint is written before the SIGKILL that follows. (docker stop waits 10 s: give it
# --time 30.)
TERM_GRACE_S = 25


def interrupt_grace_s(run: RunConfig, signum: int) -> float:
    """How long the launcher waits for the step boundary after a stop signal: after SIGTERM
    :data:`TERM_GRACE_S`; after Ctrl-C a step and its checkpoint, bounded by the collective
    timeout (a rank that never reaches the boundary makes the others give up within it)."""
    return TERM_GRACE_S if signum == signal.SIGTERM else run.cluster.collective_timeout_s + 30


def _finish_interrupted(procs: list[subprocess.Popen], signum: int, grace_s: float) -> bool:
    """After a stop signal: let the workers checkpoint at their next step boundary. In a terminal
    they received Ctrl-C's SIGINT themselves; a launcher signalled alone passes the signal on.
    A second Ctrl-C or SIGTERM, or ``grace_s`` passing, stops them at once. Returns whether they
    finished in time."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    print(f"[lowcomm] interrupted: the workers write a checkpoint at the next step boundary (at most "
          f"{grace_s:.0f} s; Ctrl-C again to stop them at once)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + grace_s
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except (KeyboardInterrupt, _Terminated, subprocess.TimeoutExpired):
        _stop_all(procs)
        return False
    return True


def _die_with_parent() -> None:
    """In the worker, before exec: have the kernel kill it when the launcher dies (SIGKILL of the
    launcher would otherwise leave orphans training into the run directory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _wait_all(procs: list[subprocess.Popen]) -> None:
    pending = set(range(len(procs)))
    while pending:
        for rank in sorted(pending):
            code = procs[rank].poll()
            if code is None:
                continue
            pending.discard(rank)
            if code != 0:
                raise WorkerFailure(rank, code)
        time.sleep(0.05)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """Stop the workers at once: SIGKILL (a worker treats SIGTERM as a request to checkpoint at
    the next step boundary; what it wrote before is safe, checkpoints are written atomically)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
