"""The local launcher: W worker subprocesses on this machine, joined by gloo (NCCL on GPUs).

Like torchrun, but it validates and materialises everything first (config, data) in the
parent, so a bad config fails before any worker starts, and W workers never race to build
the synthetic corpus. Like torchrun, it hosts the workers' rendezvous store itself.

If any worker fails the others are stopped, and one line says what happened: the rank that
failed first and why, from the words it left (:func:`lowcomm.train.worker.last_words`), not
what that caused in the others. Ctrl-C and SIGTERM make the workers checkpoint at the next
step boundary, within a bound (:func:`interrupt_grace_s`), and the launch ends with the
signal's status and a line that names the checkpoint a rerun resumes from.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from lowcomm.comm.ft import LIGHTHOUSE_ENV, lighthouse_url, record_lighthouse, start_lighthouse
from lowcomm.config import ConfigError, RunConfig, load_run_config
from lowcomm.config.data_checks import check_run_data
from lowcomm.config.naming import changed_keys, what_is_trained
from lowcomm.data import materialize
from lowcomm.distenv import DistEnv
from lowcomm.launch.signals import Terminated, sigterm_as_interrupt
from lowcomm.rundir import RunDir, list_checkpoints, resume_note
from lowcomm.runlock import RunDirLock
from lowcomm.train.checkpoint import TRAINER_FILE, layout_refusal
from lowcomm.train.loop import EXIT_DIVERGED, RunDiverged
from lowcomm.train.metrics import check_resumable
from lowcomm.train.peers import EXIT_PEERS_LOST
from lowcomm.train.synchronizer import RECORD as SYNCHRONIZER_RECORD
from lowcomm.train.synchronizer import SYNCHRONIZER_ENV, SYNCHRONIZER_HOST_ENV, uses_synchronizer
from lowcomm.train.worker import EXIT_BAD_INPUT, LAUNCHED_LOCALLY, words_file


class Interrupted(RuntimeError):
    """Ctrl-C (SIGINT) or SIGTERM: the workers stopped at a step boundary with a checkpoint
    (``written``), or did not, and ``why_not`` says why; the line names what a rerun resumes from
    either way."""

    def __init__(self, run_dir: Path, signum: int = signal.SIGINT, *, written: Path | None = None,
                 why_not: str | None = None):
        self.run_dir, self.signum, self.written, self.why_not = run_dir, signum, written, why_not
        what = "interrupted" if signum == signal.SIGINT else f"interrupted ({signal.Signals(signum).name})"
        if written is not None:
            where = f"stopped with a checkpoint at {written}; run the same command to resume"
        else:
            where = f"{why_not or 'no checkpoint was written at the stop'}; {resume_note(run_dir)}"
        super().__init__(f"{what}: {where}")

    @property
    def exit_status(self) -> int:
        """The shell's status for death by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum




class _StoppedBySignal(Exception):
    """Workers ended on a stop signal the launcher did not see (it ignores it: ``nohup``, a
    script's background job), with the signal's status."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class WorkerFailure(RuntimeError):
    """A worker failed: the one line that says what happened (:meth:`__str__`), for the rank
    whose failure came first (:func:`_root_cause`); ``detail``: its traceback when the cause is
    not a known one; ``cause``: the line without where the run resumes."""

    def __init__(self, rank: int, returncode: int, words: dict | None = None, run_dir: Path | None = None):
        self.rank, self.returncode = rank, returncode
        words = words or {}
        self.detail: str | None = words.get("detail")
        # a worker whose run diverged has printed the line that says so
        self.reported = returncode == EXIT_DIVERGED
        resumes = f"; {resume_note(run_dir)}" if run_dir is not None else ""
        if returncode < 0:
            name = signal_name(-returncode)
            self.cause = f"worker rank {rank} was killed by signal {-returncode} ({name})"
            if returncode == -signal.SIGBUS:
                self.cause += " (a memory-mapped data file shrank or changed while the run read it)"
            line = self.cause + resumes
        elif self.reported:
            self.cause = line = "the run diverged (see the line above)"
        elif words.get("lost"):  # a lost peer's line names the peers, the checkpoint and the rerun
            self.cause, line = words["cause"], words["line"]
        elif words:
            self.cause, line = f"worker rank {rank} failed: {words['cause']}", f"worker rank {rank} failed: {words['line']}"
        else:
            self.cause = f"worker rank {rank} exited with code {returncode}"
            line = self.cause + resumes
        super().__init__(line)

    @property
    def exit_status(self) -> int:
        """What the launcher exits with: a lost peer's EX_TEMPFAIL (rerunning resumes), a
        diverged run's EX_DATAERR or data that does not fit the run (2, as a bad config), as the
        worker did; 1 otherwise."""
        return self.returncode if self.returncode in (EXIT_PEERS_LOST, EXIT_DIVERGED, EXIT_BAD_INPUT) else 1


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number no signal has."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


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
    nothing. The run directory is locked for this launch (:mod:`lowcomm.runlock`)."""
    check_gpus(run)
    check_same_run(run)  # a finished run under the chosen run_name is no answer for a changed config
    run_dir = RunDir(run.run_dir)
    if (summary := run_dir.read_summary()) is not None:
        if summary.get("diverged"):
            raise RunDiverged(run.run_dir, summary["diverged"])
        print(f"[lowcomm] {run.run_name} is complete ({run_dir.summary}): {summary['steps']} steps, "
              f"final val loss {summary['final_val_loss']:.4f}; nothing to do", flush=True)
        return run.run_dir
    # SIGTERM is Ctrl-C (unless this process ignores it); both, before the workers start, stop
    # the launch with the line that says where a rerun resumes (the lock is released either way)
    try:
        with sigterm_as_interrupt(), RunDirLock(run.run_dir):
            return _launch(run, extra_env)
    except (KeyboardInterrupt, Terminated) as exc:
        signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
        raise Interrupted(run.run_dir, signum, why_not="before the workers started: nothing was trained") from None


def prepare_run_dir(run: RunConfig) -> Path:
    """Before any worker starts: the directory holds no other run, the data exists (generated
    or tokenized once), fits the model over every byte, is the data the run's checkpoints were
    trained on, and ``config.yaml`` is written. Returns the path of the config the workers read."""
    check_same_run(run)
    files = materialize(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    resuming = bool(list_checkpoints(RunDir(run.run_dir).checkpoints))
    if resuming:
        check_resumable(run.run_dir)
        check_world_size(run)
    check_run_data(run, files, resuming=resuming)
    return write_run_config(run)


def check_world_size(run: RunConfig) -> None:
    """Before a resume spawns anything: the newest checkpoint's per-rank state fits this run's
    ranks (:func:`lowcomm.train.checkpoint.layout_refusal`), refused once, as a config error,
    instead of by every rank for every checkpoint after they started. Another world size is
    allowed (each rank takes a peer's own state: :meth:`Strategy.elastic_rule`). A checkpoint
    whose record cannot be read is the workers' to judge (and fall back from)."""
    newest = list_checkpoints(RunDir(run.run_dir).checkpoints)[0]
    try:
        trainer = json.loads((newest / TRAINER_FILE).read_text())
        int(trainer["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    # the ranks per node as the workers will see them: torchrun's (this is rank 0's hook there)
    # where it started this process, else the launcher's own
    local_world_size = DistEnv.from_environ().local_world_size if DistEnv.present() else run.cluster.local_world_size
    layout = run.strategy_class.layout(run.optimizer, local_world_size)
    refusal = layout_refusal(newest / TRAINER_FILE, trainer, run.world_size, layout)
    if refusal:
        raise ConfigError([refusal])


def _launch(run: RunConfig, extra_env: dict[str, str] | None) -> Path:
    config_path = prepare_run_dir(run)
    world = run.cluster.workers
    store = rendezvous_store(world, run.cluster.collective_timeout_s)
    lighthouse = replica_lighthouse(run)
    synchronizer = start_synchronizer(run, config_path)
    # replica groups of several ranks meet in process groups of their own, each at its own store
    # (a new one when a group starts again: a store keeps the keys of the group that used it)
    ranks = run.cluster.ranks_per_group if lighthouse is not None else 1
    group_stores: dict[int, dist.TCPStore] = {}

    def fresh_store(group: int) -> None:
        group_stores[group] = rendezvous_store(ranks, run.cluster.collective_timeout_s)

    if ranks > 1:
        for group in range(world // ranks):
            fresh_store(group)
    with tempfile.TemporaryDirectory(prefix="lowcomm-words-") as words_dir:
        base_env = {**os.environ, **(extra_env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                    USE_LAUNCHER_STORE: "True", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                    LAUNCHED_LOCALLY: words_dir,
                    **({LIGHTHOUSE_ENV: lighthouse.address()} if lighthouse is not None else {}),
                    **({SYNCHRONIZER_ENV: synchronizer.address} if synchronizer is not None else {})}

        def start(rank: int) -> subprocess.Popen:
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            if ranks > 1:
                env["MASTER_PORT"] = str(group_stores[rank // ranks].port)
            return subprocess.Popen([sys.executable, "-m", "lowcomm.train.worker", str(config_path)],
                                    env=env, preexec_fn=_die_with_parent)

        procs = []
        try:
            procs.extend(start(rank) for rank in range(world))
            before = _newest_checkpoint(run.run_dir)
            rejoin = None if lighthouse is None else Rejoins(start, run.cluster.max_rejoins, Path(words_dir),
                                                             ranks_per_group=ranks, fresh_store=fresh_store)
            try:
                _wait_all(procs, Path(words_dir), run.run_dir, rejoin)
            except (KeyboardInterrupt, Terminated, _StoppedBySignal) as exc:
                # Ctrl-C, SIGTERM, or workers that a signal stopped by themselves (the launcher
                # did not see it): every worker checkpoints at the same step boundary
                signum = (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
                          if isinstance(exc, KeyboardInterrupt) else exc.signum)
                interrupted = _finish_interrupted(procs, run, signum, Path(words_dir), before)
                if interrupted is not None:
                    raise interrupted from None
        finally:
            _stop_all(procs)
            del store
            group_stores.clear()
            if lighthouse is not None:
                lighthouse.shutdown()
            if synchronizer is not None:
                synchronizer.stop()
    return run.run_dir


class SynchronizerHandle:
    """The synchronizer process of a launch (:mod:`lowcomm.train.synchronizer`) and its address."""

    def __init__(self, process: subprocess.Popen, address: str):
        self.process, self.address = process, address

    def stop(self, wait_s: float = 60.0) -> int | None:
        """Once the learners have ended: the synchronizer ends by itself when each has said it is
        done (or, lost, after its idle timeout); stopped after ``wait_s``. Its exit status."""
        try:
            return self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                return self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()


def start_synchronizer(run: RunConfig, config_path: Path, *, host: str = "127.0.0.1",
                       wait_s: float = 120.0) -> SynchronizerHandle | None:
    """Where the run's workers are learners around a synchronizer, start it (a process of its
    own, before them) and wait for its address in the run's record (``host``: the name the
    learners reach this machine by); None otherwise."""
    if not uses_synchronizer(run):
        return None
    record = Path(run.run_dir) / SYNCHRONIZER_RECORD
    record.unlink(missing_ok=True)  # an earlier launch's
    process = subprocess.Popen([sys.executable, "-m", "lowcomm.train.synchronizer", str(config_path)],
                               env={**os.environ, SYNCHRONIZER_HOST_ENV: host}, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the synchronizer of {run.run_dir} exited with status {process.returncode} before "
                               "serving (its words are above)")
        try:
            address = json.loads(record.read_text())["address"]
            print(f"[lowcomm] {run.world_size} learners around a synchronizer at {address} (pid {process.pid}); "
                  f"its state is saved under {Path(run.run_dir) / 'synchronizer'}", flush=True)
            return SynchronizerHandle(process, address)
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the synchronizer of {run.run_dir} wrote no address to {record} within {wait_s:.0f} s")


def replica_lighthouse(run: RunConfig, host: str | None = None, **record):
    """Under ``cluster.fault_tolerance=torchft``, the job's lighthouse (one per launch), its
    address in the run's record (``torchft.json``, with ``record``'s fields); None otherwise.
    ``host``: the name the groups reach it by, where they are not on this machine (SLURM)."""
    if run.cluster.fault_tolerance != "torchft":
        return None
    cluster = run.cluster
    groups = cluster.replica_groups
    lighthouse = start_lighthouse(cluster.min_replicas, cluster.join_timeout_s, HEARTBEAT_TIMEOUT_S)
    address = lighthouse.address() if host is None else lighthouse_url(host, lighthouse.address())
    slurm = cluster.launcher == "slurm"
    record_lighthouse(run.run_dir, address, replica_groups=groups, ranks_per_group=cluster.ranks_per_group,
                      min_replicas=cluster.min_replicas, join_timeout_s=cluster.join_timeout_s,
                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, **({} if slurm else {"max_rejoins": cluster.max_rejoins}),
                      **record)
    of = f" of {cluster.ranks_per_group} ranks" if cluster.ranks_per_group > 1 else ""
    again = ("a lost group's job is requeued to rejoin (by SLURM when its node fails; by the group when a rank of it "
             "finds a peer of its own lost, at most cluster.max_requeues times)" if slurm else
             f"a lost group is relaunched to rejoin (at most {cluster.max_rejoins} times)")
    print(f"[lowcomm] torchft: {groups} replica groups{of}, lighthouse at {address}; an exchange commits with "
          f"{cluster.min_replicas} or more, {again}", flush=True)
    return lighthouse


# How long a replica group that stopped answering stays in the quorum (torchft's default).
HEARTBEAT_TIMEOUT_S = 5.0


class Rejoins:
    """Under torchft: a replica group that failed is started again (it resumes from its own
    checkpoint, and heals from a live peer at its next exchange), at most ``limit`` times in all;
    the other groups never stop. A group of several ranks (``ranks_per_group``) is one: when a
    rank of it fails, its other ranks are stopped, and all of them start again together, at a
    store of their own (``fresh_store(group)``)."""

    def __init__(self, start, limit: int, words_dir: Path, *, ranks_per_group: int = 1, fresh_store=None):
        self.start, self.left, self.words_dir = start, limit, words_dir
        self.ranks, self.fresh_store = ranks_per_group, fresh_store

    def __call__(self, procs: list[subprocess.Popen], failures: dict[int, int]) -> bool:
        """Start the failed groups again; False when the limit is spent (the launch then fails)."""
        groups = sorted({rank // self.ranks for rank in failures})
        if len(groups) > self.left:
            return False
        for group in groups:
            members = range(group * self.ranks, (group + 1) * self.ranks)
            rank, code = next((rank, failures[rank]) for rank in members if rank in failures)
            words = _read_words(self.words_dir, rank)
            for member in members:
                words_file(self.words_dir, member).unlink(missing_ok=True)
            self.left -= 1
            why = f"exit status {code}" if code >= 0 else f"killed by {signal_name(-code)}"
            who = f"replica group {group}" + (f" (its rank {rank - group * self.ranks})" if self.ranks > 1 else "")
            print(f"[lowcomm] {who} left ({why}" + (f": {words['cause']}" if words else "")
                  + f"); starting it again to rejoin ({self.left} more allowed); the other groups go on", flush=True)
            _stop_all([procs[member] for member in members])
            if self.fresh_store is not None and self.ranks > 1:
                self.fresh_store(group)
            for member in members:
                procs[member] = self.start(member)
        return True


# What the workers' process-group rendezvous (torch's env://) reads to join a TCP store the
# launcher hosts rather than one rank 0 opens: torchrun's arrangement. The launcher binds it on a
# port the kernel chooses, so no other process can take the port between its choice and the
# bind (with a port chosen first and bound by rank 0, one that did failed the run: EADDRINUSE).
USE_LAUNCHER_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def rendezvous_store(world: int, timeout_s: int) -> dist.TCPStore:
    """A TCP store for one launch's workers, listening on a port of the kernel's choosing (its
    ``port``); one per launch: a store keeps the keys of the process group that used it."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _newest_checkpoint(run_dir: Path) -> Path | None:
    newest = list_checkpoints(RunDir(run_dir).checkpoints)
    return newest[0] if newest else None


# A worker that a stop signal reached checkpoints at the next step boundary and exits with the
# signal's conventional status (lowcomm.train.worker).
_STOPPED_BY_SIGNAL = (128 + signal.SIGINT, 128 + signal.SIGTERM)
# How long the workers may take to reach a step boundary and write their checkpoint after
# SIGTERM: under SLURM's default KillWait (30 s) and systemd's stop timeout (90 s), so that the
# checkpoint is written before the SIGKILL that follows. (docker stop waits 10 s: give it
# --time 30.) Each worker leaves by itself, saying so, when its boundary has not come within
# lowcomm.train.stop.TERM_BOUNDARY_S.
TERM_GRACE_S = 25


def interrupt_grace_s(run: RunConfig, signum: int) -> float:
    """How long the launcher waits for the step boundary after a stop signal: after SIGTERM
    :data:`TERM_GRACE_S`; after Ctrl-C a step and its checkpoint, bounded by the collective
    timeout (a rank that never reaches the boundary makes the others give up within it)."""
    return TERM_GRACE_S if signum == signal.SIGTERM else run.cluster.collective_timeout_s + 30


def _finish_interrupted(procs: list[subprocess.Popen], run: RunConfig, signum: int, words_dir: Path,
                        before: Path | None) -> Interrupted | None:
    """After a stop signal: let the workers checkpoint at their next step boundary. In a terminal
    they received Ctrl-C's SIGINT themselves; a launcher signalled alone passes the signal on.
    The wait ends when they have all left; when one fails (a rank that lost a stuck peer leaves
    within the collective timeout), at once, with its line; after :func:`interrupt_grace_s`; or at
    a second Ctrl-C or SIGTERM. Returns what to raise; None when the run finished instead (the
    signal came during its last step)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    grace_s = interrupt_grace_s(run, signum)
    print(f"[lowcomm] interrupted: the workers write a checkpoint at the next step boundary (at most "
          f"{grace_s:.0f} s; Ctrl-C again to stop them at once)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + grace_s
    why_not = None
    try:
        while why_not is None:
            codes = [proc.poll() for proc in procs]
            failures = _failures(codes)
            # a rank that left on the signal with words gave up on the boundary: the others
            # cannot write a checkpoint without it
            gave_up = [words["cause"] for rank, code in enumerate(codes)
                       if code in _STOPPED_BY_SIGNAL and (words := _read_words(words_dir, rank))]
            if failures:
                why_not = _root_cause(failures, words_dir, run.run_dir).cause
            elif gave_up:
                why_not = gave_up[0]
            elif all(code is not None for code in codes):
                break
            elif time.monotonic() > deadline:
                why_not = f"the workers did not reach a step boundary within {grace_s:.0f} s and were stopped"
            else:
                time.sleep(0.05)
    except (KeyboardInterrupt, Terminated) as again:
        why_not = (f"stopped at once by a second {'Ctrl-C' if isinstance(again, KeyboardInterrupt) else 'SIGTERM'}, "
                   "before the step boundary")
    _stop_all(procs)
    if why_not is not None:
        return Interrupted(run.run_dir, signum, why_not=why_not)
    if all(proc.returncode == 0 for proc in procs) and RunDir(run.run_dir).summary.is_file():
        return None  # the signal came during the last step: the run finished
    newest = _newest_checkpoint(run.run_dir)
    if newest is None or newest == before:
        return Interrupted(run.run_dir, signum, why_not="the workers left without a checkpoint at the stop")
    return Interrupted(run.run_dir, signum, written=newest)


def _die_with_parent() -> None:
    """In the worker, before exec: have the kernel kill it when the launcher dies (SIGKILL of the
    launcher would otherwise leave orphans training into the run directory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


_SETTLE_S = 5.0  # after a rank fails, how long the others may take to leave by themselves


def _failures(codes: list[int | None]) -> dict[int, int]:
    """Rank -> exit status of the workers that have failed (not running, not ended with 0 or on
    a stop signal), from their ``poll()`` codes."""
    return {rank: code for rank, code in enumerate(codes) if code not in (None, 0, *_STOPPED_BY_SIGNAL)}


def _settled_failures(procs: list[subprocess.Popen]) -> dict[int, int]:
    """The failures once the workers still running have had :data:`_SETTLE_S` to leave by
    themselves. Ranks that fail on a condition they agreed on (no usable checkpoint, say) leave
    moments apart, in any order; without the wait the line named whichever the launcher saw
    first, not the root cause among equals (:func:`_root_cause`). A rank stuck on its failed
    peer does not delay the line by more than the wait."""
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
        time.sleep(0.05)
    return _failures([proc.poll() for proc in procs])


def _wait_all(procs: list[subprocess.Popen], words_dir: Path, run_dir: Path, rejoin: Rejoins | None = None) -> None:
    """Until every worker has exited with 0. At the first that did not: :class:`WorkerFailure`
    naming the root cause among the failures once the others have settled
    (:func:`_settled_failures`, :func:`_root_cause`), or :class:`_StoppedBySignal` when the
    workers ended on a stop signal by themselves. Under torchft (``rejoin``) a failed worker is
    a replica group, started again while the others go on."""
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code == 0 for code in codes):
            return
        if (failures := _failures(codes)) and rejoin is not None and rejoin(procs, failures):
            continue
        if failures:
            raise _root_cause(_settled_failures(procs), words_dir, run_dir)
        stopped = [code for code in codes if code in _STOPPED_BY_SIGNAL]
        if stopped:
            raise _StoppedBySignal(stopped[0] - 128)
        time.sleep(0.05)


def _root_cause(failures: dict[int, int], words_dir: Path, run_dir: Path) -> WorkerFailure:
    """Of the workers that failed by the time the launcher looked (rank -> exit status), the one
    whose failure caused the others': a rank killed by a signal, else one that failed by itself
    (its last words name the cause), else one that lost a peer (a consequence of a peer that
    stopped or vanished); the lowest rank among equals."""

    def consequence(item: tuple[int, int]) -> tuple[int, int]:
        rank, code = item
        return (0 if code < 0 else 2 if code == EXIT_PEERS_LOST else 1, rank)

    rank, code = min(failures.items(), key=consequence)
    return WorkerFailure(rank, code, _read_words(words_dir, rank), run_dir)


def _read_words(words_dir: Path, rank: int) -> dict | None:
    """A worker's last words (lowcomm.train.worker.last_words), None when it left none."""
    try:
        words = json.loads(words_file(words_dir, rank).read_text())
    except (OSError, ValueError):
        return None
    return {**words, "cause": words.get("cause") or words["line"]} if isinstance(words, dict) else None


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """Stop the workers at once: SIGKILL (a worker treats SIGTERM as a request to checkpoint at
    the next step boundary; what it wrote before is safe, checkpoints are written atomically)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
