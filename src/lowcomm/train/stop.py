"""A stop request: set by a signal, honoured by the training loop at the next step boundary.

A signal handler must not save a checkpoint (every rank writes it together, through
collectives), so it only sets a flag. The loop reads the flag after each step; the ranks agree
through one all-reduce (a signal that reached one rank stops all of them at the same step),
write a checkpoint together and return. Ctrl-C in a terminal and SLURM's preemption signal
(:class:`lowcomm.launch.slurm.PreemptionFlag`) both work this way.
"""

from __future__ import annotations

import signal
from typing import Any


class StopFlag:
    """Callable as the loop's ``should_stop``: True once one of its signals has arrived;
    ``received`` is the first that did (None before)."""

    def __init__(self, *signums: int) -> None:
        self.signums = signums
        self.received: int | None = None
        self._displaced: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    @classmethod
    def install(cls, *signums: int) -> StopFlag:
        """Handle each of ``signums`` with a new flag; the handlers it replaces are kept in
        ``_displaced``."""
        flag = cls(*signums)
        for signum in signums:
            flag._displaced[signum] = signal.signal(signum, flag._on_signal)
        return flag

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        if self.received is None:
            self.received = signum

    def __call__(self) -> bool:
        return self.requested
