"""benchmarks/stragglers.py's plumbing on a short run (issue 47): network-namespace nodes made and
deleted, one node made slower for real (its compute stretched, its link shaped thinner), the same
training in every case, and the wall-clock model's prediction beside each measurement, with the
JSON line last. (How close the prediction comes is the benchmark's to print: timings are never
asserted.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from netns_helpers import left_behind, run_shaping_benchmark

REPO_ROOT = Path(__file__).resolve().parents[1]
STRAGGLERS = REPO_ROOT / "benchmarks" / "stragglers.py"

pytestmark = pytest.mark.slow


def test_a_slow_node_and_a_thin_link_on_two_nodes(tmp_path):
    done = run_shaping_benchmark(STRAGGLERS, "--nodes", "2", "--methods", "diloco", "--steps", "10", "--slowdown", "3",
                                 "--link", "100M", "--slow-link", "10M", "--out", str(tmp_path),
                                 "--work", str(tmp_path / "runs"), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "stragglers.json").read_text())
    assert left_behind(result["namespaces"]) == [], "the benchmark's namespaces were not deleted"

    # node 1's veth shaped to 10 Mbit/s in the slow-link case only, node 0's to 100 Mbit/s
    assert "rate 10Mbit" in result["shaped"]["slow link"].split(";")[1]
    assert "rate 100Mbit" in result["shaped"]["slow link"].split(";")[0]
    assert "rate 10Mbit" not in result["shaped"]["equal"] and "tbf" not in result["shaped"]["unshaped"]
    cases = result["methods"]["DiLoCo H=10"]["cases"]
    assert set(cases) == {"equal", "slow compute", "slow link"}
    # the slow node slept, the other did not; the training is the same in every case
    assert cases["slow compute"]["stretched_s"][1] > 0 and cases["slow compute"]["stretched_s"][0] == 0
    assert cases["equal"]["stretched_s"] is None
    assert len({entry["final_val_loss"] for entry in cases.values()}) == 1
    # the model takes the slowdown as the stretch gives it on the wall clock: a worker sharing a
    # core is stretched by its CPU time, its share of the wall time (2 nodes: a core each on 2 cores)
    share = min(1.0, len(os.sched_getaffinity(0)) / 2)
    assert result["core_share"] == share and result["slowdown_on_the_wall_clock"] == pytest.approx(1 + 2 * share)
    # the links are the runs' own settings, recorded in their config and summary, and the model
    # takes the rate from that record: a ring goes at its slowest node's
    assert (cases["equal"]["link_bps"], cases["slow link"]["link_bps"]) == (100e6, 10e6)
    [slow_link_summary] = (tmp_path / "runs" / "slow_link").rglob("summary.json")
    summary = json.loads(slow_link_summary.read_text())
    assert summary["node_link_bps"] == [100e6, 10e6] and summary["slow_link_nodes"] == [1]
    assert (summary["link_rate"], summary["slow_link_rate"]) == ("100M", "10M")
    assert summary["links_shaped_by"].startswith("benchmarks/wan.py's Nodes")
    config = (slow_link_summary.parent / "config.yaml").read_text()
    assert "slow_link_nodes:\n  - 1" in config and "slow_link_rate: 10M" in config
    for entry in cases.values():
        assert entry["predicted_s"] is not None and entry["measured_s"] is not None
        assert entry["framing_bytes_per_message"] >= 0

    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["target_loss"] == result["target_loss"]
    assert set(last["methods"]["DiLoCo H=10"]) == {"equal", "slow compute", "slow link"}
    table = (tmp_path / "summary.md").read_text()
    assert "| DiLoCo H=10 | slow compute |" in table and "predictions within 25%" in table
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0
