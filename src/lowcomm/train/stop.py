"""A stop request: set by a signal, honoured by the training loop at the next step boundary.

A signal handler must not save a checkpoint (every rank writes it together, through
collectives), so it only sets a flag. The loop reads the flag after each step; the ranks agree
through one all-reduce (a signal that reached one rank stops all of them at the same step: the
next, or ``report_lag`` steps on for a strategy whose exchange spans steps), write a checkpoint
together and return. Ctrl-C in a terminal, SIGTERM and SLURM's preemption
signal (:class:`lowcomm.launch.slurm.PreemptionFlag`) all work this way.

SIGTERM comes with a deadline: whoever sends it sends SIGKILL once its grace is over (SLURM's
KillWait, torchrun's 30 s, systemd's stop timeout). :class:`StopDeadline` makes a rank that does
not reach its step boundary in :data:`TERM_BOUNDARY_S` leave with a line saying so, instead of
being killed in silence.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

# After SIGTERM a rank must reach its step boundary within this many seconds, else it leaves
# without a checkpoint at the stop, saying so. SLURM sends SIGKILL KillWait seconds after SIGTERM
# (30 s by default; at the time limit, on scancel, and on a preemption without GraceTime); the
# 10 s this leaves of a default KillWait are for writing a small model's checkpoint. A larger
# one takes longer: the time limit is met by the preemption signal (``cluster.signal``,
# ``signal_delay_s`` ahead), and a cluster that ends jobs by SIGTERM should raise KillWait.
TERM_BOUNDARY_S = 20


class StopFlag:
    """Callable as the loop's ``should_stop``: True once one of its signals has arrived;
    ``received`` is the first that did (None before), ``honoured`` whether the loop has since
    reached the step boundary where it acts on it (:meth:`honour`: every rank stops there, or
    the run ends there). A strategy whose exchange spans steps has the ranks agree on a request
    some boundaries after it is read (:mod:`lowcomm.train.boundary`), so reading it is not
    enough."""

    def __init__(self, *signums: int) -> None:
        self.signums = signums
        self.received: int | None = None
        self.honoured = False
        self.began = False  # the training loop has started (:meth:`begin`)
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

    def begin(self) -> None:
        """The training loop starts (the run restored, its first step next): from here a stop
        signal has a step boundary to wait for; before, there is nothing to checkpoint."""
        self.began = True

    def honour(self) -> None:
        """The loop has reached the boundary where it leaves (a stop every rank agreed on, or the
        end of the run): a signal from here on has no boundary left to wait for."""
        self.honoured = True


class AnyStop:
    """Several stop flags as one ``should_stop``: true where any is; :meth:`honour` honours each."""

    def __init__(self, *flags: StopFlag) -> None:
        self.flags = flags

    def __call__(self) -> bool:
        return any(flag() for flag in self.flags)

    def begin(self) -> None:
        for flag in self.flags:
            flag.begin()

    def honour(self) -> None:
        for flag in self.flags:
            flag.honour()


class StopDeadline:
    """Once ``signum`` (one of ``flag``'s signals) arrives, the step boundary where the loop acts
    on it must come within ``within_s`` seconds (the loop calls ``flag.honour()`` there); else
    ``expire(signum, began)`` runs, on a thread of its own, and must end the process. A signal
    that arrives before the training loop has begun (``flag.begin()``: the rendezvous, the data,
    the model, the restore) expires at once, ``began`` False: there is nothing yet that a
    checkpoint at the stop would add to the last one, and a rank waiting at the rendezvous for a
    peer that has gone would otherwise wait out the whole bound. A signal that came before
    :meth:`start` counts from the start.

    Python runs a signal handler only when the main thread returns to the interpreter, which a
    main thread blocked in a collective (a stopped peer) or in a long device call does not; so
    the watch is woken through :func:`signal.set_wakeup_fd`, which the C-level handler writes
    the signal's number to at once. :meth:`start` must be called from the main thread, after the
    flag's handlers are installed.
    """

    def __init__(self, flag: StopFlag, signum: int, within_s: float, expire: Callable[[int, bool], None]):
        self.flag, self.signum, self.within_s, self.expire = flag, signum, within_s, expire

    def start(self) -> StopDeadline:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)  # kept open for the process's life
        if self.flag.received == self.signum:  # it came before the wakeup descriptor was set
            writer.send(bytes([self.signum]))
        threading.Thread(target=self._watch, args=(reader,), name="lowcomm-stop-deadline", daemon=True).start()
        return self

    def _watch(self, reader: socket.socket) -> None:
        while True:  # the number of every handled signal that arrives, one byte each
            arrived = reader.recv(64)
            if not arrived:
                return
            if self.signum in arrived:
                break
        began = self.flag.began
        deadline = time.monotonic() + (self.within_s if began else 0.0)
        while not self.flag.honoured and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.flag.honoured:
            with contextlib.suppress(Exception):
                self.expire(self.signum, began)
