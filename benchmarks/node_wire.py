"""The meter's inter- and intra-node bytes against each node's own kernel counters: N nodes on
one machine (benchmarks/netns.py ``node_network``), R gloo ranks per node.

Each node is a network namespace: its loopback carries what its ranks send each other (the
intra-node link), its veth what they send to other nodes (the inter-node link), each with its
own byte counter. Every rank trains a few steps of AdamW-DDP, DeMo and FlexDeMo (FSDP inside a
node, DeMo across nodes) on the tiny model; around each window the first rank of every node
reads its node's two counters, and every rank its meter. The report sets, per node and
optimizer, the kernel's intra and inter bytes beside the meter's:

- a world collective (AdamW-DDP's all-reduce, DeMo's all-gathers) is metered as one ``world``
  figure; lowcomm's comm table takes nodes / W of it to cross nodes (a ring in rank order
  leaves each node once);
- FlexDeMo's traffic is metered per link (``intra``: the shard group inside a node, ``inter``:
  the replicas across nodes).

    sudo .venv/bin/python benchmarks/node_wire.py                       # 2 nodes x 2 ranks, 5 steps
    sudo .venv/bin/python benchmarks/node_wire.py --nodes 2 --ranks-per-node 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lowcomm.comm.meter import ring_inter_node_share

OPTIMIZERS = {
    "adamw_ddp": [],
    "demo": [],
    "flexdemo": [],  # shard group: the ranks of one node (LOCAL_WORLD_SIZE)
}
PORT = 29761


def _counters() -> dict[str, int]:
    base = Path("/sys/class/net")
    return {"intra": int((base / "lo/statistics/tx_bytes").read_text()),
            "inter": int((base / "eth0/statistics/tx_bytes").read_text())}


def _metered(comm) -> dict[str, int]:
    """This rank's metered tx and messages per scope (``<scope>`` and ``<scope>/messages``),
    data and control together."""
    totals: dict[str, int] = {}
    for key, values in comm.meter.breakdown().items():
        _purpose, scope, _collective = key.split("/")
        totals[scope] = totals.get(scope, 0) + values["tx"]
        totals[f"{scope}/messages"] = totals.get(f"{scope}/messages", 0) + values["messages"]
    return totals


def inside(steps: int, out: Path) -> None:
    """One rank: the windows, its meter's tx per scope, and (first rank of a node) the node's
    counters around each window."""
    import torch
    import torch.distributed as dist
    from wire_check import tiny_stepper  # this script's directory is on sys.path

    from lowcomm.comm import Communicator
    from lowcomm.distenv import DistEnv

    torch.set_num_threads(1)
    env = DistEnv.from_environ()
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    first_on_node = env.local_rank == 0
    windows: dict[str, dict] = {}

    def window(name: str, comm, work) -> None:
        dist.barrier()
        kernel_before = _counters() if first_on_node else None
        dist.barrier()
        metered_before = _metered(comm)
        work()
        metered_after = _metered(comm)
        dist.barrier()
        kernel_after = _counters() if first_on_node else None
        windows[name] = {
            "metered": {s: metered_after.get(s, 0) - metered_before.get(s, 0) for s in metered_after},
            "kernel": ({k: kernel_after[k] - kernel_before[k] for k in kernel_after} if first_on_node else None),
        }

    window("empty", Communicator(), lambda: None)
    for name, overrides in OPTIMIZERS.items():
        comm = Communicator.world("cpu")
        step = tiny_stepper(name, overrides, env.rank, comm)
        step()  # outside the window: one-time set-up traffic (DDP's bucket order, FSDP's first gathers)
        window(name, comm, lambda step=step: [step() for _ in range(steps)])
    out.write_text(json.dumps({"rank": env.rank, "local_rank": env.local_rank, "node": env.rank // env.local_world_size,
                               "windows": windows}))
    dist.destroy_process_group()


def summarize(per_rank: list[dict], nodes: int, ranks_per_node: int) -> dict:
    """Per window and node: the kernel's intra / inter bytes (less the barriers' share, from the
    empty window), the meter's tx of the node's ranks per scope, and the ring model's inter share."""
    world = nodes * ranks_per_node
    result: dict[str, dict] = {}
    for name in per_rank[0]["windows"]:
        per_node = []
        for node in range(nodes):
            ranks = [r for r in per_rank if r["node"] == node]
            first = next(r for r in ranks if r["local_rank"] == 0)
            kernel = first["windows"][name]["kernel"]
            empty = first["windows"]["empty"]["kernel"]
            metered: dict[str, int] = {}
            for r in ranks:
                for scope, value in r["windows"][name]["metered"].items():
                    metered[scope] = metered.get(scope, 0) + value
            per_node.append({"kernel": {k: kernel[k] - (empty[k] if name != "empty" else 0) for k in kernel},
                             "metered": metered})
        share = ring_inter_node_share(world, ranks_per_node)
        for figures in per_node:
            figures["predicted"] = node_split(figures["metered"], share)
        result[name] = {"per_node": per_node, "ring_inter_share": share}
    return {"nodes": nodes, "ranks_per_node": ranks_per_node, "windows": result}


def node_split(metered: dict[str, int], share: float) -> dict[str, float]:
    """What the comm table says one node puts on each link, from its ranks' metered tx and
    messages per scope: a world collective's ring leaves the node ``share`` of the time
    (``ring_inter_node_share``: nodes / W), the rest stays inside it; the ``inter`` scope (the
    replicas across nodes) crosses, the ``intra`` scope (the shard group) does not. Keys:
    ``inter``, ``intra`` (bytes) and ``<link>/messages``."""
    world, world_messages = metered.get("world", 0), metered.get("world/messages", 0)
    return {"inter": world * share + metered.get("inter", 0),
            "inter/messages": world_messages * share + metered.get("inter/messages", 0),
            "intra": world * (1 - share) + metered.get("intra", 0),
            "intra/messages": world_messages * (1 - share) + metered.get("intra/messages", 0)}


def run(nodes_count: int, ranks_per_node: int, steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from netns import node_network

    world = nodes_count * ranks_per_node
    with tempfile.TemporaryDirectory() as tmp, node_network(nodes_count, prefix="lcwire") as nodes:
        procs = []
        for index, node in enumerate(nodes):
            for local in range(ranks_per_node):
                rank = index * ranks_per_node + local
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(ranks_per_node), "MASTER_ADDR": nodes[0].hostname,
                       "MASTER_PORT": str(PORT), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
                argv = [sys.executable, str(Path(__file__).resolve()), "--inside", "--steps", str(steps),
                        "--out", str(Path(tmp) / f"rank{rank}.json")]
                procs.append(subprocess.Popen(node.command(argv), env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
        outputs = [proc.communicate(timeout=900)[0] for proc in procs]
        failed = [(rank, out[-2000:]) for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True))
                  if proc.returncode != 0]
        if failed:
            raise RuntimeError(f"ranks failed: {failed}")
        per_rank = [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(world)]
    return summarize(per_rank, nodes_count, ranks_per_node)


def format_report(result: dict) -> str:
    lines = [f"{result['nodes']} nodes x {result['ranks_per_node']} gloo ranks; per node, MB = 1e6 bytes; kernel: "
             "the node's loopback (intra) and veth (inter) tx, less the window's barriers; metered: the node's "
             "ranks' tx as the comm table splits it (a world ring leaves the node nodes/W of the time); msgs: "
             "metered sends on that link",
             f"{'window':<10} {'node':>4} {'kernel intra':>13} {'metered intra':>14} {'msgs':>6} "
             f"{'kernel inter':>13} {'metered inter':>14} {'msgs':>6} {'inter overhead B/msg':>21}"]
    for name, window in result["windows"].items():
        if name == "empty":
            continue
        for node, figures in enumerate(window["per_node"]):
            k, p = figures["kernel"], figures["predicted"]
            overhead = (k["inter"] - p["inter"]) / max(p["inter/messages"], 1)
            lines.append(f"{name:<10} {node:>4} {k['intra'] / 1e6:13.4f} {p['intra'] / 1e6:14.4f} "
                         f"{p['intra/messages']:6.0f} {k['inter'] / 1e6:13.4f} {p['inter'] / 1e6:14.4f} "
                         f"{p['inter/messages']:6.0f} {overhead:21.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        inside(args.steps, args.out)
        return 0
    if os.geteuid() != 0:
        print("node_wire: needs root (ip netns add)", file=sys.stderr)
        return 2
    result = run(args.nodes, args.ranks_per_node, args.steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
