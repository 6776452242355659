"""The meter against the kernel: W = 4 gloo workers in a private network namespace, where every
byte they exchange crosses that namespace's loopback and its counters are the ground truth.

benchmarks/wire_check.py does the measuring (``--inside``, run here under ``ip netns exec``):
bare collectives and a point-to-point exchange in pairs, then a few steps of AdamW-DDP, of DeMo,
of DiLoCo with a 2-bit quantized pseudo-gradient (the quantized all-reduce) and of NoLoCo (its
peer exchange) on the tiny model, each window's loopback byte count
beside the meter's tx and messages summed over ranks.

Measured on the 2-core CI machine (10 optimizer steps each unless said, sums over 4 ranks):

    window               metered tx MB  messages  kernel MB
    all_gather 1 MB x3         36.000        36     36.094
    all_reduce 1 MB x3         18.000        72     18.066
    all_reduce_quantized x3    18.001        72     18.061   (2-bit, 1 MB of codes; 2026-11-24)
    all_gather 16 B x300        0.058      3600      2.546
    adamw_ddp x 10 steps       18.678       240     18.892   (predicted 18.882)
    demo x 10 steps             1.751      2160      3.268   (predicted 3.250)
    diloco 2-bit x 5 steps      1.185       120      1.254   (predicted 1.279; 2026-11-24)
    exchange 1 MB x3           12.000        12     12.022   (pairs 0-1, 2-3; 2026-11-25)
    noloco x 5 steps           24.904       360     25.036   (predicted 25.204; 2026-11-25)

    overhead per byte 0.18 %, per message 690 bytes (TCP/IP headers and acknowledgements,
    about 7.7 loopback packets per gloo message, and gloo's own framing)

So the bytes of a large collective are the meter's within 0.5 % (the quantized all-reduce of a
1 MB 2-bit payload moves 1.5 MB per rank, as a ring all-reduce would, where an all-gather of it
moves 3 MB), and DeMo's step, two
all-gathers per parameter, costs 1.87x its metered bytes through per-message overhead alone.
The bounds below are stated around those measurements with room for a busier machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lowcomm.models import ModelSpec, build_model
from netns_helpers import (
    OVERHEAD_PER_BYTE_MAX,
    OVERHEAD_PER_MESSAGE,
    listed_namespaces,
    need_iproute2,
    netns_unavailable,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
WIRE_CHECK = REPO_ROOT / "benchmarks" / "wire_check.py"
WORLD, STEPS = 4, 5
PREDICTION_TOLERANCE = 0.05  # kernel vs tx x (1 + per byte) + messages x per message; measured 0.1-0.6 %

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def netns():
    """A private network namespace with its loopback up; deleted in teardown whatever happens."""
    if os.geteuid() != 0:
        netns_unavailable("not root (ip netns add needs CAP_SYS_ADMIN)")
    need_iproute2()
    name = f"lowcomm-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if added.returncode != 0:
        netns_unavailable(f"ip netns add failed: {added.stderr.strip()}")
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        assert name not in listed_namespaces(), f"namespace {name} was not deleted"


@pytest.fixture(scope="module")
def wire(netns):
    done = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, str(WIRE_CHECK), "--inside", "--steps", str(STEPS),
         "--json", "/dev/stdout"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_metered_tx_and_messages_account_for_the_kernels_bytes(wire):
    windows = wire["windows"]
    per_byte, per_message = wire["overhead_per_byte"], wire["overhead_per_message"]
    assert 0 <= per_byte <= OVERHEAD_PER_BYTE_MAX, per_byte
    assert OVERHEAD_PER_MESSAGE[0] <= per_message <= OVERHEAD_PER_MESSAGE[1], per_message
    barrier = windows["empty"]["kernel_bytes"]

    # bare collectives, per rank and call: the ring's (W-1) x and 2(W-1)/W x of 1 MB
    calls = 3 * WORLD
    gathered = (windows["all_gather 1 MB"]["kernel_bytes"] - barrier) / calls
    reduced = (windows["all_reduce 1 MB"]["kernel_bytes"] - barrier) / calls
    assert 3.0e6 <= gathered <= 3.0e6 * 1.02, gathered  # a ring all-gather: every rank sends (W-1) MB
    assert 1.5e6 <= reduced <= 1.5e6 * 1.02, reduced
    # the quantized all-reduce: the kernel carries what the meter says (all-to-all + all-gather,
    # about 2 (W-1)/W of the 2-bit payload), not an all-gather's (W-1) x
    quantized = windows["all_reduce_quantized 1 MB"]
    assert quantized["tx"] <= quantized["kernel_bytes"] - barrier <= quantized["tx"] * 1.02 + quantized["messages"] * 1500
    # per rank and call: four chunks of 250,000 bytes of codes and a 16-byte table; three go out
    # in the all-to-all, three reduced ones are forwarded in the all-gather: 1,500,096 bytes
    assert quantized["tx"] / calls == 1_500_096

    # the point-to-point exchange in pairs: each rank's 1 MB once to its peer, no forwarding
    exchanged = windows["exchange 1 MB"]
    assert exchanged["tx"] == calls * 1_000_000
    assert exchanged["tx"] <= exchanged["kernel_bytes"] - barrier <= exchanged["tx"] * 1.02 + exchanged["messages"] * 1500

    for name in (f"adamw_ddp x {STEPS} steps", f"demo x {STEPS} steps", f"diloco 2-bit x {STEPS} steps",
                 f"noloco x {STEPS} steps"):
        window = windows[name]
        # the meter never claims more than the kernel carried...
        assert window["tx"] <= window["kernel_bytes"] - barrier, name
        # ...and its bytes and messages, at the stated overheads, account for all of it
        assert abs(window["kernel_bytes"] / window["predicted_bytes"] - 1) <= PREDICTION_TOLERANCE, (name, window)


def _demo_buckets(spec: ModelSpec) -> int:
    """DeMo's buckets as its docstring states the rule: its parameters in optimizer order, cut
    whenever the next would take a bucket past the largest parameter's element count."""
    from omegaconf import OmegaConf

    from lowcomm.comm import Communicator
    from lowcomm.config import validate_optimizer
    from lowcomm.config.compose import compose

    raw = OmegaConf.to_container(compose(["optimizer=demo"]), resolve=True)
    strategy_cls, cfg = validate_optimizer(raw)
    _, optimizer = strategy_cls(cfg, raw["compression"], Communicator()).build(build_model(spec, "meta"))
    sizes = [p.numel() for group in optimizer.param_groups for p in group["params"]]
    buckets, filled = 0, None
    for size in sizes:
        if filled is None or filled + size > max(sizes):
            buckets, filled = buckets + 1, 0
        filled += size
    return buckets


def test_demo_sends_two_all_gathers_per_bucket_per_step(wire):
    spec = ModelSpec(**_tiny_model_group())
    tensors = sum(1 for p in build_model(spec, "meta").parameters() if p.requires_grad)
    buckets = _demo_buckets(spec)
    assert 1 < buckets < tensors  # the bucketed exchange: fewer calls than one per parameter
    demo = wire["windows"][f"demo x {STEPS} steps"]
    # indices and values of each bucket, each a ring all-gather of W-1 sends, on every rank, every step
    assert demo["messages"] == STEPS * WORLD * buckets * 2 * (WORLD - 1)
    adamw = wire["windows"][f"adamw_ddp x {STEPS} steps"]
    # DDP: the tiny model's gradients fit one 25 MB bucket: one all-reduce, 2(W-1) sends
    assert adamw["messages"] == STEPS * WORLD * 2 * (WORLD - 1)
    # DeMo's metered bytes are far below AdamW's, its kernel bytes much less so: the messages
    assert demo["kernel_bytes"] / demo["tx"] > 1.3 > adamw["kernel_bytes"] / adamw["tx"]


def _tiny_model_group() -> dict:
    from omegaconf import OmegaConf

    from lowcomm.config.compose import compose

    return OmegaConf.to_container(compose([]), resolve=True)["model"]
