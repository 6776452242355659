"""SIGTERM handled as Ctrl-C is, by the commands that launch runs.

SIGTERM is what ``kill``, ``timeout``, ``docker stop``, systemd and SLURM's end of a job send. Its
default action ends a process at once, with nothing said; inside :func:`sigterm_as_interrupt` it
raises :class:`Terminated` instead, so a launcher stops its workers at a step boundary and a
command running several runs stops between them with the line that says how to go on. A light
module (no torch): ``lowcomm-sweep status`` and ``--help`` import it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class Terminated(BaseException):
    """SIGTERM reached the launcher (``kill``, ``timeout``, ``docker stop``, systemd, SLURM's end
    of a job): handled as Ctrl-C is."""


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so that a command running several runs (a sweep, the quickstart) stops
    between them with its line instead of dying silently. A process that ignores SIGTERM
    (``nohup``) keeps ignoring it."""
    handles = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN)
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if handles else None
    try:
        yield
    finally:
        if handles:
            signal.signal(signal.SIGTERM, previous)


def stopped_between_runs(prog: str, exc: BaseException) -> int:
    """Say that a command running several runs stopped between them (or while planning), on
    Ctrl-C or SIGTERM, and return the shell's status for that signal (130, 143)."""
    terminated = isinstance(exc, Terminated)
    print(f"{prog}: interrupted{' (SIGTERM)' if terminated else ''}; finished runs are kept, run the same command "
          "to go on", file=sys.stderr)
    return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
