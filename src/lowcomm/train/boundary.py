"""What every rank must agree on at a step boundary, agreed in one control all-reduce that may be
read some boundaries later.

At each boundary the loop needs the ranks' verdict on a stop request and on a diverged loss, and,
where it logs, the loss and validation loss averaged over ranks. All of it travels as one
all-reduce (a sum of six numbers per rank) started at the boundary. A stop request carries its
signal: every rank stops at the same boundary and leaves with the same status, SIGTERM's where
any rank was sent SIGTERM (it has a deadline: SIGKILL follows), else Ctrl-C's.

A strategy whose exchange stays in flight for some steps after it starts (DisTrO's all-gather,
eager DiLoCo's outer all-reduce; :meth:`~lowcomm.strategies.base.Strategy.report_lag`) hides
the exchange behind those steps' compute. On a link that carries both, the control all-reduce
queues behind the exchange's bytes (one FIFO: a tc queue, a TCP stream), so a loop that read
it at once would wait for what the strategy meant to hide (``benchmarks/wan.py --overlapped``
measured it). Such a loop reads a boundary's agreement ``lag`` boundaries later, by which point
the strategy has waited for the exchange itself. Every rank reads the same boundary at the same
later boundary, so every rank still acts at the same step; the cost is that a stop request is
heard up to ``lag`` steps later. A boundary that writes a checkpoint or ends the run reads every
agreement still pending, its own included, at once: no checkpoint holds a diverged step and no
request goes unheard.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field

import torch

from lowcomm.comm import Communicator

# the summed vector: stop requested, stop requested by SIGTERM, loss not acceptable, loss,
# validation nll, validation tokens
_STOP, _TERM, _BAD, _LOSS, _VAL_NLL, _VAL_TOKENS = range(6)


@dataclass
class Boundary:
    """One rank's view of a step boundary, before the ranks agree on it.

    ``record`` holds what the rank knows alone (lr, its timings, the meter's step metrics); the
    agreement adds ``train/loss`` where ``logged`` and ``val/loss`` where ``validation`` (the
    rank's validation nll sum and token count) is given. ``signum``: the signal behind a request
    (None: Ctrl-C's, SIGINT)."""

    step: int
    loss: float
    requested: bool
    acceptable: bool
    lr: float
    record: dict = field(default_factory=dict)
    logged: bool = False
    validation: tuple[float, float] | None = None
    signum: int | None = None


@dataclass
class Agreed:
    """A boundary as every rank sees it once its all-reduce has arrived."""

    boundary: Boundary
    stop: bool  # some rank asked to stop here
    diverged: bool  # some rank's loss here was not finite or over the bound
    mean_loss: float
    val_loss: float | None
    signum: int | None = None  # where stop: SIGTERM if some rank was sent it, else SIGINT

    @property
    def step(self) -> int:
        return self.boundary.step

    def record(self) -> dict:
        """The boundary's metrics record, with its agreed losses."""
        record = dict(self.boundary.record)
        if self.boundary.logged:
            record["train/loss"] = self.mean_loss
        if self.val_loss is not None:
            record["val/loss"] = self.val_loss
        return record


class BoundaryAgreement:
    """Starts each boundary's all-reduce and gives back the boundaries whose turn to be read has
    come, in order: with ``lag`` 0 the boundary itself, else the one ``lag`` boundaries before."""

    def __init__(self, comm: Communicator, lag: int = 0):
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.comm, self.lag = comm, lag
        self._pending: deque[tuple[Boundary, torch.Tensor, object]] = deque()

    def submit(self, boundary: Boundary, *, now: bool = False) -> list[Agreed]:
        """Start ``boundary``'s agreement; the boundaries read here (every pending one where
        ``now``)."""
        value = torch.zeros(6, dtype=torch.float64)
        value[_STOP], value[_BAD] = float(boundary.requested), float(not boundary.acceptable)
        value[_TERM] = float(boundary.requested and boundary.signum == signal.SIGTERM)
        value[_LOSS] = boundary.loss if boundary.acceptable else 0.0
        if boundary.validation is not None:
            value[_VAL_NLL], value[_VAL_TOKENS] = boundary.validation
        value = value.to(self.comm.control_device)
        work = self.comm.all_reduce(value, op="sum", async_op=True, purpose="control")
        self._pending.append((boundary, value, work))
        return self._read_down_to(0 if now else self.lag)

    def drain(self) -> list[Agreed]:
        """Read every pending boundary (before leaving the loop: every rank started them)."""
        return self._read_down_to(0)

    def _read_down_to(self, keep: int) -> list[Agreed]:
        """Read the oldest pending boundaries, in order, until ``keep`` are left."""
        out = []
        while len(self._pending) > keep:
            out.append(self._read(*self._pending.popleft()))
        return out

    def _read(self, boundary: Boundary, value: torch.Tensor, work) -> Agreed:
        work.wait()
        total = value.tolist()
        tokens = total[_VAL_TOKENS]
        val_loss = total[_VAL_NLL] / tokens if boundary.validation is not None and tokens > 0 else None
        stop = total[_STOP] > 0
        signum = (signal.SIGTERM if total[_TERM] > 0 else signal.SIGINT) if stop else None
        return Agreed(boundary, stop=stop, diverged=total[_BAD] > 0,
                      mean_loss=total[_LOSS] / self.comm.world_size, val_loss=val_loss, signum=signum)
