"""Unequal workers (issue 47): ``cluster.slow_ranks`` compute ``cluster.slowdown`` times slower,
for real. A rank stretches each step by (factor - 1) x the CPU time it computed, never the time
it waited; the setting is checked before anything starts, names its own run directory, trains
what the equal run trains, and is recorded in the summary; the wall-clock model takes it."""

from __future__ import annotations

import time

import pytest

from lowcomm.config import ConfigError, validate
from lowcomm.config.compose import compose
from lowcomm.rundir import RunDir
from lowcomm.train.slowdown import Slowdown
from runs import tiny_run, train_in_workers


def _busy(seconds: float) -> None:
    """Compute (CPU time) for about ``seconds``."""
    end = time.process_time() + seconds
    total = 0
    while time.process_time() < end:
        total += sum(range(1000))


def test_a_slow_rank_stretches_its_compute_and_not_its_waiting():
    slow = Slowdown(3.0)
    with slow.step():
        time.sleep(0.3)  # waiting for a peer: no CPU time
    assert slow.stretched_s < 0.05
    began = time.perf_counter()
    with slow.step():
        _busy(0.2)
    wall = time.perf_counter() - began
    # twice the 0.2 s of compute slept, on top of it: three times as long in all
    assert 0.38 <= slow.stretched_s <= 0.5
    assert wall >= 0.55
    equal = Slowdown()
    with equal.step():
        _busy(0.05)
    assert equal.stretched_s == 0.0


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.slow_ranks=[4]", "cluster.slowdown=2"], "cluster.slow_ranks: 4 is not a rank of this run (0 ... 3)"),
    (["cluster.slow_ranks=[1]", "cluster.slowdown=0.5"], "cluster.slowdown must be a factor >= 1"),
    (["cluster.slowdown=2"], "cluster.slowdown is 2 but cluster.slow_ranks names no rank to slow down"),
    (["cluster.slow_ranks=[1,1]", "cluster.slowdown=2"], "cluster.slow_ranks names a rank twice: [1, 1]"),
    (["cluster.slow_ranks=[1]", "cluster.slowdown=2", "cluster.device=cuda"], "is realised on the CPU"),
])
def test_a_bad_slowdown_is_refused_before_anything_starts(overrides, message):
    with pytest.raises(ConfigError) as refused:
        validate(compose(overrides))
    assert any(message in error for error in refused.value.errors), refused.value.errors


def test_a_slowed_run_has_its_own_directory_and_an_equal_one_keeps_its_name(tmp_path):
    equal = validate(compose([f"run_root={tmp_path}"]))
    assert validate(compose([f"run_root={tmp_path}", "cluster.slow_ranks=[3]", "cluster.slowdown=1"])).run_name \
        == equal.run_name
    slowed = validate(compose([f"run_root={tmp_path}", "cluster.slow_ranks=[3]", "cluster.slowdown=2"]))
    assert slowed.run_name != equal.run_name and slowed.run_name.startswith("tiny-adamw_ddp-w4-")


@pytest.mark.slow
def test_a_slow_rank_trains_what_the_equal_run_trains_and_the_summary_says_how_slow(tmp_path, trained_run):
    settings = ("optimizer=adamw_ddp", "train.max_steps=6")
    equal = trained_run(*settings)
    slowed = tiny_run(tmp_path, *settings, "cluster.slow_ranks=[1]", "cluster.slowdown=3")
    train_in_workers(slowed)

    summary = RunDir(slowed.run_dir).read_summary()
    assert summary["slow_ranks"] == [1] and summary["slowdown"] == 3.0
    assert summary["stretched_s"][0] == 0.0 and summary["stretched_s"][1] > 0
    # the same steps, in the same order: a slower worker changes when, not what
    losses = [r["train/loss"] for r in RunDir(slowed.run_dir).read_metrics() if "train/loss" in r]
    assert losses == [r["train/loss"] for r in RunDir(equal.run_dir).read_metrics() if "train/loss" in r]
    assert "slow_ranks" not in RunDir(equal.run_dir).read_summary()


def test_the_wallclock_model_takes_the_slowest_workers_compute(trained_run):
    from lowcomm.report.runs import load_run
    from lowcomm.report.wallclock import Link, timeline

    run = load_run(trained_run("optimizer=adamw_ddp", "train.max_steps=6").run_dir)
    link = Link("lab", 1e9, 1e-3)
    equal, slowed = timeline(run, link), timeline(run, link, slowdown=2.0)
    assert slowed.compute_s_per_step == pytest.approx(2 * equal.compute_s_per_step)
    # AdamW-DDP hides nothing: each step is its compute plus its traffic
    assert slowed.total_s - equal.total_s == pytest.approx(6 * equal.compute_s_per_step)
    with pytest.raises(ValueError, match="a slowdown is a factor >= 1"):
        timeline(run, link, slowdown=0.5)
