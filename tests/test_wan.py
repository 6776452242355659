"""benchmarks/wan.py's plumbing on a short run: a namespace made and deleted, its loopback shaped
with tc, real training on both sides of the shaping, the kernel's byte count beside the meter's,
and the wall-clock model's prediction written beside each measurement. (How close the prediction
comes is the benchmark's to print, not a test's: timings are never asserted.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from netns_helpers import left_behind, run_shaping_benchmark

REPO_ROOT = Path(__file__).resolve().parents[1]
WAN = REPO_ROOT / "benchmarks" / "wan.py"

pytestmark = pytest.mark.slow


def test_a_short_run_over_a_shaped_loopback_reports_measurement_and_prediction(tmp_path):
    # (one method: the second test runs the DeMo family, whose exchanges overlap its compute)
    done = run_shaping_benchmark(WAN, "--workers", "2", "--steps", "4", "--links", "50M", "--optimizers", "AdamW-DDP",
                                 "--out", str(tmp_path), "--work", str(tmp_path / "runs"), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "wan.json").read_text())
    assert left_behind(result["namespaces"]) == [], "the benchmark's namespace was not deleted"

    assert list(result["links"]) == ["unshaped", "50Mbit"]
    assert result["links"]["unshaped"]["tc"] == "" or "tbf" not in result["links"]["unshaped"]["tc"]
    assert "tbf" in result["links"]["50Mbit"]["tc"] and "rate 50Mbit" in result["links"]["50Mbit"]["tc"]
    for label in ("AdamW-DDP",):
        unshaped, shaped = result["links"]["unshaped"]["runs"][label], result["links"]["50Mbit"]["runs"][label]
        # the same training on both sides of the shaping
        assert unshaped["final_val_loss"] == shaped["final_val_loss"]
        assert unshaped["metered_tx_MB_per_step"] == shaped["metered_tx_MB_per_step"] > 0
        # the kernel carried at least what the meter counted (plus the wire's framing)
        assert shaped["kernel_MB_per_step"] >= shaped["metered_tx_MB_per_step"]
        # the model adds the link's exposed time to the unshaped run's compute: more than it where
        # nothing overlaps (AdamW-DDP's all-reduce, waited for at once)
        assert shaped["in_flight_s_per_step"] == 0
        assert shaped["predicted_step_s"] > unshaped["measured_step_s"]
        assert shaped["comm_s_per_step"] > 0 and shaped["framing_bytes_per_message"] > 0
    table = (tmp_path / "summary.md").read_text()
    assert "| 50Mbit | AdamW-DDP |" in table and "predicted" in table
    assert (tmp_path / "loss_vs_time_50Mbit.png").stat().st_size > 0
    assert (tmp_path / "step_time_measured_vs_predicted.png").stat().st_size > 0


def test_two_nodes_shape_each_veth_and_leave_the_loopbacks_alone(tmp_path):
    """--nodes 2: a namespace per node, each node's veth shaped; FlexDeMo's replicas across nodes
    share their node's veth (the model's ranks per link), its shard group stays on the loopback."""
    done = run_shaping_benchmark(WAN, "--nodes", "2", "--steps", "3", "--links", "50M", "--optimizers", "FlexDeMo k=32",
                                 "--out", str(tmp_path), "--work", str(tmp_path / "runs"), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "wan.json").read_text())
    assert len(result["namespaces"]) == 2 and left_behind(result["namespaces"]) == []
    assert (result["nodes"], result["ranks_per_node"], result["world_size"]) == (2, 2, 4)
    shaped_tc = result["links"]["50Mbit"]["tc"]
    assert shaped_tc.count("rate 50Mbit") == 2  # both nodes' veths
    unshaped, shaped = (result["links"][name]["runs"]["FlexDeMo k=32"] for name in ("unshaped", "50Mbit"))
    assert unshaped["final_val_loss"] == shaped["final_val_loss"]
    # the veths carry FlexDeMo's inter-node traffic only: far less than all it meters (the shard group's)
    assert 0 < shaped["kernel_MB_per_step"] < shaped["metered_tx_MB_per_step"] / 10
    assert shaped["framing_bytes_per_message"] > 0 and shaped["comm_s_per_step"] > 0
    # the model adds the link's exposed time to the unshaped run's compute, never less than it (the
    # DeMo family's all-gathers may hide behind its next bucket's encoding, whose measured length
    # varies with the machine's load)
    assert shaped["predicted_step_s"] >= unshaped["measured_step_s"]
    assert "2 nodes x 2 gloo workers" in (tmp_path / "summary.md").read_text()


def test_every_optimizer_the_benchmark_names_is_a_valid_config(tmp_path):
    """A renamed key or method fails here, not after an hour of shaped runs; --overlapped pairs
    each overlapped method with its blocking self at the same bytes per step."""
    sys.path.insert(0, str(WAN.parent))
    try:
        import wan
    finally:
        sys.path.remove(str(WAN.parent))
    from lowcomm.config import validate
    from lowcomm.config.compose import compose

    runs = {label: validate(compose(wan._overrides(label, 10, tmp_path, 2))) for label in wan.OPTIMIZERS}
    demo, distro, diloco, eager = (runs[label] for label in wan.OVERLAPPED_OPTIMIZERS)
    assert (demo.optimizer_name, distro.optimizer_name, diloco.optimizer_name, eager.optimizer_name) == (
        "demo", "distro", "diloco", "eager_diloco")
    assert demo.optimizer.wire == distro.optimizer.wire == "signbit"
    assert demo.optimizer.compression_topk == distro.optimizer.compression_topk == 32
    assert diloco.optimizer.sync_every == eager.optimizer.sync_every == 10
