"""The methods of learners on network-namespace nodes (issue 47; benchmarks/learners_wire.py): two
learner nodes and the synchronizer's own node, each a real process on its node. Each node's veth
carries what its process metered sent, plus TCP/IP's framing (the overheads the collectives'
wire checks use, tests/netns_helpers.py); summed over the three, metered sends equal metered
receipts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from netns_helpers import OVERHEAD_PER_BYTE_LOADED_MAX, need_iproute2, netns_unavailable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

pytestmark = pytest.mark.slow

# A learner's veth also carries the ACKs of what it receives (about as much as it sends) and its
# connection's set-up and tear-down: a few kB over a run.
CONNECTION_BYTES = 20_000


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        netns_unavailable("not root (ip netns add needs CAP_SYS_ADMIN)")
    need_iproute2()


def test_each_nodes_veth_carries_what_its_learner_or_synchronizer_metered():
    from learners_wire import METHODS, run

    result = run(nodes_count=2, steps=20)
    assert set(result["methods"]) == set(METHODS) == {"decoupled_diloco", "async_diloco"}
    for method, figures in result["methods"].items():
        nodes = figures["per_node"]
        assert [node["role"] for node in nodes] == ["learner", "learner", "synchronizer"]
        for index, node in enumerate(nodes):
            sent, kernel = node["metered_tx"], node["kernel_tx"]
            assert sent > 100_000, (method, index, node)  # every node sent its fragments, or its merges
            ceiling = sent * (1 + OVERHEAD_PER_BYTE_LOADED_MAX) + CONNECTION_BYTES
            assert sent <= kernel <= ceiling, (method, index, node)
        # what the learners sent, the synchronizer received, and the other way round
        assert sum(node["metered_tx"] for node in nodes) == sum(node["metered_rx"] for node in nodes), method
        assert nodes[2]["metered_rx"] == nodes[0]["metered_tx"] + nodes[1]["metered_tx"], method
