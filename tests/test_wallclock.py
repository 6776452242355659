"""The wall-clock model (lowcomm.report.wallclock) on hand-computed cases, and its command."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from lowcomm.cli.report import wallclock_main
from lowcomm.config import validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.report.runs import RunRecord, load_run
from lowcomm.report.wallclock import (
    DEFAULT_LINKS,
    Link,
    default_target,
    parse_link,
    step_seconds,
    timeline,
)
from lowcomm.rundir import RunDir
from runs import point_id, quickstart_points

FLOOR = 2.0
QUICKSTART = quickstart_points()


def _config(*overrides: str) -> dict:
    return OmegaConf.to_container(compose(["wandb.mode=disabled", *overrides]), resolve=True)


def _record(config: dict, metrics: list[dict], tokens_per_s: float | None = None, path="run") -> RunRecord:
    summary = None
    if tokens_per_s is not None:
        summary = {"tokens_per_s": tokens_per_s, "bayes_floor": FLOOR, "world_size": 4}
    return RunRecord(path=path, config=config, metrics=metrics, summary=summary)


def _sync_every_two(losses=(3.0, 2.5)) -> list[dict]:
    """DiLoCo-like: 1 MB in 3 messages per rank every second step; validations at steps 2 and 4."""
    return [
        {"step": 1, "comm/cum_tx_MB": 0.0, "comm/cum_messages": 0},
        {"step": 2, "comm/cum_tx_MB": 1.0, "comm/cum_messages": 3, "val/loss": losses[0]},
        {"step": 4, "comm/cum_tx_MB": 2.0, "comm/cum_messages": 6, "val/loss": losses[1]},
    ]


def test_a_link_sends_bytes_at_its_bandwidth_and_pays_its_latency_per_message():
    link = Link("lab", 8e6, 0.01)  # 1 MB/s
    assert link.seconds(1e6, 3) == pytest.approx(1.03)
    assert link.seconds(0, 0) == 0


@pytest.mark.parametrize(("text", "bandwidth", "latency"), [
    ("wan:1G:10ms", 1e9, 10e-3), ("lab:100Mbit:2ms", 100e6, 2e-3), ("ib:100Gbit/s:5us", 100e9, 5e-6),
    ("x:2.5e8:0.5s", 2.5e8, 0.5), ("site:a:10M:1ms", 10e6, 1e-3),
])
def test_links_are_parsed_with_their_units(text, bandwidth, latency):
    link = parse_link(text)
    assert link.bandwidth_bps == pytest.approx(bandwidth) and link.latency_s == pytest.approx(latency)


@pytest.mark.parametrize(("text", "says"), [("wan:1G:10", "needs a unit"), ("wan:fast:1ms", "bandwidth"),
                                            ("1G:10ms", "NAME:BANDWIDTH:LATENCY"), ("wan:0:1ms", "must be > 0")])
def test_a_malformed_link_is_named(text, says):
    with pytest.raises(ValueError, match=says):
        parse_link(text)


def test_overlap_hides_traffic_up_to_its_share_of_the_compute():
    assert step_seconds(1.0, 0.5, 2 / 3) == pytest.approx(1.0)        # hidden behind the backward
    assert step_seconds(1.0, 1.0, 2 / 3) == pytest.approx(1 + 1 / 3)  # the rest waits
    assert step_seconds(1.0, 1.0, 0.0) == pytest.approx(2.0)


def test_a_run_is_placed_in_time_window_by_window():
    # compute: 16 x 128 tokens per step at 4096 tokens/s = 0.5 s; link: 1 MB/s, 0.1 s per message
    run = _record(_config("optimizer=diloco", "optimizer.sync_every=2", "train.global_batch_size=16",
                          "train.seq_len=128"), _sync_every_two(), tokens_per_s=4096)
    item = timeline(run, Link("lab", 8e6, 0.1))
    assert item.compute_s_per_step == pytest.approx(0.5) and item.overlap == 0.0
    # step 1: 0.5 s; step 2: + 0.5 + 1 MB (1 s) + 3 x 0.1 s; steps 3-4: + 2 x 0.5 + 1.3
    assert item.seconds == pytest.approx([0.5, 2.3, 4.6])
    assert item.comm_s_per_step == pytest.approx(2.6 / 4)
    assert item.time_to_excess(0.75) == pytest.approx(4.6)   # 2.5 - 2.0 = 0.5 <= 0.75 at step 4 only
    assert item.time_to_excess(1.0) == pytest.approx(2.3)    # 3.0 - 2.0 = 1.0 at step 2
    assert item.time_to_excess(0.1) is None


def test_ddp_traffic_hides_behind_the_backward_pass():
    # AdamW-DDP: 1 MB per step in 6 messages, compute 0.5 s; link 1 MB/s, no latency
    metrics = [{"step": s, "comm/cum_tx_MB": float(s), "comm/cum_messages": 6 * s} for s in (1, 2)]
    run = _record(_config("optimizer=adamw_ddp", "train.global_batch_size=16", "train.seq_len=128"), metrics,
                  tokens_per_s=4096)
    run.summary["parameters"] = 319_946_752  # OLMo-300M's gradients: 49 DDP buckets
    item = timeline(run, Link("lab", 8e6, 0.0))
    assert item.overlap == pytest.approx(2 / 3 * 48 / 49)
    hidden = 0.5 * 2 / 3 * 48 / 49
    assert item.seconds == pytest.approx([0.5 + 1 - hidden, 2 * (0.5 + 1 - hidden)])


def test_traffic_hides_behind_the_time_the_run_measured_it_in_flight():
    # DeMo-like: 1 MB in 10 messages per step, compute 0.5 s, 0.3 s of each step computing with
    # an all-gather in flight (perf/in_flight_s); link 1 MB/s, no latency
    metrics = [{"step": s, "comm/cum_tx_MB": float(s), "comm/cum_messages": 10 * s, "perf/in_flight_s": 0.3}
               for s in (1, 2)]
    run = _record(_config("optimizer=demo", "train.global_batch_size=16", "train.seq_len=128"), metrics,
                  tokens_per_s=4096)
    item = timeline(run, Link("lab", 8e6, 0.0))
    assert item.overlap == 0.0  # DeMo states none; the run measured 0.3 s
    assert item.seconds == pytest.approx([0.5 + 1 - 0.3, 2 * (0.5 + 1 - 0.3)])
    assert step_seconds(1.0, 0.2, 0.0, in_flight_s=0.5) == pytest.approx(1.0)  # all of it hidden
    assert step_seconds(1.0, 1.0, 0.5, in_flight_s=0.2) == pytest.approx(1.5)  # the larger of the two
    # in flight for 3 s of a 1 s step (its rank waited 2 s on a flag queued behind it): it hid 1 s, not 3
    assert step_seconds(1.0, 3.0, 1.0, in_flight_s=3.0) == pytest.approx(3.0)


def test_intra_node_traffic_crosses_the_intra_node_link():
    # FlexDeMo: of 3 MB in 10 messages, 2 MB in 8 messages inside the node
    metrics = [{"step": 1, "comm/cum_tx_MB": 3.0, "comm/cum_messages": 10, "comm/cum_intra_tx_MB": 2.0,
                "comm/cum_intra_messages": 8}]
    run = _record(_config("optimizer=flexdemo", "train.global_batch_size=16", "train.seq_len=128"), metrics,
                  tokens_per_s=4096)
    item = timeline(run, Link("wan", 8e6, 0.1), intra=Link("nvlink", 8e9, 0.001))
    assert item.seconds == pytest.approx([0.5 + (1 + 2 * 0.1) + (0.002 + 8 * 0.001)])


def test_a_shared_inter_node_link_divides_among_the_ranks_that_cross_it_at_once():
    # FlexDeMo on nodes of 2 ranks: of 3.5 MB in 14 messages, 2 MB in 8 inside the node, 1 MB in 4
    # across (every rank of a node at once), 0.5 MB in 2 of world control traffic (a ring: one rank
    # of the node at a time)
    metrics = [{"step": 1, "comm/cum_tx_MB": 3.5, "comm/cum_messages": 14, "comm/cum_intra_tx_MB": 2.0,
                "comm/cum_intra_messages": 8, "comm/cum_inter_tx_MB": 1.0, "comm/cum_inter_messages": 4}]
    run = _record(_config("optimizer=flexdemo", "train.global_batch_size=16", "train.seq_len=128"), metrics,
                  tokens_per_s=4096)
    wan, nvlink = Link("wan", 8e6, 0.1, framing_bytes=1000), Link("nvlink", 8e9, 0.001)
    intra = 2e6 / 1e9 + 8 * 0.001
    world = (0.5e6 + 2 * 1000) / 1e6 + 2 * 0.1
    own = timeline(run, wan, intra=nvlink)
    assert own.seconds == pytest.approx([0.5 + world + ((1e6 + 4 * 1000) / 1e6 + 4 * 0.1) + intra])
    shared = timeline(run, wan, intra=nvlink, ranks_per_link=2)
    assert shared.seconds == pytest.approx([0.5 + world + (2 * (1e6 + 4 * 1000) / 1e6 + 4 * 0.1) + intra])
    with pytest.raises(ValueError, match="at least 1"):
        timeline(run, wan, ranks_per_link=0)


def test_a_link_charges_its_framing_per_message_at_its_bandwidth():
    assert Link("veth", 8e6, 0.0, framing_bytes=800).seconds(1e6, 10) == pytest.approx(1.008)
    with pytest.raises(ValueError, match="framing"):
        Link("veth", 8e6, 0.0, framing_bytes=-1)


def test_a_run_without_message_counts_is_refused_by_name():
    metrics = [{"step": 1, "comm/cum_tx_MB": 1.0}]
    run = _record(_config(), metrics, tokens_per_s=4096, path="runs/old-run")
    with pytest.raises(ValueError, match="runs/old-run.*comm/cum_messages"):
        timeline(run, DEFAULT_LINKS[0])


def test_the_default_target_is_reached_by_every_run():
    config = _config("optimizer=diloco", "optimizer.sync_every=2")
    runs = [_record(config, _sync_every_two(losses), tokens_per_s=4096) for losses in ((3.0, 2.5), (3.2, 2.9))]
    items = [timeline(run, DEFAULT_LINKS[0]) for run in runs]
    target = default_target(items)
    assert target == pytest.approx(0.9)
    assert all(item.time_to_excess(target) is not None for item in items)


@pytest.mark.parametrize("point", sorted(QUICKSTART), ids=point_id)
def test_every_optimizer_states_how_much_of_its_traffic_compute_can_hide(point):
    """The quickstart covers every registered optimizer (test_resume checks it)."""
    strategy, cfg = validate_optimizer(_config(*QUICKSTART[point]))
    # a fragment every H / P = 10 / 2 steps, merged tau = 1 step later: 1 of 5 steps; under the
    # quantized all-reduce only its all-to-all, half of the bytes, is in flight then: 1 of 10.
    # NoLoCo: the outer step waits for its peer's weights before it moves, nothing in flight: 0.
    # DisTrO's all-gather starts after step t's encoding and is waited for after step t+1's: a
    # whole step of compute, whatever the model.
    # Eager DiLoCo: the dense all-reduce of one outer step is waited for at the next, H steps
    # later: in flight during every step's compute, 1
    # Decoupled DiLoCo: offers sent and merges received by threads of their own, never waited for
    # (wait: false): 1. Asynchronous DiLoCo: a learner waits for the reply to its push: 0
    expected = {"streaming_diloco": 1 / 10, "noloco": 0.0, "distro": 1.0, "eager_diloco": 1.0,
                "decoupled_diloco": 1.0}
    # DDP: the tiny model's 155,648 fp32 gradients (0.6 MB) fit one 25 MiB bucket, sent after
    # the backward: nothing overlaps. OLMo-300M's 319,946,752 (1,279,787,008 B) fill 49 buckets
    # (48.8 x 26,214,400 B): all but the last behind the backward's 2/3 of the step
    assert strategy.comm_overlap(cfg, 155_648) == pytest.approx(expected.get(strategy.name, 0.0))
    ddp = strategy.name in ("adamw_ddp", "muon_ddp", "powersgd")
    assert strategy.comm_overlap(cfg, 319_946_752) == pytest.approx(2 / 3 * 48 / 49 if ddp else
                                                                    expected.get(strategy.name, 0.0))


def _write_run(directory, config: dict, metrics: list[dict], summary: dict) -> None:
    run_dir = RunDir(directory)
    directory.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(config), run_dir.config)
    run_dir.metrics.write_text("".join(json.dumps(record) + "\n" for record in metrics))
    run_dir.summary.write_text(json.dumps(summary))


def test_streaming_diloco_hides_its_whole_exchange_when_it_all_gathers_or_sends_dense():
    """The all-gather (or the dense all-reduce) is in flight whole during the tau steps."""
    for overrides in (["optimizer.exchange=all_gather"], ["optimizer.quantization=none"]):
        strategy, cfg = validate_optimizer(_config("optimizer=streaming_diloco", "optimizer.sync_every=10",
                                                   "optimizer.num_fragments=2", *overrides))
        assert strategy.comm_overlap(cfg, 155_648) == pytest.approx(1 / 5)


def test_the_command_prints_the_time_to_target_per_link_and_draws_one_panel_each(tmp_path, capsys, monkeypatch):
    summary = {"tokens_per_s": 4096, "bayes_floor": FLOOR, "world_size": 4, "final_val_loss": 2.5}
    _write_run(tmp_path / "runs" / "a", _config("optimizer=diloco", "optimizer.sync_every=2",
                                                "train.global_batch_size=16", "train.seq_len=128",
                                                "label=DiLoCo"), _sync_every_two(), summary)
    import matplotlib.pyplot as plt

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    code = wallclock_main(["--runs", str(tmp_path / "runs" / "*"), "--link", "lab:8M:100ms", "--link", "ib:100G:5us",
                           "--target-excess", "0.75", "--out", str(tmp_path / "out"), "--formats", "png",
                           "--title", "my sweep"])
    assert code == 0
    # --title is the figure's; each panel keeps its link's (the last link's once stood for both)
    assert closed[-1]._suptitle.get_text() == "my sweep"
    assert [ax.get_title() for ax in closed[-1].axes] == ["lab (8 Mbit/s, 100 ms per message)",
                                                          "ib (100 Gbit/s, 5 µs per message)"]
    assert closed[-1].axes[0].get_ylabel() == f"validation loss \u2212 Bayes floor ({FLOOR:.3f})"
    printed = capsys.readouterr().out
    assert "lab (8 Mbit/s, 100 ms per message)" in printed and "ib (100 Gbit/s, 5 µs per message)" in printed
    assert "| DiLoCo | 4 | 0.5 | 0.65 | 0.00 | 4.6 s | 4.6 s |" in printed
    rows = (tmp_path / "out" / "wallclock.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("link,run,world_size")
    assert (tmp_path / "out" / "loss_vs_wallclock.png").stat().st_size > 0
    assert math.isclose(float(rows[1].split(",")[6]), 4.6)
    assert load_run(tmp_path / "runs" / "a").world_size == 4


def test_the_command_names_a_bad_link(tmp_path, capsys):
    with pytest.raises(SystemExit):
        wallclock_main(["--runs", str(tmp_path / "*"), "--link", "wan:1G"])
    assert "NAME:BANDWIDTH:LATENCY" in capsys.readouterr().err


def test_the_command_states_a_shared_link_and_refuses_a_share_of_none(tmp_path, capsys):
    summary = {"tokens_per_s": 4096, "bayes_floor": FLOOR, "world_size": 4, "final_val_loss": 2.5}
    _write_run(tmp_path / "runs" / "a", _config("optimizer=diloco", "optimizer.sync_every=2",
                                                "train.global_batch_size=16", "train.seq_len=128",
                                                "label=DiLoCo"), _sync_every_two(), summary)
    assert wallclock_main(["--runs", str(tmp_path / "runs" / "*"), "--link", "lab:8M:100ms", "--ranks-per-link", "8",
                           "--target-excess", "0.75", "--out", str(tmp_path / "out"), "--formats", "png"]) == 0
    assert "one link per node, shared by its 8 ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        wallclock_main(["--runs", str(tmp_path / "runs" / "*"), "--ranks-per-link", "0"])
    assert "--ranks-per-link must be >= 1" in capsys.readouterr().err
