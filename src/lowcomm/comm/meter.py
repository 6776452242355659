"""Byte accounting for every collective lowcomm issues.

Four numbers per collective call, all for *this* rank:

- ``payload``: the size of the message this rank contributes (the DeMo paper's
  "Tx MB/step" convention: what one worker puts on the wire, before any algorithm
  multiplies it);
- ``tx`` / ``rx``: the bytes this rank sends / receives under the algorithm gloo and NCCL
  actually run (ring all-reduce, ring all-gather, ring reduce-scatter, chain broadcast, and
  the point-to-point exchange with a peer);
- ``messages``: the sends this rank issues (a ring all-gather is W-1 of them, a ring
  all-reduce 2(W-1)). On a real link each costs a fixed amount on top of its bytes, so a
  step of many small collectives (DeMo: two all-gathers per parameter) costs more than its
  bytes say; ``comm/messages`` puts the count beside the bytes.

The formulas were checked against the kernel's own counters (benchmarks/wire_check.py,
tests/test_wire.py: gloo workers in a private network namespace, its loopback's byte count).

Records are bucketed by ``(scope, collective)``. ``scope`` says which link a byte crossed
(``world``, or ``intra`` / ``inter`` for hierarchical layouts) and ``purpose`` separates the
optimizer's traffic (``data``) from the harness's own bookkeeping (``control``: validation
loss reductions, preemption flags, checkpoint barriers; ``heal``: a replica group's state sent
by a live peer when it rejoins, :mod:`lowcomm.comm.ft`), so that the paper's MB/step column is
the optimizer's bytes alone while no byte goes unmetered.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

FIELDS = ("payload", "tx", "rx", "messages")


class Traffic(NamedTuple):
    """What one rank puts on and takes off the wire in one collective call.

    ``tx`` / ``rx`` are bytes; ``messages`` counts the sends this rank issues (each one a
    message with a fixed cost on a real link: headers, acknowledgements, a round of latency).
    ``received`` counts the messages it takes in, so that conservation (every message sent is
    received) can be checked over ranks as for bytes."""

    tx: int
    rx: int
    messages: int
    received: int


# One formula per collective, each under the algorithm gloo and NCCL actually run. Ring order:
# rank r sends to r+1 and receives from r-1. Per-rank bytes use integer division where the ring
# splits a buffer into W chunks; summed over ranks tx equals rx exactly for every formula
# (tests/test_comm.py checks it, and checks the formulas against a step-by-step ring).


def ring_all_reduce_traffic(payload: int, world_size: int) -> Traffic:
    """Ring all-reduce = reduce-scatter then all-gather of W chunks: 2(W-1) sends of
    payload/W each, 2(W-1)/W x payload each way."""
    if world_size <= 1:
        return Traffic(0, 0, 0, 0)
    moved = 2 * (world_size - 1) * payload // world_size
    return Traffic(moved, moved, 2 * (world_size - 1), 2 * (world_size - 1))


def ring_all_gather_traffic(payload: int, world_size: int) -> Traffic:
    """Ring all-gather: W-1 steps, in each a rank forwards one rank's message to its
    neighbour, so every rank sends (and receives) (W-1) x payload in W-1 messages. (Not
    ``tx = payload``: a rank forwards the others' messages too, or the sums would not balance.)"""
    if world_size <= 1:
        return Traffic(0, 0, 0, 0)
    moved = (world_size - 1) * payload
    return Traffic(moved, moved, world_size - 1, world_size - 1)


def ring_reduce_scatter_traffic(payload: int, world_size: int) -> Traffic:
    """Ring reduce-scatter of a ``payload``-byte input (W chunks): W-1 sends of one chunk,
    (W-1)/W x payload each way (NCCL's)."""
    if world_size <= 1:
        return Traffic(0, 0, 0, 0)
    moved = (world_size - 1) * payload // world_size
    return Traffic(moved, moved, world_size - 1, world_size - 1)


def reduce_scatter_traffic(payload: int, world_size: int, backend: str = "nccl") -> Traffic:
    """A reduce-scatter as ``backend`` runs it: NCCL's ring (:func:`ring_reduce_scatter_traffic`);
    gloo has no reduce-scatter of its own and all-reduces the whole input, then keeps its chunk,
    so its bytes are an all-reduce's, twice the ring's (measured on the loopback: 12.07 MB for
    three 2 MB reduce-scatters at W=2, 12.02 MB for three all-reduces; results/multinode)."""
    if backend == "gloo":
        return ring_all_reduce_traffic(payload, world_size)
    return ring_reduce_scatter_traffic(payload, world_size)


def chain_broadcast_traffic(nbytes: int, world_size: int, rank: int, src: int) -> Traffic:
    """Pipelined chain broadcast src -> src+1 -> ...: every rank but the tail forwards the
    buffer once (one message), every rank but the source receives it once."""
    if world_size <= 1:
        return Traffic(0, 0, 0, 0)
    position = (rank - src) % world_size
    sends = 1 if position < world_size - 1 else 0
    receives = 1 if position > 0 else 0
    return Traffic(nbytes * sends, nbytes * receives, sends, receives)


def peer_exchange_traffic(payload: int, peers: int, tensors: int = 1) -> Traffic:
    """A point-to-point exchange with ``peers`` other ranks (NoLoCo's gossip): this rank sends
    its ``payload`` bytes (``tensors`` tensors, one message each) straight to each peer and
    receives as much from each. No rank forwards another's bytes, so nothing grows with the
    world size."""
    return Traffic(payload * peers, payload * peers, tensors * peers, tensors * peers)


def pairwise_exchange_traffic(payload: int, world_size: int) -> Traffic:
    """Per rank, averaged over the W ranks, of an exchange in which the ranks meet in pairs (an
    odd W: one group of three, whose members each exchange with two peers). Even W: one payload
    each way in one message, whatever W; odd W: (W + 3) / W of that (integer division), the three
    doubled senders' share falling as W grows."""
    if world_size <= 1:
        return Traffic(0, 0, 0, 0)
    sends = world_size + (3 if world_size % 2 else 0)  # messages over all ranks
    moved = payload * sends // world_size
    return Traffic(moved, moved, sends // world_size, sends // world_size)


# Byte-only views, for callers that need (tx, rx) alone (analytic byte tables).
def ring_all_reduce_bytes(payload: int, world_size: int) -> tuple[int, int]:
    """(tx, rx) of a ring all-reduce: 2(W-1)/W x payload each way."""
    return ring_all_reduce_traffic(payload, world_size)[:2]


def ring_all_gather_bytes(payload: int, world_size: int) -> tuple[int, int]:
    """(tx, rx) of a ring all-gather: (W-1) x payload each way."""
    return ring_all_gather_traffic(payload, world_size)[:2]


def reduce_scatter_bytes(payload: int, world_size: int, backend: str = "nccl") -> tuple[int, int]:
    """(tx, rx) of a reduce-scatter of a ``payload``-byte input as ``backend`` runs it."""
    return reduce_scatter_traffic(payload, world_size, backend)[:2]


TRAFFIC = {
    "all_reduce": ring_all_reduce_traffic,
    "all_gather": ring_all_gather_traffic,
    "reduce_scatter": ring_reduce_scatter_traffic,  # NCCL's; gloo's: reduce_scatter_traffic
    "exchange": pairwise_exchange_traffic,  # point-to-point with a peer (NoLoCo), averaged over ranks
}


class WireBytes(NamedTuple):
    """What a strategy's traffic costs one rank per step, averaged over ranks, from shapes (the
    comm table's figures): ``payload`` (what it contributes), ``tx`` / ``rx``, and ``direct``,
    the part of ``tx`` sent straight to its destination rank (an all-to-all) rather than hop by
    hop round a ring: the two cross between nodes in different shares
    (:func:`ring_inter_node_share`, :func:`direct_inter_node_share`)."""

    payload: float
    tx: float
    rx: float
    direct: float = 0.0

    def inter_node_tx(self, world_size: int, ranks_per_node: int) -> float:
        """The part of ``tx`` that crosses between nodes, ranks placed node by node."""
        ring = (self.tx - self.direct) * ring_inter_node_share(world_size, ranks_per_node)
        return ring + self.direct * direct_inter_node_share(world_size, ranks_per_node)


def direct_inter_node_share(world_size: int, ranks_per_node: int) -> float:
    """Share of an all-to-all's bytes that cross between nodes, every rank sending the same to
    each of the W-1 others: the W - g ranks on other nodes of the W-1 (0 on one node)."""
    if world_size <= 1 or ranks_per_node >= world_size:
        return 0.0
    return (world_size - ranks_per_node) / (world_size - 1)


def ring_inter_node_share(world_size: int, ranks_per_node: int) -> float:
    """Share of a world ring's hops that cross between nodes, ranks placed node by node (rank
    r on node r // ranks_per_node): one hop out of each node, so nodes / W (0 on one node).
    A world collective's per-rank tx times this share is what, on average, a rank puts on the
    inter-node link; the rest stays inside its node."""
    if world_size <= 1 or ranks_per_node >= world_size:
        return 0.0
    nodes = -(-world_size // ranks_per_node)
    return nodes / world_size


@dataclass
class _Totals:
    calls: int = 0
    payload: int = 0
    tx: int = 0
    rx: int = 0
    messages: int = 0

    def add(self, other: _Totals) -> None:
        self.calls += other.calls
        self.payload += other.payload
        self.tx += other.tx
        self.rx += other.rx
        self.messages += other.messages


@dataclass
class CommMeter:
    """Per-step and cumulative byte counts, per (purpose, scope, collective)."""

    _step: dict[tuple[str, str, str], _Totals] = field(default_factory=lambda: defaultdict(_Totals))
    _cumulative: dict[tuple[str, str, str], _Totals] = field(
        default_factory=lambda: defaultdict(_Totals)
    )
    steps_closed: int = 0
    # the largest data payload of one closed step (a burst such as DiLoCo's synchronisation)
    peak_step_payload: int = 0
    # seconds this rank went on computing while an asynchronous collective of its was in flight
    # (issued, not yet waited for), since the last take_in_flight_s; and the end of the latest
    # such interval, so that overlapping ones count once
    _in_flight_s: float = 0.0
    _in_flight_until: float = float("-inf")

    def record(
        self,
        collective: str,
        payload: int,
        tx: int,
        rx: int,
        *,
        messages: int = 0,
        scope: str = "world",
        purpose: str = "data",
    ) -> None:
        totals = self._step[(purpose, scope, collective)]
        totals.calls += 1
        totals.payload += int(payload)
        totals.tx += int(tx)
        totals.rx += int(rx)
        totals.messages += int(messages)

    def in_flight(self, issued: float, waited: float, returned: float) -> None:
        """An asynchronous collective issued at ``issued`` was waited for from ``waited`` to
        ``returned`` (``time.perf_counter`` seconds): from its start to the wait, this rank had
        traffic in flight while it went on with other work, time that traffic could hide behind.
        Time is counted once however many collectives were in flight, and never while this
        rank was blocked in an earlier wait (two all-gathers issued together and waited for in
        turn: the second adds only what passed after the first returned)."""
        start = max(issued, self._in_flight_until)
        if waited > start:
            self._in_flight_s += waited - start
        self._in_flight_until = max(self._in_flight_until, returned)

    def take_in_flight_s(self) -> float:
        """Seconds of :meth:`in_flight` time since the last call (the training loop logs them
        per window as ``perf/in_flight_s``; the wall-clock model reads them)."""
        seconds, self._in_flight_s = self._in_flight_s, 0.0
        return seconds

    # ----------------------------------------------------------------- reading
    def _sum(self, table, *, purpose: str, scope: str | None) -> _Totals:
        out = _Totals()
        for (p, s, _c), totals in table.items():
            if p == purpose and (scope is None or s == scope):
                out.add(totals)
        return out

    def step_bytes(self, kind: str = "payload", *, purpose: str = "data", scope: str | None = None) -> int:
        """Bytes of ``kind`` (payload/tx/rx), or the count of ``messages``, recorded since the
        last :meth:`end_step`."""
        return getattr(self._sum(self._step, purpose=purpose, scope=scope), kind)

    def cumulative_bytes(
        self, kind: str = "payload", *, purpose: str = "data", scope: str | None = None
    ) -> int:
        """Bytes of ``kind`` over the whole run, including the open step."""
        closed = getattr(self._sum(self._cumulative, purpose=purpose, scope=scope), kind)
        return closed + self.step_bytes(kind, purpose=purpose, scope=scope)

    def scopes(self) -> list[str]:
        keys = set(self._cumulative) | set(self._step)
        return sorted({scope for (_p, scope, _c) in keys})

    def end_step(self) -> dict[str, float]:
        """Close the current step; return its metrics under metrics.jsonl's flat keys.

        ``comm/{payload,tx,rx}_bytes`` are this step's data bytes, ``comm/messages`` the sends
        they took (a ring collective is W-1 or 2(W-1) of them), ``comm/cum_payload_MB`` the
        cumulative data payload in MB (1e6 bytes, the paper's unit), ``comm/cum_tx_MB`` and
        ``comm/cum_messages`` what the wall-clock model reads (lowcomm.report.wallclock). Per-scope and
        per-collective breakdowns, and control traffic, follow under longer keys.
        """
        metrics: dict[str, float] = {}
        for kind in FIELDS:
            metrics[_metric_key("", kind)] = self.step_bytes(kind)
        scopes = self.scopes()
        if scopes != ["world"]:
            for scope in scopes:
                for kind in FIELDS:
                    metrics[_metric_key(f"{scope}_", kind)] = self.step_bytes(kind, scope=scope)
        metrics["comm/control_bytes"] = self.step_bytes("tx", purpose="control")
        for kind in ("tx", "rx"):  # a replica group healed from a peer (lowcomm.comm.ft): its own kind
            if self.step_bytes(kind, purpose="heal"):
                metrics[f"comm/heal_{kind}_bytes"] = self.step_bytes(kind, purpose="heal")
        self.peak_step_payload = max(self.peak_step_payload, int(metrics["comm/payload_bytes"]))
        for (purpose, scope, collective), totals in self._step.items():
            self._cumulative[(purpose, scope, collective)].add(totals)
        self._step.clear()
        self.steps_closed += 1
        metrics["comm/cum_payload_MB"] = self.cumulative_bytes("payload") / 1e6
        metrics["comm/cum_tx_MB"] = self.cumulative_bytes("tx") / 1e6
        metrics["comm/cum_messages"] = self.cumulative_bytes("messages")
        for scope in scopes if scopes != ["world"] else []:
            metrics[f"comm/cum_{scope}_payload_MB"] = self.cumulative_bytes("payload", scope=scope) / 1e6
            metrics[f"comm/cum_{scope}_tx_MB"] = self.cumulative_bytes("tx", scope=scope) / 1e6
            metrics[f"comm/cum_{scope}_messages"] = self.cumulative_bytes("messages", scope=scope)
        return metrics

    def breakdown(self, *, cumulative: bool = True) -> dict[str, dict[str, int]]:
        """``{"purpose/scope/collective": {"calls", "payload", "tx", "rx", "messages"}}`` for reports."""
        table = dict(self._cumulative) if cumulative else dict(self._step)
        if cumulative:
            for key, totals in self._step.items():
                merged = _Totals()
                merged.add(table.get(key, _Totals()))
                merged.add(totals)
                table[key] = merged
        return {"/".join(key): vars(t).copy() for key, t in sorted(table.items())}

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Totals of the closed steps. Bytes of the open step (a checkpoint's own barriers, which
        a resumed run does not repeat) are left out, so a resumed run's data bytes match an
        uninterrupted one's exactly."""
        return {
            "steps_closed": self.steps_closed,
            "peak_step_payload": self.peak_step_payload,
            "cumulative": {"\x1f".join(k): vars(v).copy() for k, v in self._cumulative.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self._step.clear()
        self._cumulative.clear()
        self.steps_closed = int(state["steps_closed"])
        self.peak_step_payload = int(state.get("peak_step_payload", 0))  # absent in older checkpoints
        for key, totals in state["cumulative"].items():
            # checkpoints written before messages were counted have none
            self._cumulative[tuple(key.split("\x1f"))] = _Totals(**{"messages": 0, **totals})


def _metric_key(prefix: str, kind: str) -> str:
    """``comm/<prefix><kind>_bytes`` for byte counts, ``comm/<prefix>messages`` for messages."""
    return f"comm/{prefix}messages" if kind == "messages" else f"comm/{prefix}{kind}_bytes"
