"""One progress line for a whole ``lowcomm-eval``: checkpoints x tasks done, elapsed, ETA.

On a terminal the line is redrawn in place (carriage return). In a log file (a SLURM job's
output, a pipe) a carriage return would pile every redraw onto one line, so a plain line is
written instead: when a checkpoint's tasks are done, and at most every ``interval_s`` while one
is being scored, so that a long evaluation still shows it is alive.

The ETA counts what is left to compute: a result reused from the cache is done at once, and
the time of the checkpoints computed so far (including the part of the current one already
scored) sets the pace.
"""

from __future__ import annotations

import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class EvalProgress:
    """Progress over ``total`` units (a checkpoint on a task), ``to_compute`` of which are not
    reused from the cache."""

    def __init__(self, total: int, to_compute: int, stream: TextIO, *, interval_s: float = 30.0,
                 clock=time.monotonic):
        self.total = total
        self.to_compute = to_compute
        self.stream = stream
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.computed = 0
        self.current: str | None = None
        self.current_units = 0
        self.current_fraction = 0.0
        self.last_plain = self.started
        self.drawn = False

    # ------------------------------------------------------------------ events
    def reused(self, units: int) -> None:
        """``units`` results taken from the cache."""
        self.done += units
        self._show(final=False)

    def start(self, description: str, units: int) -> None:
        """A checkpoint starts being evaluated on ``units`` tasks."""
        self.current, self.current_units, self.current_fraction = description, units, 0.0
        self._show(final=False)

    def scoring(self, scored: int, total: int) -> None:
        """The model has scored ``scored`` of ``total`` windows of the current checkpoint."""
        self.current_fraction = scored / total if total else 1.0
        if self.interactive or self.clock() - self.last_plain >= self.interval_s:
            self._show(final=False)

    def finish(self, ok: bool = True) -> None:
        """The current checkpoint's units are done (``ok``) or will not be (failed, vanished)."""
        description, units = self.current, self.current_units
        self.current, self.current_units, self.current_fraction = None, 0, 0.0
        if ok:
            self.done += units
            self.computed += units
            self._show(final=True, finished=description)
        else:
            self.to_compute -= units

    def note(self, text: str) -> None:
        """A message of its own line, printed above the progress line on a terminal."""
        if self.interactive and self.drawn:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        if self.interactive and self.drawn:
            self.stream.write(self.line())
        self.stream.flush()

    def close(self) -> None:
        if self.interactive and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False

    # ------------------------------------------------------------------ the line
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far; None before anything was computed."""
        progressed = self.computed + self.current_fraction * self.current_units
        if progressed <= 0:
            return None if self.to_compute > self.computed else 0.0
        elapsed = self.clock() - self.started
        return elapsed * (self.to_compute - progressed) / progressed

    def line(self, finished: str | None = None) -> str:
        eta = self.eta_s()
        text = (f"[{self.done}/{self.total} checkpoint-tasks] {format_duration(self.clock() - self.started)} elapsed, "
                f"ETA {'?' if eta is None else format_duration(eta)}")
        if self.current is not None:
            text += f" | {self.current}: {self.current_fraction:.0%} scored"
        elif finished is not None:
            text += f" | {finished}: done"
        return text

    def _show(self, final: bool, finished: str | None = None) -> None:
        if self.interactive:
            self.stream.write("\r\033[K" + self.line(finished))
            self.drawn = True
        elif final or self.current is not None and self.clock() - self.last_plain >= self.interval_s:
            self.stream.write(self.line(finished) + "\n")
            self.last_plain = self.clock()
        else:
            return
        self.stream.flush()
