"""The loop's per-boundary agreement (lowcomm.train.boundary): one control all-reduce of the stop
request, the divergence flag and the logged losses, read at once, or ``lag`` boundaries later for
a strategy whose exchange stays in flight that long (so that the agreement does not wait behind
its bytes on a shared link), and at once wherever a checkpoint is due."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.config import validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.strategies import STRATEGIES
from lowcomm.train.boundary import Boundary, BoundaryAgreement
from lowcomm.train.metrics import read_metrics
from runs import tiny_run, train_in_workers


def _run(agreement: BoundaryAgreement, plan: dict[int, tuple[bool, float]], due: set[int] = frozenset(),
         steps: int = 8) -> tuple[int, list[tuple[int, bool, bool]]]:
    """The boundary the loop leaves at (as fit() does), and every boundary read: (step, stop, diverged)."""
    read = []
    for step in range(1, steps + 1):
        requested, loss = plan.get(step, (False, 1.0))
        boundary = Boundary(step, loss, requested=requested, acceptable=math.isfinite(loss), lr=0.1, logged=True)
        agreed = agreement.submit(boundary, now=step in due)
        if any(a.stop or a.diverged for a in agreed):
            agreed += agreement.drain()
        read += [(a.step, a.stop, a.diverged) for a in agreed]
        if any(a.stop or a.diverged for a in agreed):
            return step, read
    return steps, read + [(a.step, a.stop, a.diverged) for a in agreement.drain()]


def test_at_once_every_boundary_is_read_where_it_is_and_a_request_stops_there():
    left, read = _run(BoundaryAgreement(Communicator()), {3: (True, 1.0)})
    assert left == 3 and read == [(1, False, False), (2, False, False), (3, True, False)]


@pytest.mark.parametrize("lag", [1, 3])
def test_late_a_boundary_is_read_lag_boundaries_later_and_names_its_own_step(lag):
    left, read = _run(BoundaryAgreement(Communicator(), lag), {2: (True, 1.0)})
    assert left == 2 + lag  # heard lag steps later; every boundary up to there is read, in order
    assert [step for step, _, _ in read] == list(range(1, left + 1))
    assert [step for step, stop, _ in read if stop] == [2]
    left, read = _run(BoundaryAgreement(Communicator(), lag), {3: (False, math.nan)})
    assert left == 3 + lag and [step for step, _, diverged in read if diverged] == [3]


def test_late_a_boundary_that_saves_reads_everything_pending_at_once():
    # a diverged step never reaches a checkpoint, and a request at a checkpoint is heard there
    assert _run(BoundaryAgreement(Communicator(), 3), {4: (False, math.nan)}, due={4})[0] == 4
    assert _run(BoundaryAgreement(Communicator(), 3), {2: (True, 1.0)}, due={4})[0] == 4
    left, read = _run(BoundaryAgreement(Communicator(), 3), {}, due={4})
    assert left == 8 and [step for step, _, _ in read] == list(range(1, 9))


def test_the_agreed_losses_are_the_mean_over_ranks_and_validation_is_per_token():
    agreement = BoundaryAgreement(Communicator(), 1)
    assert agreement.submit(Boundary(1, 2.5, requested=False, acceptable=True, lr=0.1, logged=True,
                                     validation=(12.0, 4.0), record={"opt/lr": 0.1})) == []
    (agreed,) = agreement.drain()
    assert agreed.record() == {"opt/lr": 0.1, "train/loss": 2.5, "val/loss": 3.0}


def _two_ranks(rank: int, world: int) -> dict:  # noqa: ARG001
    agreement = BoundaryAgreement(Communicator.world("cpu"), 2)
    # only rank 1 is asked to stop, at boundary 2; rank 0's loss at 3 is 1.0, rank 1's 3.0
    left, read = _run(agreement, {2: (rank == 1, 1.0), 3: (False, 1.0 + 2 * rank)}, due={8})
    mean = BoundaryAgreement(Communicator.world("cpu")).submit(
        Boundary(1, 1.0 + 2 * rank, requested=False, acceptable=True, lr=0.1, logged=True,
                 validation=(float(rank), 1.0 + rank)))[0]
    return {"left": left, "read": read, "mean": mean.mean_loss, "val": mean.val_loss}


@pytest.mark.slow
def test_late_agreement_leaves_every_rank_at_the_same_boundary_with_the_same_verdict():
    results = spawn_workers(_two_ranks, 2)
    assert results[0] == results[1]
    assert results[0]["left"] == 4 and [s for s, stop, _ in results[0]["read"] if stop] == [2]
    assert results[0]["mean"] == 2.0 and results[0]["val"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_states_its_report_lag_and_a_lag_means_hidden_traffic(name):
    """A strategy whose exchange stays in flight across boundaries (report_lag > 0) hides its
    traffic behind the steps it spans: its comm_overlap (the wall-clock model's) must say so at
    its quickstart point; one that waits within the step has no lag."""
    point = STRATEGIES[name].quickstart[0]
    raw = OmegaConf.to_container(compose([f"optimizer={name}", *point.overrides]), resolve=True)
    strategy, cfg = validate_optimizer(raw)
    lag = strategy.report_lag(cfg)
    assert isinstance(lag, int) and lag >= 0
    if lag:
        assert strategy.comm_overlap(cfg, 155_648, compression=raw.get("compression")) > 0
    # at the quickstart points: DisTrO's all-gather is waited for one step later, eager
    # DiLoCo's at the next outer step (H=10), Streaming DiLoCo's fragment tau=1 steps later
    assert lag == {"distro": 1, "eager_diloco": 10, "streaming_diloco": 1}.get(name, 0)


@pytest.mark.slow
def test_a_late_run_logs_the_boundaries_it_logs_in_order_with_their_own_losses(tmp_path):
    """Eager DiLoCo at H=2 reads each boundary two boundaries late; with a checkpoint at every
    step it reads each at once. Both write one metrics line per logged or validated boundary, in
    order, with the same losses: a late line carries its own boundary's, not the one it was
    read at."""
    logged = {}
    for every in (0, 1):
        run = tiny_run(tmp_path / f"every{every}", "optimizer=eager_diloco", "optimizer.sync_every=2",
                       "train.log_every=2", "train.eval_every=3", f"train.checkpoint_every={every}", max_steps=6)
        train_in_workers(run)
        records = read_metrics(run.run_dir / "metrics.jsonl")
        assert [r["step"] for r in records] == [2, 3, 4, 6]
        assert [r["step"] for r in records if "train/loss" in r] == [2, 4, 6]
        assert [r["step"] for r in records if "val/loss" in r] == [3, 6]
        summary = json.loads((run.run_dir / "summary.json").read_text())
        assert summary["final_val_loss"] == records[-1]["val/loss"] and summary["steps"] == 6
        logged[every] = [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in records]
    assert logged[0] == logged[1]
    assert len({loss for _, loss, _ in logged[0] if loss is not None}) == 3  # each boundary its own
