"""Unequal workers on one machine: a rank made ``cluster.slowdown`` times slower, for real.

A slow device takes longer for the same work and reaches every exchange late; its peers wait for
it there (a synchronous method at every step, DiLoCo at its outer step, once for H steps of
lateness). That is reproduced by the rank itself: after each of its steps it sleeps
``(slowdown - 1) x`` the compute the step took, so its next exchange starts that much later and
the others wait for it in their collectives, on the wall clock, with nothing simulated.

The step's compute is the process's CPU time over it, at most the step's wall time: time spent
waiting for peers (blocked in a collective) takes no CPU time, so it is never stretched; where
torch computes on several threads at once the CPU time runs ahead of the wall clock, which then
bounds it (a slow rank, the last to arrive, waits for hardly anyone). A rank stretched this way
does not slow its peers by competing for cores while it sleeps (a slower device would not
either). What the CPU time counts beyond the step's own compute (the backend's threads copying
messages) is small beside it and stretched with it. Realised on the CPU only: a GPU's work runs
outside the process's CPU time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Slowdown:
    """``factor`` (>= 1) for this rank; :meth:`step` around each training step stretches it.
    ``stretched_s``: the seconds slept so far."""

    def __init__(self, factor: float = 1.0):
        if not factor >= 1:
            raise ValueError(f"a slowdown is a factor >= 1, got {factor}")
        self.factor = float(factor)
        self.stretched_s = 0.0

    @classmethod
    def of_rank(cls, slow_ranks, factor: float, rank: int) -> Slowdown:
        return cls(factor if rank in slow_ranks else 1.0)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.factor == 1.0:
            yield
            return
        cpu, wall = time.process_time(), time.perf_counter()
        yield
        compute = min(time.process_time() - cpu, time.perf_counter() - wall)
        pause = (self.factor - 1.0) * compute
        time.sleep(pause)
        self.stretched_s += pause
