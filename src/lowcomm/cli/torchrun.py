"""``lowcomm-torchrun``: torchrun (``torch.distributed.run``, the same arguments) that ends the way
lowcomm's own launcher does.

torchrun passes a SIGTERM on to its workers, which checkpoint at the next step boundary and exit
143 (:mod:`lowcomm.train.worker`), but then ends in its own traceback (``SignalException``) with
status 1; a worker that ends with lowcomm's line and status (75: peers lost, 65: diverged) becomes
a ``ChildFailedError`` table and status 1. A scheduler, a sweep or a shell script then cannot tell
a stop from a crash. Here torchrun runs in-process and:

- a stop signal (SIGTERM, SIGINT, SIGHUP) ends with ``128 + signal``, the workers' checkpoint line
  above it and no traceback;
- a worker that fails ends torchrun with that worker's own status (the first to fail), after one
  line naming it; its line (or its traceback, for a cause lowcomm does not know) is above;
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


def exit_status(exitcode: int) -> int:
    """A worker's status as a shell reports it: a process killed by signal N is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _quiet_agent() -> None:
    """torch's elastic agent sets each of its loggers' level itself (from ``LOGLEVEL``, default
    WARNING), so the level is set on each of them, not on their parent. A failed worker's
    record (``failed (exitcode: 143) local_rank: 1 ...``) is said again by :func:`main`'s line."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)  # torchrun's parser: --help, and its errors, are torchrun's
    if "LOGLEVEL" not in os.environ:  # the agent's notes on stopping workers are not a fault's line
        _quiet_agent()
    try:
        run(args)
    except SignalException as exc:
        # the agent has stopped the workers with the same signal (a checkpoint at the next step
        # boundary, rank 0's line above) and waited for them
        name = signal.Signals(exc.sigval).name
        print(f"{PROG}: stopped by {name}; the workers were stopped at a step boundary", file=sys.stderr,
              flush=True)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        status = exit_status(failure.exitcode)
        how = f"ended with status {status}"
        if status > 128 and status - 128 in set(signal.Signals):
            how = f"was stopped by {signal.Signals(status - 128).name} (status {status})"
        print(f"{PROG}: rank {rank} {how}, the first of this node's to end; its line is above",
              file=sys.stderr, flush=True)
        return status
    except KeyboardInterrupt:  # before the workers started (rendezvous)
        print(f"{PROG}: interrupted before the workers started", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
