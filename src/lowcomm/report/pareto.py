"""Pareto fronts of loss against bytes: the runs no other run beats on both at once.

Both coordinates are minimised. Point a dominates point b when a is no worse on both and
strictly better on one; the front is every point nothing dominates. Two identical points do not
dominate each other, so both stay on the front.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lowcomm.report.runs import RunRecord


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated ``(x, y)`` points, in increasing x (so decreasing y).

    A point with a NaN or infinite coordinate (a diverged run) is never on the front and does
    not dominate anything."""
    coords = [(float(x), float(y)) for x, y in points]
    finite = [i for i, (x, y) in enumerate(coords) if math.isfinite(x) and math.isfinite(y)]
    # In increasing (x, y), a point is dominated exactly when an earlier point has y no larger,
    # except an exact copy of the last front point, which only ties with it.
    front: list[int] = []
    best_y = math.inf
    for i in sorted(finite, key=lambda i: coords[i]):
        if coords[i][1] < best_y:
            front.append(i)
            best_y = coords[i][1]
        elif front and coords[i] == coords[front[-1]]:
            front.append(i)
    return front


@dataclass(frozen=True)
class LossMbPoint:
    """One run in the loss-versus-bytes plane (the paper's Figure 4)."""

    run: RunRecord
    mb_per_step: float  # every byte the worker contributes per step (its total payload, or tx)
    loss: float  # the final validation loss, or its exponential with ``perplexity``
    # a run with two links (FlexDeMo): the part of its payload that crosses between nodes
    inter_node_mb: float | None = None


def loss_mb_points(runs: list[RunRecord], *, mb: str = "payload",
                   perplexity: bool = False) -> tuple[list[LossMbPoint], list[tuple[RunRecord, str]]]:
    """Each run's (MB/step, final validation loss) and the runs that have no such point, with why.

    ``mb``: ``payload`` (what one worker contributes per step, the papers' Tx MB/step) or ``tx``
    (what it sends under the ring algorithm). Every run is placed at all of its bytes, as in
    Table 1 and the cumulative-MB curves; a run with two links (FlexDeMo: inside a node and
    between nodes) also carries its inter-node payload, drawn as a second, linked point beside
    it, never in its place (the front is over the total)."""
    if mb not in ("payload", "tx"):
        raise ValueError(f"mb={mb!r}; choose payload or tx")
    points, skipped = [], []
    for run in runs:
        mb_per_step = run.payload_mb_per_step if mb == "payload" else run.tx_mb_per_step
        inter_node = run.inter_node_payload_mb_per_step if mb == "payload" and run.two_links else None
        loss = run.final_val_loss
        if run.diverged:
            skipped.append((run, f"diverged at step {run.diverged['step']} ({run.diverged['reason']})"))
        elif mb_per_step is None or loss is None:
            skipped.append((run, "no MB/step or validation loss logged yet"))
        elif not math.isfinite(loss):
            skipped.append((run, f"final validation loss is {loss} (diverged)"))
        elif mb_per_step <= 0:
            skipped.append((run, "sent nothing (0 MB/step cannot be placed on a log axis)"))
        else:
            points.append(LossMbPoint(run, mb_per_step, math.exp(loss) if perplexity else loss,
                                      inter_node if inter_node and inter_node > 0 else None))
    return points, skipped


def pareto_runs(points: list[LossMbPoint]) -> list[LossMbPoint]:
    """The points on the loss-versus-MB front, in increasing MB/step."""
    return [points[i] for i in pareto_front([(p.mb_per_step, p.loss) for p in points])]
