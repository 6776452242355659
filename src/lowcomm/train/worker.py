"""One training process: ``python -m lowcomm.train.worker <run_dir>/config.yaml`` with the
rank and world in its environment (the local launcher, torchrun or a SLURM task sets them).
:func:`run_rank` is a rank's life whoever started it (this module's ``main``, or
``lowcomm-train`` under torchrun): Ctrl-C and SIGTERM checkpoint at the next step boundary; the
run directory's lock is held by rank 0 where no launcher holds it for the ranks (torchrun, one
node or several: a second launch of the same config, by any launcher, is refused naming the
first); the exit status says how the rank ended.

A rank that fails ends with one line that says why (:func:`last_words`): a known cause (a
checkpoint or data file that cannot be used, a file the run cannot write, a bad metrics line)
as its message alone, anything else with its traceback. Under lowcomm's local launcher the words
go to the launcher, which prints those of the rank that failed first and leaves out the others'
consequences (a rank whose peer died reports a lost peer).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from lowcomm.config import load_run_config, validate
from lowcomm.config.schema import ConfigError, RunConfig
from lowcomm.data.memmap import DataError
from lowcomm.distenv import DistEnv
from lowcomm.rundir import CheckpointError, MetricsError, resume_note
from lowcomm.runlock import RunDirLock, RunDirLocked
from lowcomm.train.loop import EXIT_DIVERGED, train
from lowcomm.train.peers import EXIT_PEERS_LOST, PeersLost
from lowcomm.train.replicas import locked_dir
from lowcomm.train.stop import TERM_BOUNDARY_S, StopDeadline, StopFlag

# Set by lowcomm's local launcher to a directory where each rank leaves its last words
# (:func:`last_words`); the launcher reports an interruption or a failure itself, once.
LAUNCHED_LOCALLY = "LOWCOMM_LOCAL_LAUNCHER"

# Failures whose message says all there is to say: no traceback.
KNOWN_FAILURES = (CheckpointError, DataError, MetricsError, RunDirLocked, OSError)
# Data or a config that does not fit the run, found by a rank rather than before the launch (a
# file missing on one node of several, or changed since the launcher checked it): bad input, the
# status a bad config or the launcher's own data check ends with.
BAD_INPUT = (ConfigError, DataError)
EXIT_BAD_INPUT = 2


def words_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


def last_words(rank: int, line: str, *, cause: str | None = None, detail: str | None = None,
               lost: bool = False) -> None:
    """What this rank says as it leaves: ``line`` (one line, no prefix); ``cause``: the line
    without where a rerun resumes (default: the line); for a failure without a known cause,
    ``detail`` (its traceback). ``lost``: the line is a lost peer's (:class:`PeersLost`), a
    consequence when another rank failed first. To the local launcher's
    directory when there is one, else printed (``[lowcomm] rank R: ...`` on stderr; a lost
    peer's line as it always was, on stdout)."""
    directory = os.environ.get(LAUNCHED_LOCALLY)
    if directory and Path(directory).is_dir():
        path = words_file(directory, rank)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"line": line, "cause": cause or line, "detail": detail, "lost": lost}))
        os.replace(tmp, path)
        return
    if lost:
        print(f"[lowcomm] {line}", flush=True)
        return
    if detail:
        print(detail, file=sys.stderr, end="" if detail.endswith("\n") else "\n")
    print(f"[lowcomm] rank {rank}: {line}", file=sys.stderr, flush=True)


def describe_failure(exc: BaseException) -> tuple[str, str | None]:
    """``(line, traceback or None)`` for a failure: a known cause by its message alone."""
    if isinstance(exc, OSError) and exc.strerror:  # "Read-only file system: /runs/x/metrics.jsonl"
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else ""), None
    if isinstance(exc, ConfigError):  # the config it was given no longer validates here (a data path)
        return "; ".join(exc.errors), None
    if isinstance(exc, KNOWN_FAILURES):
        return str(exc), None
    return f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lowcomm.train.worker RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    env = DistEnv.from_environ()
    if env.rank != 0:
        warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING,
                        format="[lowcomm %(name)s] %(message)s")
    # Ctrl-C (SIGINT to the terminal's process group) or SIGTERM (kill, timeout, docker stop,
    # systemd, torchrun stopping its workers): checkpoint at the next step boundary; after
    # SIGTERM only if that boundary comes within TERM_BOUNDARY_S (SIGKILL follows).
    stop = StopFlag.install(signal.SIGINT, signal.SIGTERM)
    return run_rank(validate(load_run_config(argv[0])), env, stop)


def run_rank(run: RunConfig, env: DistEnv, stop: StopFlag, *, before: Callable[[], object] | None = None) -> int:
    """Train this rank of ``run`` and return its exit status: 0 finished, 128 + the signal the
    ranks agreed to stop on (a checkpoint at that boundary), EXIT_DIVERGED, EXIT_PEERS_LOST.
    ``stop`` (installed by the caller, as early as it can) is the stop request. Rank 0 holds the
    run directory's lock unless the local launcher, which holds it for its workers, started this
    rank; ``before`` runs on rank 0 once it holds it (``lowcomm-train`` prepares the run
    directory there). A lock held by another launch raises RunDirLocked on rank 0."""
    held_by_launcher = LAUNCHED_LOCALLY in os.environ
    with RunDirLock(locked_dir(run)) if env.rank == 0 and not held_by_launcher else contextlib.nullcontext():
        if before is not None and env.rank == 0:
            before()
        watch_sigterm(stop, env.rank, run.run_dir)
        try:
            result = train(run, env, should_stop=stop)
        except PeersLost as lost:
            # one line per node instead of a traceback per rank; a rerun resumes from the checkpoint
            if lost.reports:
                last_words(env.rank, lost.line().removeprefix("[lowcomm] "), cause=lost.diagnosis.summary(), lost=True)
            lost.leave()
            return EXIT_PEERS_LOST
    if result.diverged is not None:  # rank 0 has printed the line
        return EXIT_DIVERGED
    if result.preempted:
        # the signal the ranks agreed on: a rank that did not see it stopped with the others at
        # the same step, and leaves as the signalled one does (SIGTERM to one worker is SIGTERM)
        signum = result.stop_signal or stop.received or signal.SIGINT
        if env.rank == 0 and not held_by_launcher:
            print(f"[lowcomm] interrupted ({signal.Signals(signum).name}): stopped at step "
                  f"{result.final_step} with a checkpoint in {result.run_dir}; run the same command to resume",
                  flush=True)
        # not finished: the shell's status for the signal, on every rank
        return 128 + signum
    return 0


def watch_sigterm(stop: StopFlag, rank: int, run_dir: Path) -> None:
    """After SIGTERM (one of ``stop``'s signals), this rank reaches its step boundary within
    :data:`TERM_BOUNDARY_S` or leaves saying why (:class:`StopDeadline`)."""
    StopDeadline(stop, signal.SIGTERM, TERM_BOUNDARY_S,
                 lambda signum, began: leave_without_checkpoint(rank, run_dir, signum, TERM_BOUNDARY_S,
                                                                began=began)).start()


def leave_without_checkpoint(rank: int, run_dir: Path, signum: int, within_s: float, *, began: bool = True) -> None:
    """A stop signal's deadline passed before the step boundary (:class:`StopDeadline`), or the
    signal came before the rank's first step (``began`` False): say so and leave now, with the
    signal's status, rather than be killed in silence."""
    name = signal.Signals(signum).name
    if began:
        cause = (f"rank {rank} reached no step boundary within {within_s:g} s of {name} (a step or a collective was "
                 "still running) and left without a checkpoint at the stop")
    else:
        cause = f"rank {rank} was stopped by {name} before its first step, with nothing trained to checkpoint"
    last_words(rank, f"{cause}; {resume_note(run_dir)}", cause=cause)
    leave_now(128 + signum)


def leave_now(code: int) -> NoReturn:
    # os._exit, skipping the interpreter's teardown: its destructor order (torch's C++ threads
    # against the GIL) can hang a finished worker, and a failed one must exit at once so that the
    # launcher sees it and stops the other ranks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the stop flag was installed: nothing to save yet
        code = 130
    except BaseException as failure:  # noqa: BLE001 - report, then exit without teardown
        line, detail = describe_failure(failure)
        last_words(int(os.environ.get("RANK", "0")), line, detail=detail)
        code = EXIT_BAD_INPUT if isinstance(failure, BAD_INPUT) else 1
    leave_now(code)
