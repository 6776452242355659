"""Loss against estimated wall-clock time over a given network link.

Bytes are what a run counts; time is what a researcher pays. This module turns a run's
metered traffic into time on a link, with one stated model:

    step time  = compute + max(0, comm - overlap x compute)
    comm       = (tx + messages x framing) / bandwidth + messages x latency

- ``compute`` is the run's measured time per step (``summary.json``'s tokens/s, which times
  ``train_step`` alone; its own traffic went over loopback or shared memory, which the model
  neglects). ``benchmarks/wan.py`` measures it on an unshaped link beside the shaped one. With
  unequal workers (``slowdown``: the slowest is that many times slower than the run measured) it
  is the slowest worker's, whom every exchange waits for.
- ``tx`` and ``messages`` are this rank's, as metered: the collective's algorithm is already in
  them (a ring all-reduce sends 2(W-1)/W x payload in 2(W-1) messages, a ring all-gather
  (W-1) x payload in W-1; comm/meter.py). The ring's hops are sequential, so each message pays
  the link's latency once: DeMo's per-bucket all-gathers make it latency-bound over a WAN long
  before it is bandwidth-bound, and its one-bucket exchange (``optimizer.bucket_numel``) cuts the
  messages, not the bytes. (The quantized all-reduce's all-to-all sends its W-1 messages at
  once, not hop by hop, so the model charges it W-2 latencies too many: an upper bound.)
- ``bandwidth`` is per rank and direction: a link of its own for every rank (a NIC per GPU), or
  one link per node shared by its ranks (``ranks_per_link``, e.g. a node's one uplink to a WAN).
  On a shared link a world collective's ring still leaves each node from one rank at a time
  (ranks placed node by node: one hop in W/nodes crosses, benchmarks/node_wire.py measures it),
  so it has the whole link; the ``inter`` scope of a hierarchical strategy (FlexDeMo's replicas
  across nodes) sends from every rank of the node at once, so each has 1/ranks_per_link of it.
  The ``intra`` scope (FlexDeMo's sharding group, inside a node) crosses the intra-node link.
- ``framing`` is what the wire adds to each message in bytes (TCP/IP headers and
  acknowledgements, the backend's own headers; 0 unless given): benchmarks/wan.py measures it
  from the kernel's byte counters.
- ``overlap`` is the strategy's own (``Strategy.comm_overlap``): DDP's all-reduce of every
  gradient bucket but the last runs during the backward pass (2/3 of a step; none for a model
  whose gradients fit one bucket), Streaming DiLoCo's fragments behind tau inner steps, eager
  DiLoCo's all-reduce behind the next H (its quantized all-reduce's all-to-all only: the
  strategy is told the run's compression group), the others not at all. Where the run
  measured more (``perf/in_flight_s``: the time each step went on computing while an
  asynchronous collective of its was in flight, e.g. DeMo's all-gather of one bucket while it
  encodes the next), the traffic hides behind that much instead:
  ``overlap x compute`` becomes ``max(overlap x compute, in flight)``.

The model is applied window by window between logged steps, from the cumulative counters
(``comm/cum_tx_MB``, ``comm/cum_messages``), so that a strategy that syncs every H steps pays
its sync inside the window where it happens.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from lowcomm.config import ConfigError, validate_optimizer
from lowcomm.models import ModelSpec, build_model, count_parameters
from lowcomm.report.runs import RunRecord
from lowcomm.units import parse_bandwidth

MODEL_TEXT = ("step time = compute + max(0, comm - overlap x compute); comm = tx / bandwidth + messages x latency "
              "(tx and messages per rank, as metered; compute measured by the run)")


@dataclass(frozen=True)
class Link:
    """A network link: ``bandwidth_bps`` bits per second per rank and direction, ``latency_s``
    seconds per message (one hop of a ring collective), ``framing_bytes`` the wire's own bytes
    per message (headers, acknowledgements)."""

    name: str
    bandwidth_bps: float
    latency_s: float
    framing_bytes: float = 0.0

    def __post_init__(self):
        if not self.bandwidth_bps > 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0, got {self.bandwidth_bps}")
        if not self.latency_s >= 0:
            raise ValueError(f"link {self.name!r}: latency must be >= 0, got {self.latency_s}")
        if not self.framing_bytes >= 0:
            raise ValueError(f"link {self.name!r}: framing must be >= 0 bytes, got {self.framing_bytes}")

    def seconds(self, tx_bytes: float, messages: float) -> float:
        """Time to send ``tx_bytes`` in ``messages`` messages, one after the other."""
        return 8 * (tx_bytes + messages * self.framing_bytes) / self.bandwidth_bps + messages * self.latency_s

    def shared(self, ranks: int) -> Link:
        """This link as each of ``ranks`` ranks sees it when they all send at once: 1/ranks of
        the bandwidth, the same latency and framing."""
        if ranks < 1:
            raise ValueError(f"link {self.name!r}: shared by {ranks} ranks; at least 1")
        return dataclasses.replace(self, bandwidth_bps=self.bandwidth_bps / ranks)

    def describe(self) -> str:
        return f"{self.name} ({_si(self.bandwidth_bps)}bit/s, {_duration(self.latency_s)} per message)"


# The default links, their latency one-way per message: a WAN between sites, a data-centre
# Ethernet, an InfiniBand fabric; inside a node, NVLink (H100: 450 GB/s per direction).
DEFAULT_LINKS = (
    Link("1 Gbit/s WAN", 1e9, 10e-3),
    Link("10 Gbit/s Ethernet", 10e9, 50e-6),
    Link("100 Gbit/s InfiniBand", 100e9, 5e-6),
)
INTRA_NODE = Link("NVLink", 3.6e12, 3e-6)

_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_link(text: str) -> Link:
    """``NAME:BANDWIDTH:LATENCY``, e.g. ``wan:1G:10ms``, ``lab:100Mbit:2ms``, ``ib:100G:5us``
    (bandwidth in bits per second with an SI prefix; latency with a unit: s, ms, us, ns)."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise ValueError(f"link {text!r}: expected NAME:BANDWIDTH:LATENCY, e.g. wan:1G:10ms")
    name, bandwidth, latency = parts
    time = re.fullmatch(r"([0-9.eE+-]+)\s*(s|ms|us|µs|ns)", latency.strip())
    if time is None:
        raise ValueError(f"link {text!r}: latency {latency!r} needs a unit: s, ms, us or ns (e.g. 10ms)")
    try:
        bits_per_s = parse_bandwidth(bandwidth)
    except ValueError as exc:
        raise ValueError(f"link {text!r}: {exc}") from None
    return Link(name, bits_per_s, float(time.group(1)) * _TIME[time.group(2)])


RECORDED = "recorded"  # lowcomm-wallclock --link recorded: each run on the links it recorded


def recorded_link(runs: list[RunRecord]) -> Link:
    """The link ``runs`` recorded (:func:`recorded_link_bps`, one rate for all of them): its
    rate, with no latency (a shaped veth's tbf adds none) and no framing (the wire's headers per
    message, which benchmarks/stragglers.py measures from the kernel's counters)."""
    rates: dict[float, list[str]] = {}
    for run in runs:
        rate = recorded_link_bps(run)
        if rate is None:
            raise ValueError(f"{run.path}: its summary records no shaped links (cluster.link_rate / slow_link_nodes); "
                             "give --link NAME:BANDWIDTH:LATENCY instead")
        rates.setdefault(rate, []).append(str(run.path))
    if len(rates) != 1:
        found = "; ".join(f"{rate / 1e6:g} Mbit/s: {', '.join(paths)}" for rate, paths in sorted(rates.items()))
        raise ValueError(f"the runs recorded different links ({found}): select the runs of one, or give --link")
    (rate,) = rates
    return Link(f"recorded {rate / 1e6:g} Mbit/s (the slowest node's)", rate, 0.0)


def recorded_link_bps(run: RunRecord) -> float | None:
    """The rate a run's ring collectives went at where its nodes' links were shaped
    (``cluster.link_rate``, ``slow_link_nodes``: ``node_link_bps`` in its summary): its slowest
    node's, since a ring goes at its slowest hop; None where its links were not shaped."""
    rates = [rate for rate in (run.summary or {}).get("node_link_bps") or [] if rate is not None]
    return min(rates) if rates else None


def step_seconds(compute_s: float, comm_s: float, overlap: float, in_flight_s: float = 0.0) -> float:
    """One step (or window): compute, plus the traffic that the compute could not hide: the
    strategy's ``overlap`` share of it, or the ``in_flight_s`` the run measured, the larger, and
    never behind more than the compute itself: a collective in flight while its rank waited for
    another (a control flag queued behind it on the same link) hid nothing in that time."""
    return compute_s + max(0.0, comm_s - min(compute_s, max(overlap * compute_s, in_flight_s)))


@dataclass
class Timeline:
    """One run on one link: the estimated time at each logged step and at each validation."""

    run: RunRecord
    link: Link
    compute_s_per_step: float
    overlap: float
    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    comm_s: float = 0.0  # the whole run's traffic time on the link, before overlap

    def val_points(self) -> list[tuple[int, float, float]]:
        """``(step, seconds, val loss)`` at every validation."""
        at = dict(zip(self.steps, self.seconds, strict=True))
        steps, values = self.run.series("val/loss")
        return [(s, at[s], v) for s, v in zip(steps, values, strict=True) if s in at]

    @property
    def total_s(self) -> float:
        return self.seconds[-1] if self.seconds else 0.0

    @property
    def comm_s_per_step(self) -> float:
        return self.comm_s / self.steps[-1] if self.steps else 0.0

    def time_to_excess(self, target: float) -> float | None:
        """Seconds until the first validation whose loss is within ``target`` of the Bayes floor
        (of the loss itself when the data has none); None if no validation gets there."""
        floor = self.run.bayes_floor or 0.0
        for _step, seconds, loss in self.val_points():
            if loss - floor <= target:
                return seconds
        return None


def comm_overlap(run: RunRecord) -> float:
    """The run's strategy's :meth:`~lowcomm.strategies.base.Strategy.comm_overlap` for its model."""
    try:
        strategy, cfg = validate_optimizer(run.config)
    except ConfigError as exc:
        raise ValueError(f"{run.path}: its optimizer config does not validate: {exc}") from exc
    parameters = (run.summary or {}).get("parameters") or count_parameters(
        build_model(ModelSpec(**run.config["model"]), "meta"))
    return strategy.comm_overlap(cfg, int(parameters), run.config.get("compression"))


def waits_for_slowest(run: RunRecord) -> bool:
    """The run's strategy's :meth:`~lowcomm.strategies.base.Strategy.waits_for_slowest`."""
    strategy, cfg = validate_optimizer(run.config)
    return strategy.waits_for_slowest(cfg)


def compute_seconds_per_step(run: RunRecord) -> float:
    """The run's measured time per step: tokens per step over ``summary.json``'s tokens/s (which
    times ``train_step`` alone), else the mean of its logged ``perf/step_s`` windows."""
    train = run.config["train"]
    if run.summary and run.summary.get("tokens_per_s"):
        return train["global_batch_size"] * train["seq_len"] / run.summary["tokens_per_s"]
    _steps, windows = run.series("perf/step_s")
    if not windows:
        raise ValueError(f"{run.path}: no measured step time (no summary.json tokens_per_s, no perf/step_s)")
    return sum(windows) / len(windows)


# The cumulative counters the model reads (comm/meter.py writes the scoped ones only for a
# strategy with scopes other than the world: FlexDeMo's intra and inter).
CUMULATIVE = {"tx": "comm/cum_tx_MB", "messages": "comm/cum_messages",
               "intra_tx": "comm/cum_intra_tx_MB", "intra_messages": "comm/cum_intra_messages",
               "inter_tx": "comm/cum_inter_tx_MB", "inter_messages": "comm/cum_inter_messages"}


def timeline(run: RunRecord, link: Link, *, intra: Link = INTRA_NODE, ranks_per_link: int = 1,
             compute_s: float | None = None, overlap: float | None = None, slowdown: float = 1.0) -> Timeline:
    """``run``'s logged steps placed in time on ``link`` (see the module's model); ``ranks_per_link``
    ranks of a node share it (1: a link per rank). ``slowdown``: the run's steps as they would go
    with its slowest worker that many times slower than the run measured (``cluster.slowdown``):
    every method here waits for the slowest worker at its exchanges (a synchronous one at every
    step; the DiLoCo family once per H steps, for the H steps of lateness it gathered: the same
    per step), so each step's compute is the slowest worker's."""
    if not slowdown >= 1:
        raise ValueError(f"a slowdown is a factor >= 1, got {slowdown}")
    if not waits_for_slowest(run):  # a learner on its own clock: the slow one slows only itself
        slowdown = 1.0
    compute = (compute_seconds_per_step(run) if compute_s is None else compute_s) * slowdown
    out = Timeline(run, link, compute, comm_overlap(run) if overlap is None else overlap)
    records = [r for r in run.metrics if "comm/cum_tx_MB" in r]
    if records and "comm/cum_messages" not in records[-1]:
        raise ValueError(f"{run.path}: metrics.jsonl has no comm/cum_messages (written by lowcomm before the "
                         "wall-clock model); rerun it to place it in time")
    replicas = link.shared(ranks_per_link)  # the inter scope: every rank of the node sends at once
    last_step, last = 0, dict.fromkeys(CUMULATIVE, 0.0)
    elapsed = 0.0
    for record in sorted(records, key=lambda r: r["step"]):
        now = {key: record.get(metric, 0.0) * (1e6 if metric.endswith("_MB") else 1)
               for key, metric in CUMULATIVE.items()}
        delta = {key: now[key] - last[key] for key in now}
        comm = (link.seconds(delta["tx"] - delta["intra_tx"] - delta["inter_tx"],
                             delta["messages"] - delta["intra_messages"] - delta["inter_messages"])
                + replicas.seconds(delta["inter_tx"], delta["inter_messages"])
                + intra.seconds(delta["intra_tx"], delta["intra_messages"]))
        steps = record["step"] - last_step
        elapsed += step_seconds(steps * compute, comm, out.overlap, steps * record.get("perf/in_flight_s", 0.0))
        out.comm_s += comm
        out.steps.append(record["step"])
        out.seconds.append(elapsed)
        last_step, last = record["step"], now
    return out


def default_target(timelines: list[Timeline]) -> float:
    """An excess loss that every run reaches: the largest of the runs' best excess losses."""
    best = []
    for item in timelines:
        floor = item.run.bayes_floor or 0.0
        losses = [loss - floor for _s, _t, loss in item.val_points()]
        if losses:
            best.append(min(losses))
    if not best:
        raise ValueError("no run has a validation loss")
    return max(best)


def wallclock_table(per_link: list[list[Timeline]], labels: list[str], target: float,
                    ranks_per_link: int = 1) -> tuple[str, list[dict]]:
    """Markdown (one section per link) and rows from the runs' timelines on each link (each
    list in the order of ``labels``): per run, compute and traffic time per step, the time to
    reach ``target`` excess loss, and the whole run's time."""
    rows: list[dict] = []
    shared = ("a link per rank" if ranks_per_link == 1 else
              f"one link per node, shared by its {ranks_per_link} ranks")
    lines = [f"Model: {MODEL_TEXT}; {shared}.",
             f"Target: excess validation loss over the Bayes floor <= {target:.4f}.", ""]
    for timelines in per_link:
        link = timelines[0].link
        lines += [f"### {link.describe()}", "",
                  "| run | W | compute s/step | traffic s/step | overlap | time to target | whole run |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        timed = list(zip(labels, timelines, strict=True))
        order = sorted(timed, key=lambda item: (item[1].time_to_excess(target) is None,
                                                item[1].time_to_excess(target) or math.inf))
        for label, item in order:
            reach = item.time_to_excess(target)
            rows.append({"link": link.name, "run": label, "world_size": item.run.world_size,
                         "compute_s_per_step": item.compute_s_per_step, "comm_s_per_step": item.comm_s_per_step,
                         "overlap": item.overlap, "time_to_target_s": reach, "total_s": item.total_s})
            lines.append(f"| {label} | {item.run.world_size} | {item.compute_s_per_step:.4g} | "
                         f"{item.comm_s_per_step:.4g} | {item.overlap:.2f} | "
                         f"{'not reached' if reach is None else _duration(reach)} | {_duration(item.total_s)} |")
        lines.append("")
    return "\n".join(lines), rows


def _si(value: float) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:g} {prefix}"
    return f"{value:g} "


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
