"""``lowcomm-torchrun``: torchrun (``torch.distributed.run``, the same arguments) that ends the way
lowcomm's own launcher does.

torchrun passes a SIGTERM on to its workers, which checkpoint at the next step boundary and exit
143 (:mod:`lowcomm.train.worker`), but then ends in its own traceback (``SignalException``) with
status 1; a worker that ends with lowcomm's line and status (75: peers lost, 65: diverged) becomes
a ``ChildFailedError`` table and status 1. A scheduler, a sweep or a shell script then cannot tell
a stop from a crash. Here torchrun runs in-process and:

- a stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) ends with ``128 + signal`` and one line, the
  workers' own lines (a checkpoint at the next step boundary, or why not) above it, no traceback;
- a worker that fails ends torchrun with that worker's own status (the first to fail; 128 + N
  for one killed by signal N), after one line naming it; its line (or its traceback, for a cause
  lowcomm does not know) is above;
- torchrun's agent says only errors, unless ``LOGLEVEL`` asks for more (torchrun's own variable).

Everything else is torchrun's: ``lowcomm-torchrun --nnodes 2 --nproc-per-node 8 ... -m
lowcomm.cli.train optimizer=demo ...``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

PROG = "lowcomm-torchrun"


# torch's elastic agent creates its loggers as its modules are imported, each at ``LOGLEVEL``
# (default WARNING); the rendezvous backends' modules are imported only as a run starts.
_AGENT_MODULES = ("torch.distributed.run", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
                  "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
                  "torch.distributed.elastic.rendezvous.dynamic_rendezvous")


class _RestatedFailure(logging.Filter):
    """Drops the agent's record of a failed worker (``failed (exitcode: 143) local_rank: 1
    ...``): :func:`main`'s line says it, and which rank, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def _import_agent(quiet: bool) -> None:
    """Import torchrun's agent; ``quiet``: its loggers say errors only (the agent's notes on
    stopping workers are not a fault's line), less the failure :func:`main` restates."""
    import importlib

    if quiet:
        os.environ["LOGLEVEL"] = "ERROR"  # read as each logger is made; not the workers' to inherit
    try:
        for module in _AGENT_MODULES:
            importlib.import_module(module)
    finally:
        if quiet:
            del os.environ["LOGLEVEL"]
    restated = _RestatedFailure()
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.addFilter(restated)


def failure_line(rank: int, exitcode: int) -> tuple[str, int]:
    """The line for the first worker to fail, and the status to end with: its own, or
    128 + N for a worker killed by signal N (which left no line of its own)."""
    from lowcomm.launch.local import signal_name

    if exitcode < 0:
        return (f"{PROG}: rank {rank} was killed by {signal_name(-exitcode)} (status {128 - exitcode}), the first "
                "of this node's to end; it left no line"), 128 - exitcode
    named = f" ({signal_name(exitcode - 128)})" if exitcode > 128 else ""
    return (f"{PROG}: rank {rank} ended with status {exitcode}{named}, the first of this node's to end; its line "
            "is above"), exitcode


def _help() -> str:
    from lowcomm.cli.helptext import plain

    return (f"usage: {PROG} [torchrun's options] (-m MODULE | SCRIPT) [its arguments]\n\n"
            f"{plain(__doc__)}\n"
            "torchrun's options (--nnodes, --nproc-per-node, --rdzv-*, ...): torchrun --help\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):  # answered without torch (a --help later is the script's)
        print(_help(), end="")
        return 0
    _import_agent(quiet="LOGLEVEL" not in os.environ)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)  # torchrun's parser: --help, and its errors, are torchrun's
    try:
        run(args)
    except SignalException as exc:
        # the agent has passed the signal to the workers and waited for them (up to 30 s): each
        # stops at its next step boundary with a checkpoint, or says why it could not
        name = signal.Signals(exc.sigval).name
        print(f"{PROG}: stopped by {name}; the workers' lines above say where each stopped", file=sys.stderr,
              flush=True)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        line, status = failure_line(rank, failure.exitcode)
        print(line, file=sys.stderr, flush=True)
        return status
    except KeyboardInterrupt:  # before the agent's handlers were installed (the rendezvous)
        print(f"{PROG}: interrupted before the workers started", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
