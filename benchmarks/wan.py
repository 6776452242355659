"""Step time over a real rate-limited link, measured, beside the wall-clock model's prediction.

W gloo workers (4, or 2 on fewer than 4 cores) train the tiny model (the quickstart's settings) inside a private network
namespace whose loopback, the only link between them, is rate-limited with tc's token bucket
filter (benchmarks/netns.py). Each optimizer trains the same steps on the unshaped loopback,
then on each shaped link. For each shaped run the script prints its measured time per step
beside the prediction of ``lowcomm.report.wallclock`` (the model ``lowcomm-wallclock`` uses):
the unshaped run's measured step time as compute, plus the shaped run's metered tx and
messages per rank on the link, with the strategy's own overlap. The link as the model sees it:

- bandwidth per rank = the shaped rate / W: one loopback carries every rank's sends, and in a
  ring collective all W ranks send at once;
- per message: the wire's framing at that bandwidth (TCP/IP headers, acknowledgements, gloo's
  headers, and the harness's own control traffic), measured from the shaped run's loopback
  counter: (bytes the kernel carried - metered tx, over all ranks) / messages. This kernel has
  no netem, so no delay is added: what latency the loopback has is in the unshaped step time.

A shaped loopback has 1,500-byte packets and a bucket of two of them (benchmarks/netns.py), so
that no burst passes faster than the rate. The default gives every worker a core of its own
(2 on a 2-core machine), as on a cluster where each rank has its own GPU: with more workers
than cores, a rank that waits for the link gives its core to another, and the traffic hides
behind the others' compute (4 workers on 2 cores: DeMo's predicted 41 ms of traffic per step
at 50 Mbit/s did not show in its measured step time at all).

With ``--nodes N`` the workers are split between N nodes (benchmarks/netns.py ``node_network``:
a namespace per node, a veth from each to a bridge): each node's veth, its link to the other
nodes, is shaped, and its loopback, the link inside it, is not; the ranks start as torchrun or a
SLURM job starts them (RANK, LOCAL_RANK, the first node's hostname as MASTER_ADDR). The model
then sees the veth as the inter-node link of ``lowcomm-wallclock --ranks-per-link <ranks per
node>``: a world collective's ring leaves each node from one rank at a time, which has the whole
rate; FlexDeMo's replicas across nodes send from every rank of a node at once, 1/ranks each.
Framing per message is measured on the veths: (bytes every veth carried - what the comm table
says crosses) / the messages that cross. The intra-node link's time is in the unshaped run's
step time. This is the FlexDeMo paper's setting (a fast link inside a node, a slow one between).

The target is a prediction within 25 % of the measurement. Then, from the runs on the slowest
link, it draws validation loss against measured wall-clock time (each logged window's measured
step time, the validations and checkpoints left out) and writes, in ``--out``:
``summary.md`` (the table), ``wan.json``, ``loss_vs_time_<link>.png`` and
``step_time_measured_vs_predicted.png``.

    sudo .venv/bin/python benchmarks/wan.py                    # 100 and 10 Mbit/s, 100 steps: ~4 min
    sudo .venv/bin/python benchmarks/wan.py --links 100M 10M --steps 60 --out results/wan
    sudo .venv/bin/python benchmarks/wan.py --nodes 2 --out results/multinode/wan   # 2 nodes x 2 ranks
    sudo .venv/bin/python benchmarks/wan.py --overlapped --links 10M 2M --out results/wan/overlapped

``--overlapped`` runs the methods that hide their exchange behind compute beside their blocking
selves at the same bytes: DisTrO (its all-gather waited for one step later) beside DeMo on the
same 1-bit wire, eager DiLoCo (its all-reduce waited for H steps later) beside DiLoCo. The model
hides their traffic behind their ``comm_overlap`` share of the compute, or the time the run
measured in flight, the larger.

Needs root and iproute2 (``ip netns``, ``tc``); the namespaces are deleted on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
from netns import (
    NODE_INTERFACE,
    limit_rate,
    loopback_tx_bytes,
    network_namespace,
    node_network,
    start_synchronizer_on,
)

from lowcomm.comm.meter import ring_inter_node_share
from lowcomm.config import validate
from lowcomm.config.cluster import LINKS_SHAPED_ENV, node_link_rates
from lowcomm.config.compose import compose
from lowcomm.launch.local import prepare_run_dir
from lowcomm.report.figures import FAMILY_MARKERS, run_colors
from lowcomm.report.runs import load_run
from lowcomm.report.wallclock import CUMULATIVE, Link, compute_seconds_per_step, parse_bandwidth, timeline
from lowcomm.strategies import STRATEGIES
from lowcomm.train.synchronizer import uses_synchronizer

WORLD = 4 if (os.cpu_count() or 1) >= 4 else 2  # a core per worker; the quickstart's batch takes 1, 2 or 4
TARGET = 0.25
SHAPED_BY = "benchmarks/wan.py's Nodes (tc on each network-namespace node's veth)"
OPTIMIZERS = {
    "AdamW-DDP": ["optimizer=adamw_ddp", "optimizer.lr=6e-3"],
    "DeMo k=32": ["optimizer=demo", "optimizer.lr=6e-3"],
    "DeMo k=32 one bucket": ["optimizer=demo", "optimizer.lr=6e-3", "optimizer.bucket_numel=10000000000"],
    "DiLoCo H=10": ["optimizer=diloco", "optimizer.lr=6e-3", "optimizer.sync_every=10"],
    "FlexDeMo k=32": ["optimizer=flexdemo", "optimizer.lr=6e-3"],  # shard group: the ranks of a node
    # the overlapped methods beside their blocking selves, at the same bytes (--overlapped)
    "DeMo k=32 1-bit": ["optimizer=demo", "optimizer.lr=6e-3", "optimizer.wire=signbit"],
    "DisTrO k=32 1-bit": ["optimizer=distro", "optimizer.lr=6e-3", "optimizer.compression_topk=32"],
    # its quickstart point: DiLoCo's inner lr and H, a gentler outer step (three quarters of the mean arrive late)
    "Eager DiLoCo H=10": ["optimizer=eager_diloco", *STRATEGIES["eager_diloco"].quickstart[0].overrides],
}
ONE_NODE_OPTIMIZERS = ["AdamW-DDP", "DeMo k=32", "DeMo k=32 one bucket", "DiLoCo H=10"]
OVERLAPPED_OPTIMIZERS = ["DeMo k=32 1-bit", "DisTrO k=32 1-bit", "DiLoCo H=10", "Eager DiLoCo H=10"]
NODES_OPTIMIZERS = ["AdamW-DDP", "DeMo k=32", "FlexDeMo k=32"]  # the FlexDeMo paper's comparison
PORT = 29781
# The unshaped link inside a node: its time is already in the unshaped run's measured step time,
# the compute the model starts from, so the model charges it nothing more.
IN_THE_COMPUTE = Link("loopback (in the measured step time)", float("inf"), 0.0)


def _rate_name(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e6:g}Mbit" if bits_per_s < 1e9 else f"{bits_per_s / 1e9:g}Gbit"


def _overrides(label: str, steps: int, run_root: Path, workers: int) -> list[str]:
    return ["experiment=quickstart", "wandb.mode=disabled", f"cluster.workers={workers}", f"train.max_steps={steps}",
            f"train.warmup_steps={max(1, steps // 10)}", "train.checkpoint_every=0",
            f"train.log_every={max(1, steps // 10)}", f"train.eval_every={max(1, steps // 5)}",
            f"run_root={run_root}", f"label='{label}'", *OPTIMIZERS[label]]


class OneNode:
    """Every worker on one node: a namespace whose loopback, the only link, is shaped. All W
    ranks send on it at once (a ring collective's hops run together), so each has 1/W of it."""

    def __init__(self, workers: int):
        self.workers, self.ranks_per_node = workers, workers
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        self.namespace = self._stack.enter_context(network_namespace("lowcomm-wan"))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def describe(self) -> str:
        return f"{self.workers} gloo workers on one node, its loopback shaped"

    def namespaces(self) -> list[str]:
        """The network namespaces the runs ran in (deleted on exit)."""
        return [self.namespace]

    def limit(self, bits_per_s: float | None) -> str:
        return limit_rate(self.namespace, bits_per_s)

    def link_overrides(self, bits_per_s: float | None) -> list[str]:  # noqa: ARG002
        """None: one node has no link to another; its loopback is shaped by :meth:`limit`."""
        return []

    def carried(self) -> int:
        """Bytes on the shaped link so far."""
        return loopback_tx_bytes(self.namespace)

    def train(self, overrides: list[str]) -> None:
        """One lowcomm-train run inside the namespace (its local launcher starts the W workers there)."""
        command = ["ip", "netns", "exec", self.namespace, sys.executable, "-m", "lowcomm.cli.train", *overrides]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"training failed ({' '.join(overrides)}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")

    def link(self, name: str, bits_per_s: float, run, carried: int) -> tuple[Link, int]:
        """The shaped link as the model sees it, its framing per message measured: (bytes the
        kernel carried - metered tx of all ranks) / their messages; and the ranks sharing it."""
        metered, messages = _cumulative(run, "tx") * self.workers, _cumulative(run, "messages") * self.workers
        framing = max(0.0, carried - metered) / max(messages, 1)
        return Link(name, bits_per_s / self.workers, 0.0, framing_bytes=framing), 1


class Nodes:
    """``nodes`` nodes of ``ranks_per_node`` workers (benchmarks/netns.py ``node_network``): each
    node's veth, its link to the others, is shaped; its loopback (the intra-node link) is not.
    A world collective's ring leaves a node from one rank at a time, so that rank has the whole
    veth; FlexDeMo's replicas across nodes send from every rank of a node at once."""

    def __init__(self, nodes: int, ranks_per_node: int, *, synchronizer_node: bool = False):
        self.nodes, self.ranks_per_node, self.workers = nodes, ranks_per_node, nodes * ranks_per_node
        # one more node, the synchronizer's, for the methods of learners (lowcomm.train.synchronizer)
        self.synchronizer_node = synchronizer_node
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        self.network = self._stack.enter_context(node_network(self.nodes + self.synchronizer_node, prefix="lcwan"))
        # the runs' cluster.link_rate / slow_link_nodes are realised here (train): this process
        # and its workers say so while the nodes exist, and their configs validate
        before = os.environ.get(LINKS_SHAPED_ENV)
        os.environ[LINKS_SHAPED_ENV] = SHAPED_BY
        self._stack.callback(lambda: os.environ.pop(LINKS_SHAPED_ENV) if before is None
                             else os.environ.__setitem__(LINKS_SHAPED_ENV, before))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def describe(self) -> str:
        return (f"{self.nodes} nodes x {self.ranks_per_node} gloo workers, each node's veth shaped, "
                "its loopback not")

    def namespaces(self) -> list[str]:
        """The nodes' network namespaces (deleted on exit, with their switch's)."""
        return [node.namespace for node in self.network]

    def limit(self, bits_per_s: float | None) -> str:
        """Every node's veth at ``bits_per_s`` (None: unshaped); the kernel's account of them."""
        return self._shape([bits_per_s] * self.nodes)

    def _shape(self, rates: list[float | None]) -> str:
        if self.synchronizer_node:  # a node like the others: the rate most nodes have
            rates = [*rates, max((rate for rate in rates if rate is not None), default=None)]
        return "; ".join(f"{node.hostname}: {node.limit_rate(rate) or 'no qdisc'}"
                         for node, rate in zip(self.network, rates, strict=True))

    def link_overrides(self, bits_per_s: float | None) -> list[str]:
        """A run's settings for every node's link at ``bits_per_s`` (what :meth:`train` shapes)."""
        return [] if bits_per_s is None else [f"cluster.link_rate={bits_per_s:g}"]

    def carried(self) -> int:
        """Bytes on the shaped links (every node's veth) so far."""
        return sum(node.counters()["inter"] for node in self.network)

    def train(self, overrides: list[str]) -> str | None:
        """lowcomm's worker on every node, ``ranks_per_node`` ranks each, the first node's hostname
        as the rendezvous (what torchrun or a SLURM job exports). The nodes share this machine's
        cores: each worker computes on its share of them (torch's default, every core of its node
        for each of its ranks, would put nodes x cores threads on the cores, and an oversubscribed
        thread pool spins: it made the local-update methods' steps 2.5-7x AdamW-DDP's).

        Each node's veth is shaped first as the run's config says (``cluster.link_rate``,
        ``slow_link_nodes``, ``slow_link_rate``; none of them: unshaped), and the kernel's account
        of the qdiscs is returned."""
        threads = max(1, (os.cpu_count() or 1) // self.workers)
        run = validate(compose([*overrides, f"cluster.threads_per_worker={threads}"]))
        shaped = self._shape(node_link_rates(run.cluster, self.nodes))
        config_path = prepare_run_dir(run)
        procs, synchronizer = [], None
        if uses_synchronizer(run):  # learners: their synchronizer first, on its own node
            if not self.synchronizer_node:
                raise ValueError(f"optimizer={run.optimizer_name} needs a synchronizer node: Nodes(..., "
                                 "synchronizer_node=True)")
            synchronizer = start_synchronizer_on(self.network[-1], config_path, run.run_dir,
                                                 {**os.environ, "OMP_NUM_THREADS": "1"})
        for index, node in enumerate(self.network[:self.nodes]):
            for local in range(self.ranks_per_node):
                env = {**os.environ, "RANK": str(index * self.ranks_per_node + local), "WORLD_SIZE": str(self.workers),
                       "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
                       "MASTER_ADDR": self.network[0].hostname, "MASTER_PORT": str(PORT),
                       "GLOO_SOCKET_IFNAME": NODE_INTERFACE, "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(node.command([sys.executable, "-m", "lowcomm.train.worker",
                                                            str(config_path)]),
                                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        procs += [synchronizer] if synchronizer is not None else []  # (it ends after its learners)
        outputs = [proc.communicate(timeout=3600)[0] for proc in procs]
        failed = [out[-3000:] for proc, out in zip(procs, outputs, strict=True) if proc.returncode != 0]
        if failed:
            raise RuntimeError(f"training failed ({' '.join(overrides)}):\n{failed[0]}")
        return shaped

    def link(self, name: str, bits_per_s: float, run, carried: int) -> tuple[Link, int]:
        """The shaped veth as the model sees it, its framing per message measured: (bytes every
        veth carried - what the comm table says crosses) / the messages that cross (a world
        collective's nodes/W, FlexDeMo's inter scope); and the ranks that share it."""
        if run.summary and "learner" in run.summary:
            # learners: each one's sends cross its veth, and what the synchronizer sends it the
            # synchronizer's (about a frame back for each frame out)
            crossing = self.workers * (run.summary["sent_bytes"] + run.summary["received_bytes"])
            crossing_messages = 2 * self.workers * _cumulative(run, "messages")
            framing = max(0.0, carried - crossing) / max(crossing_messages, 1)
            return Link(name, bits_per_s, 0.0, framing_bytes=framing), self.ranks_per_node
        share = ring_inter_node_share(self.workers, self.ranks_per_node)
        inter, inter_messages = _cumulative(run, "inter_tx"), _cumulative(run, "inter_messages")
        world = _cumulative(run, "tx") - _cumulative(run, "intra_tx") - inter
        world_messages = (_cumulative(run, "messages") - _cumulative(run, "intra_messages") - inter_messages)
        crossing = self.workers * (world * share + inter)
        crossing_messages = self.workers * (world_messages * share + inter_messages)
        framing = max(0.0, carried - crossing) / max(crossing_messages, 1)
        return Link(name, bits_per_s, 0.0, framing_bytes=framing), self.ranks_per_node


def _cumulative(run, key: str) -> float:
    """One rank's whole-run count of the wall-clock model's ``key`` (bytes or messages)."""
    metric = CUMULATIVE[key]
    value = [r for r in run.metrics if "comm/cum_tx_MB" in r][-1].get(metric, 0.0)
    return value * 1e6 if metric.endswith("_MB") else value


def measured_times(run) -> tuple[list[int], list[float]]:
    """Wall-clock seconds at each logged step: the measured windows (``perf/step_s``) summed."""
    steps, windows = run.series("perf/step_s")
    times, elapsed, last = [], 0.0, 0
    for step, step_s in zip(steps, windows, strict=True):
        elapsed += (step - last) * step_s
        times.append(elapsed)
        last = step
    return steps, times


def plot(results: dict, runs: dict, rate_name: str, out: Path) -> Path:
    records = [runs[rate_name][label] for label in results["optimizers"]]
    colors = run_colors(records)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, run in zip(results["optimizers"], records, strict=True):
        steps, times = measured_times(run)
        at = dict(zip(steps, times, strict=True))
        val_steps, losses = run.series("val/loss")
        points = [(at[s], v) for s, v in zip(val_steps, losses, strict=True) if s in at]
        ax.plot([t for t, _ in points], [v for _, v in points], label=label, lw=1.4, ms=5,
                marker=FAMILY_MARKERS.get(run.optimizer, "."), color=colors[id(run)])
    floor = records[0].bayes_floor
    ax.set_xlabel("measured wall-clock time of the training steps (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{results['world_size']} gloo workers over a {rate_name}/s link (tc tbf), tiny OLMo"
                 + (f"\nBayes floor {floor:.3f} (below the axes)" if floor else ""), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out / f"loss_vs_time_{rate_name}.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", nargs="+", default=["100M", "10M"], metavar="RATE",
                        help="rates of the shaped link in bit/s (default: 100M 10M); the last draws the figure")
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes (default 1: one namespace, its loopback shaped); more: a namespace per node, "
                             "each node's veth shaped, the workers split evenly between them")
    parser.add_argument("--workers", type=int, help=f"gloo workers in all (default {WORLD}; with --nodes: 2 per node)")
    parser.add_argument("--steps", type=int, default=100, help="training steps of every run (default 100)")
    parser.add_argument("--overlapped", action="store_true",
                        help=f"the overlapped methods beside their blocking versions at the same bytes: "
                             f"{', '.join(OVERLAPPED_OPTIMIZERS)}")
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS),
                        help=f"(default: {', '.join(ONE_NODE_OPTIMIZERS)}; with --nodes: {', '.join(NODES_OPTIMIZERS)})")
    parser.add_argument("--out", type=Path, default=Path("results/wan"), help="tables, JSON and figure")
    parser.add_argument("--work", type=Path, default=Path("runs/wan"), help="run directories (default: runs/wan)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (ip netns add, tc)")
    if args.nodes > 1:
        workers = args.workers or 2 * args.nodes
        if workers % args.nodes:
            parser.error(f"--workers {workers} does not split evenly between {args.nodes} nodes")
        topology, optimizers = Nodes(args.nodes, workers // args.nodes), args.optimizers or NODES_OPTIMIZERS
    else:
        topology, optimizers = OneNode(args.workers or WORLD), args.optimizers or ONE_NODE_OPTIMIZERS
    if args.overlapped:
        if args.optimizers:
            parser.error("--overlapped names its optimizers; give --optimizers or --overlapped, not both")
        optimizers = OVERLAPPED_OPTIMIZERS
    rates = [parse_bandwidth(text) for text in args.links]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"world_size": topology.workers, "nodes": args.nodes, "ranks_per_node": topology.ranks_per_node,
                     "topology": topology.describe(), "steps": args.steps, "optimizers": optimizers, "links": {}}
    runs: dict[str, dict] = {}
    started = time.perf_counter()
    with topology:
        results["namespaces"] = topology.namespaces()
        for rate in [None, *rates]:
            name = "unshaped" if rate is None else _rate_name(rate)
            shown = topology.limit(rate)
            print(f"[wan] link {name}: {shown or 'no qdisc'}", flush=True)
            results["links"][name] = {"tc": shown, "bits_per_s": rate, "runs": {}}
            runs[name] = {}
            for label in optimizers:
                print(f"[wan]   {label} ({time.perf_counter() - started:.0f} s)", flush=True)
                overrides = [*_overrides(label, args.steps, args.work / name, topology.workers),
                             *topology.link_overrides(rate)]
                before = topology.carried()
                topology.train(overrides)
                carried = topology.carried() - before
                run = load_run(validate(compose(overrides)).run_dir)
                runs[name][label] = run
                _steps, in_flight = run.series("perf/in_flight_s")
                entry = {"measured_step_s": compute_seconds_per_step(run), "final_val_loss": run.final_val_loss,
                         "in_flight_s_per_step": sum(in_flight) / len(in_flight) if in_flight else 0.0,
                         "kernel_MB_per_step": carried / 1e6 / args.steps,
                         "metered_tx_MB_per_step": topology.workers * run.summary["tx_MB_per_step"]}
                if rate is not None:
                    link, ranks_per_link = topology.link(name, rate, run, carried)
                    entry["framing_bytes_per_message"] = link.framing_bytes
                    compute = results["links"]["unshaped"]["runs"][label]["measured_step_s"]
                    predicted = timeline(run, link, intra=IN_THE_COMPUTE, ranks_per_link=ranks_per_link,
                                         compute_s=compute)
                    entry["predicted_step_s"] = predicted.total_s / predicted.steps[-1]
                    entry["comm_s_per_step"] = predicted.comm_s_per_step
                    entry["overlap"] = predicted.overlap
                    entry["error"] = entry["predicted_step_s"] / entry["measured_step_s"] - 1
                results["links"][name]["runs"][label] = entry
            topology.limit(None)
    table = format_table(results)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "wan.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    figures = [plot(results, runs, _rate_name(rates[-1]), args.out), plot_step_times(results, args.out)]
    print(f"table:  {args.out / 'summary.md'}\njson:   {args.out / 'wan.json'}")
    for figure in figures:
        print(f"figure: {figure}")
    return 0


def plot_step_times(results: dict, out: Path) -> Path:
    """Measured time per step beside the model's prediction, per shaped link and optimizer."""
    shaped = [name for name, link in results["links"].items() if link["bits_per_s"] is not None]
    labels = results["optimizers"]
    fig, axes = plt.subplots(1, len(shaped), figsize=(3.2 * len(shaped) + 1.5, 4.2), squeeze=False,
                             layout="constrained")
    for ax, name in zip(axes[0], shaped, strict=True):
        entries = [results["links"][name]["runs"][label] for label in labels]
        at = range(len(labels))
        ax.bar([x - 0.2 for x in at], [e["measured_step_s"] for e in entries], 0.4, label="measured")
        ax.bar([x + 0.2 for x in at], [e["predicted_step_s"] for e in entries], 0.4, label="predicted")
        for x, entry in zip(at, entries, strict=True):
            top = max(entry["measured_step_s"], entry["predicted_step_s"])
            ax.annotate(f"{entry['error']:+.0%}", (x, top), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(at), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{name}/s", fontsize=9)
        ax.set_ylabel("s per training step")
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=2, fontsize=8)
    fig.suptitle(f"{results['topology']}:\nmeasured vs lowcomm-wallclock's model (tiny OLMo)", fontsize=9)
    path = out / "step_time_measured_vs_predicted.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def format_table(results: dict) -> str:
    if results.get("nodes", 1) > 1:
        model = (f"on each node's veth: a world collective's crossing rank has the whole rate, FlexDeMo's "
                 f"replicas across nodes 1/{results['ranks_per_node']} of it each, the measured framing per message; "
                 f"the loopbacks' time is in the unshaped step time; kernel MB: every veth")
    else:
        model = (f"on the loopback: bandwidth / {results['world_size']} per rank, the measured framing per message; "
                 "kernel MB: the loopback")
    lines = [f"Time per training step, {results.get('topology', str(results['world_size']) + ' gloo workers')}, "
             f"tiny OLMo, {results['steps']} steps per run; predicted = unshaped step time + the run's metered "
             f"traffic {model}; target within {TARGET:.0%}.", "",
             "| link | optimizer | measured s/step | predicted s/step | error | traffic s/step | kernel MB/step "
             "| metered tx MB/step | framing B/message | final val loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, link in results["links"].items():
        for label, entry in link["runs"].items():
            if "predicted_step_s" in entry:
                flag = "" if abs(entry["error"]) <= TARGET else " (off target)"
                lines.append(f"| {name} | {label} | {entry['measured_step_s']:.4f} | {entry['predicted_step_s']:.4f} | "
                             f"{entry['error']:+.1%}{flag} | {entry['comm_s_per_step']:.4f} | "
                             f"{entry['kernel_MB_per_step']:.4f} | {entry['metered_tx_MB_per_step']:.4f} | "
                             f"{entry['framing_bytes_per_message']:.0f} | {entry['final_val_loss']:.4f} |")
            else:
                lines.append(f"| {name} | {label} | {entry['measured_step_s']:.4f} | (compute) | | | "
                             f"{entry['kernel_MB_per_step']:.4f} | {entry['metered_tx_MB_per_step']:.4f} | | "
                             f"{entry['final_val_loss']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
