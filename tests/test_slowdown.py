"""Unequal workers (issue 47): ``cluster.slow_ranks`` compute ``cluster.slowdown`` times slower,
for real. A rank stretches each step by (factor - 1) x the CPU time it computed, never the time
it waited; the setting is checked before anything starts, names its own run directory, trains
what the equal run trains, and is recorded in the summary; the wall-clock model takes it.

Unequal links (``cluster.link_rate``, ``slow_link_nodes``, ``slow_link_rate``) likewise, where
the links are made so (network-namespace nodes; tests/test_stragglers.py shapes them for real)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from lowcomm.config import ConfigError, validate
from lowcomm.config.cluster import LINKS_SHAPED_ENV, node_link_rates
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
    # torch's OpenMP threads spin on a core for a while after a parallel region (an earlier
    # test's in this process): CPU time of this process, but not this test's waiting
    time.sleep(0.5)
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


# ------------------------------------------------------------------ unequal links
SHAPED_BY = "the test (its links are what the config says)"


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.link_rate=fast"], "cluster.link_rate: bandwidth 'fast' is not a number of bits/s"),
    (["cluster.link_rate=0M"], "cluster.link_rate: bandwidth '0M': a link's rate must be > 0"),
    (["cluster.slow_link_nodes=[1]"], "cluster.slow_link_nodes and cluster.slow_link_rate go together"),
    (["cluster.slow_link_rate=10M"], "cluster.slow_link_nodes and cluster.slow_link_rate go together"),
    (["cluster.slow_link_nodes=[1,1]", "cluster.slow_link_rate=10M"], "cluster.slow_link_nodes names a node twice"),
    (["cluster.slow_link_nodes=[-1]", "cluster.slow_link_rate=10M"], "-1 is not a node index"),
])
def test_bad_links_are_refused_before_anything_starts(overrides, message, monkeypatch):
    monkeypatch.setenv(LINKS_SHAPED_ENV, SHAPED_BY)
    with pytest.raises(ConfigError) as refused:
        validate(compose(overrides))
    assert any(message in error for error in refused.value.errors), refused.value.errors


def test_links_no_one_shaped_are_refused_naming_where_they_are_made(monkeypatch):
    monkeypatch.delenv(LINKS_SHAPED_ENV, raising=False)
    for overrides in (["cluster.link_rate=100M"], ["cluster.slow_link_nodes=[1]", "cluster.slow_link_rate=10M"]):
        with pytest.raises(ConfigError) as refused:
            validate(compose(overrides))
        assert any("realised on network-namespace nodes" in error and "benchmarks/stragglers.py" in error
                   for error in refused.value.errors), refused.value.errors
    validate(compose([]))  # no links asked for: nothing to shape


def test_each_nodes_rate_and_a_slow_node_the_run_lacks(monkeypatch):
    monkeypatch.setenv(LINKS_SHAPED_ENV, SHAPED_BY)
    cluster = validate(compose(["cluster.link_rate=100M", "cluster.slow_link_nodes=[3]",
                                "cluster.slow_link_rate=10Mbit"])).cluster
    assert node_link_rates(cluster, 4) == [100e6, 100e6, 100e6, 10e6]
    with pytest.raises(ConfigError, match=r"cluster.slow_link_nodes: \[3\] not among the run's 2 nodes"):
        node_link_rates(cluster, 2)
    only_slow = validate(compose(["cluster.slow_link_nodes=[0]", "cluster.slow_link_rate=1G"])).cluster
    assert node_link_rates(only_slow, 2) == [1e9, None]  # the other node unshaped
    # another measurement, its own directory; the equal run keeps its name
    equal = validate(compose([])).run_name
    linked = validate(compose(["cluster.link_rate=100M"])).run_name
    assert linked != equal
    assert validate(compose(["cluster.link_rate=100Mbit"])).run_name == validate(compose(["cluster.link_rate=1e8"])).run_name == linked


@pytest.mark.slow
def test_a_run_records_its_links_and_the_wallclock_model_takes_them(trained_run, monkeypatch, tmp_path):
    from lowcomm.report.runs import load_run
    from lowcomm.report.wallclock import recorded_link, timeline

    monkeypatch.setenv(LINKS_SHAPED_ENV, SHAPED_BY)
    settings = ("optimizer=adamw_ddp", "train.max_steps=6")
    equal, linked = trained_run(*settings), trained_run(*settings, "cluster.link_rate=100M")
    summary = RunDir(linked.run_dir).read_summary()
    assert summary["node_link_bps"] == [100e6]  # two ranks on one node here: one link
    assert (summary["link_rate"], summary["links_shaped_by"]) == ("100M", SHAPED_BY)
    # the setting leaves the training as it was (the same losses)
    losses = [r["train/loss"] for r in RunDir(linked.run_dir).read_metrics() if "train/loss" in r]
    assert losses == [r["train/loss"] for r in RunDir(equal.run_dir).read_metrics() if "train/loss" in r]
    run = load_run(linked.run_dir)
    link = recorded_link([run])
    assert (link.bandwidth_bps, link.latency_s, link.framing_bytes) == (100e6, 0.0, 0.0)
    # AdamW-DDP's step is its compute plus its traffic at the recorded rate
    model = timeline(run, link)
    assert model.total_s > 6 * model.compute_s_per_step
    with pytest.raises(ValueError, match="records no shaped links"):
        recorded_link([run, load_run(equal.run_dir)])
    # runs on different links are not placed on one (each panel is one link)
    thinner = dataclasses.replace(run, path=run.path.with_name("thinner"),
                                  summary={**run.summary, "node_link_bps": [100e6, 10e6]})
    with pytest.raises(ValueError, match=r"different links \(10 Mbit/s: .*thinner; 100 Mbit/s: "):
        recorded_link([run, thinner])
    # lowcomm-wallclock --link recorded: each run on its own links
    from lowcomm.cli.report import wallclock_main

    assert wallclock_main(["--runs", str(linked.run_dir), "--link", "recorded", "--out", str(tmp_path)]) == 0
    assert "### recorded 100 Mbit/s (the slowest node's)" in (tmp_path / "wallclock.md").read_text()
    assert wallclock_main(["--runs", str(equal.run_dir), "--link", "recorded", "--out", str(tmp_path)]) == 2
