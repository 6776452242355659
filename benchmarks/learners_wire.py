"""The methods of learners on real nodes: each node's kernel counters against what the meter
says it sent, for Decoupled DiLoCo and asynchronous DiLoCo (issue 47).

N learner nodes and one synchronizer node (benchmarks/netns.py ``node_network``: a network
namespace per node, a veth from each to one bridge). The synchronizer runs on its node as the
local launcher would start it (``python -m lowcomm.train.synchronizer``), its address its node's
hostname; one learner per node (``python -m lowcomm.train.worker``, as torchrun would start it).
Every byte a learner sends goes over its veth to the synchronizer's, and back: so per node the
veth's tx is what the node's process metered sent (a learner's ``sent_bytes`` in its
summary.json, the synchronizer's in synchronizer.json), plus TCP/IP's framing and ACKs.

    sudo .venv/bin/python benchmarks/learners_wire.py                 # 2 learners, 20 steps, both methods
    sudo .venv/bin/python benchmarks/learners_wire.py --nodes 4 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.launch.local import prepare_run_dir
from lowcomm.rundir import RunDir
from lowcomm.strategies import STRATEGIES
from lowcomm.train.synchronizer import RECORD, learner_dir

METHODS = tuple(name for name, strategy in STRATEGIES.items() if strategy.learners)


def _overrides(method: str, nodes: int, steps: int, run_root: Path) -> list[str]:
    return ["experiment=quickstart", "wandb.mode=disabled", f"optimizer={method}",
            *STRATEGIES[method].quickstart[0].overrides, f"cluster.workers={nodes}", f"train.max_steps={steps}",
            "train.warmup_steps=2", "train.checkpoint_every=0", f"train.eval_every={steps}",
            "cluster.threads_per_worker=1", f"run_root={run_root}"]


def run(nodes_count: int, steps: int, methods=METHODS) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from netns import node_network, start_synchronizer_on

    results = {"nodes": nodes_count, "steps": steps, "methods": {}}
    with tempfile.TemporaryDirectory() as tmp, node_network(nodes_count + 1, prefix="lclrn") as network:
        learners, hub_node = network[:nodes_count], network[nodes_count]
        for method in methods:
            run_cfg = validate(compose(_overrides(method, nodes_count, steps, Path(tmp))))
            config = prepare_run_dir(run_cfg)
            record = Path(run_cfg.run_dir) / RECORD
            before = [node.counters()["inter"] for node in network]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            hub = start_synchronizer_on(hub_node, config, run_cfg.run_dir, env)
            procs = []
            for rank, node in enumerate(learners):
                # as torchrun sets it (a learner makes no process group: the rendezvous goes unused)
                learner_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(nodes_count), "LOCAL_RANK": "0",
                               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": learners[0].hostname, "MASTER_PORT": "29763"}
                procs.append(subprocess.Popen(node.command([sys.executable, "-m", "lowcomm.train.worker", str(config)]),
                                              env=learner_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
            outputs = [proc.communicate(timeout=900)[0] for proc in procs]
            hub_output = hub.communicate(timeout=120)[0]
            failed = [out[-2000:] for proc, out in zip(procs, outputs, strict=True) if proc.returncode != 0]
            if failed or hub.returncode != 0:
                raise RuntimeError(f"{method}: learners or synchronizer failed: {failed or hub_output[-2000:]}")
            after = [node.counters()["inter"] for node in network]
            kernel = [a - b for a, b in zip(after, before, strict=True)]
            summaries = [RunDir(learner_dir(run_cfg, m)).read_summary() for m in range(nodes_count)]
            served = json.loads(record.read_text())
            metered = [s["sent_bytes"] for s in summaries] + [served["bytes"]["tx"] + served["control_bytes"]["tx"]]
            received = [s["received_bytes"] for s in summaries] + [served["bytes"]["rx"] + served["control_bytes"]["rx"]]
            results["methods"][method] = {
                "label": STRATEGIES[method].quickstart[0].label,
                "per_node": [{"role": "learner" if i < nodes_count else "synchronizer", "kernel_tx": kernel[i],
                              "metered_tx": metered[i], "metered_rx": received[i]} for i in range(nodes_count + 1)],
                "final_val_loss": summaries[0]["final_val_loss"],
            }
    return results


def format_report(result: dict) -> str:
    lines = [f"{result['nodes']} learner nodes + 1 synchronizer node, {result['steps']} steps of the tiny model; "
             "per node its veth's tx by the kernel against its process's metered sends (MB = 1e6 bytes)", "",
             "| method | node | role | kernel tx (MB) | metered tx (MB) | kernel / metered | metered rx (MB) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for method in result["methods"].values():
        for index, node in enumerate(method["per_node"]):
            lines.append(f"| {method['label']} | {index} | {node['role']} | {node['kernel_tx'] / 1e6:.4f} | "
                         f"{node['metered_tx'] / 1e6:.4f} | {node['kernel_tx'] / max(node['metered_tx'], 1):.4f} | "
                         f"{node['metered_rx'] / 1e6:.4f} |")
    sent = sum(n["metered_tx"] for m in result["methods"].values() for n in m["per_node"])
    got = sum(n["metered_rx"] for m in result["methods"].values() for n in m["per_node"])
    lines += ["", f"Summed over every node and method, metered tx {sent:,} bytes = metered rx {got:,} bytes."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="learner nodes (default 2), one synchronizer node beside")
    parser.add_argument("--steps", type=int, default=20, help="steps of each run (default 20: two rounds at H = 10)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("learners_wire: needs root (ip netns add)", file=sys.stderr)
        return 2
    result = run(args.nodes, args.steps, args.methods)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
