"""Churn on real nodes: one node's worker killed mid-run and back later, survived by replica
groups (``cluster.fault_tolerance=torchft``) and, beside it, handled today's way (every rank
stops, and the job is started again from its last checkpoint once the node is back).

N nodes (benchmarks/netns.py ``node_network``: a namespace per node, a veth from each to a
bridge, the host on the bridge as a login node holding the job's torchft lighthouse) train the
tiny model with the method's quickstart settings, one worker per node, three times:

- ``uninterrupted``: replica groups, nobody killed: the final loss and wall time to compare with;
- ``replica groups``: each node's group a ``lowcomm-torchrun --standalone`` of its own, told its
  group by ``$LOWCOMM_REPLICA_GROUP`` (as a user runs them: docs/faults.md). Node ``--kill-node`` is
  lost (SIGKILL to every process in it) once it has logged step ``--kill-at-step``, and started
  again once the others have logged ``--rejoin-at-step``. The others never stop; the restarted
  group resumes from its own checkpoint and heals from a live peer at its next exchange;
- ``requeue``: one world (``cluster.fault_tolerance=none``), the same kill; the other ranks find
  their peer gone and stop, and every node is started again from the last checkpoint once the
  killed node is back, as long after the kill as in the replica-groups run.

Goodput is useful steps per second over the whole run (``--steps`` over the wall time from the
first start to the last worker's end). The heal's bytes are the meter's (the healed group's
``heal_rx_MB``) against the kernel's: what the restarted node's veth received from its start to
the end of the run, less what the meter says it received besides the heal, less the framing the
same node's veth added per metered byte and second in the uninterrupted run.

It prints a table and, last, one JSON line; writes ``summary.md``, ``churn.json`` and
``loss_vs_time.png`` (validation loss against wall time, the two paths and the uninterrupted run)
to ``--out``.

    sudo .venv/bin/python benchmarks/churn.py --method diloco --nodes 4 --kill-node 3 \\
        --kill-at-step 60 --rejoin-at-step 100 --steps 300

Needs root and iproute2; the namespaces are deleted on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
from netns import NODE_INTERFACE, Node, login_address, node_network

from lowcomm.comm.ft import LIGHTHOUSE_ENV, start_lighthouse
from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.launch.local import HEARTBEAT_TIMEOUT_S, prepare_run_dir
from lowcomm.rundir import RunDir
from lowcomm.strategies import STRATEGIES
from lowcomm.train.metrics import read_metrics
from lowcomm.train.replicas import REPLICA_GROUP_ENV, replica_run_dir

PORT = 29791  # the requeue path's rendezvous, on the first node
POLL_S = 0.05
PATHS = ("uninterrupted", "replica groups", "requeue")


@dataclass
class Trial:
    """One of the three runs: its directory, when its validation losses appeared, and what it cost."""

    name: str
    run: object = None
    started: float = 0.0
    wall_s: float = 0.0
    val_at: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (seconds, loss)
    notes: dict[str, object] = field(default_factory=dict)


def _overrides(args: argparse.Namespace, path: str) -> list[str]:
    steps, torchft = args.steps, path != "requeue"
    return ["experiment=quickstart", "wandb.mode=disabled", f"cluster.workers={args.nodes}", f"optimizer={args.method}",
            *args.point, *args.dense, f"train.max_steps={steps}",
            f"train.warmup_steps={max(1, steps // 10)}", f"train.checkpoint_every={args.checkpoint_every}",
            "train.log_every=1", f"train.eval_every={args.eval_every}", "cluster.collective_timeout_s=10",
            f"cluster.threads_per_worker={max(1, (os.cpu_count() or 1) // args.nodes)}",
            # an exchange commits with all but one group: the survivors go on, and a restarted group
            # that reaches its exchange while the others compute waits for them (and heals) rather
            # than commit one of its own, alone and behind
            *(["cluster.fault_tolerance=torchft", f"cluster.min_replicas={max(1, args.nodes - 1)}",
               "cluster.join_timeout_s=5"] if torchft else []),
            f"run_root={args.work / path.replace(' ', '_')}"]


def _start(node: Node, rank: int, args: argparse.Namespace, config: Path, lighthouse: str, log: Path,
           torchft: bool) -> subprocess.Popen:
    """Node ``rank``'s worker. As replica groups, each
    node is a ``lowcomm-torchrun --standalone`` of its own, told its group by
    ``$LOWCOMM_REPLICA_GROUP`` (what a user runs per node); one world (the requeue path), lowcomm's
    worker as rank ``rank`` of the nodes (what torchrun or a SLURM task exports)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": NODE_INTERFACE, "OMP_NUM_THREADS": "1", LIGHTHOUSE_ENV: lighthouse}
    worker = ["-m", "lowcomm.train.worker", str(config)]
    if torchft:
        env[REPLICA_GROUP_ENV] = str(rank)
        argv = [sys.executable, "-m", "lowcomm.cli.torchrun", "--standalone", "--nproc-per-node", "1", *worker]
    else:
        env.update({"RANK": str(rank), "WORLD_SIZE": str(args.nodes), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": args.network[0].hostname, "MASTER_PORT": str(PORT)})
        argv = [sys.executable, *worker]
    with log.open("a") as out:
        return subprocess.Popen(node.command(argv), env=env, stdout=out, stderr=subprocess.STDOUT)


def _kill(node: Node, proc: subprocess.Popen) -> None:
    """The node lost: every process on it (torchrun's agent and its workers alike), then reaped."""
    node.kill_all()
    proc.wait()


def _group_dirs(run, nodes: int, torchft: bool) -> list[Path]:
    return [replica_run_dir(run.run_dir, rank) for rank in range(nodes)] if torchft else [Path(run.run_dir)]


def _last_step(run_dir: Path) -> int:
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        return 0
    return max((r["step"] for r in records if "train/loss" in r), default=0)


def _watch(path: Trial, run_dir: Path) -> None:
    """Note when each validation loss of ``run_dir`` (the run's, group 0's) first appeared; a step
    logged again after a restart is timed again."""
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        return
    seen = {}
    for record in records:
        if "val/loss" in record:
            seen[record["step"]] = record["val/loss"]
    now = time.perf_counter() - path.started
    for step, loss in seen.items():
        if step not in path.val_at or path.val_at[step][1] != loss:
            path.val_at[step] = (now, loss)


def _run(path: Trial, args: argparse.Namespace, lighthouse: str, *, kill_at: int | None = None,
         back_after_s: float | None = None) -> None:
    """Train ``path``'s run on the nodes; with ``kill_at``, kill node ``--kill-node``'s worker once
    it has logged that step, and start it again (replica groups) once the others have logged
    ``--rejoin-at-step``, or (requeue) start every node again once the others have stopped and
    ``back_after_s`` has passed since the kill."""
    torchft = path.name != "requeue"
    run = validate(compose(_overrides(args, path.name)))
    config = prepare_run_dir(run)
    path.run = run
    groups = _group_dirs(run, args.nodes, torchft)
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = [logs / f"{path.name.replace(' ', '_')}-node{rank}.log" for rank in range(args.nodes)]
    victim = args.kill_node
    path.started = time.perf_counter()
    started: list[subprocess.Popen] = []  # every worker this run started, stopped on the way out

    def start(rank: int) -> subprocess.Popen:
        started.append(_start(args.network[rank], rank, args, config, lighthouse, log[rank], torchft))
        return started[-1]

    try:
        _supervise(path, args, groups, start, torchft, kill_at, back_after_s)
    finally:
        for node in args.network:  # whatever still runs on the nodes
            node.kill_all()
        for proc in started:
            proc.wait()
    path.wall_s = time.perf_counter() - path.started
    _watch(path, groups[0])
    path.notes["received_at_end"] = args.network[victim].received()
    path.notes["summaries"] = [RunDir(group).read_summary() for group in groups]
    path.notes["metrics"] = [read_metrics(group / "metrics.jsonl") for group in groups]


def _supervise(path: Trial, args: argparse.Namespace, groups: list[Path], start, torchft: bool,
               kill_at: int | None, back_after_s: float | None) -> None:
    """Start the nodes' workers, kill and restart as :func:`_run` says, until every worker ends."""
    victim = args.kill_node
    procs = [start(rank) for rank in range(args.nodes)]
    killed_at_s = relaunched = None
    survivors_stopped = False
    while True:
        _watch(path, groups[0])
        now = time.perf_counter() - path.started
        if kill_at is not None and killed_at_s is None and _last_step(groups[victim if torchft else 0]) >= kill_at:
            _kill(args.network[victim], procs[victim])
            killed_at_s = now
            path.notes["killed_at_step"] = _last_step(groups[victim if torchft else 0])
        if killed_at_s is not None and not relaunched:
            if torchft and _last_step(groups[0 if victim else 1]) >= args.rejoin_at_step:
                path.notes["received_at_restart"] = args.network[victim].received()
                procs[victim] = start(victim)
                relaunched, path.notes["restarted_at_s"] = True, now
                path.notes["down_s"] = now - killed_at_s
            elif not torchft and all(p.poll() is not None for p in procs) and now - killed_at_s >= back_after_s:
                survivors_stopped = True
                procs = [start(rank) for rank in range(args.nodes)]
                relaunched, path.notes["restarted_at_s"] = True, now
        if torchft and any(p.poll() not in (None, 0) for i, p in enumerate(procs) if i != victim or relaunched):
            survivors_stopped = True
            break
        if all(p.poll() is not None for p in procs) and (kill_at is None or relaunched):
            break
        time.sleep(POLL_S)
    for p in procs:
        p.wait()
    failed = [rank for rank, p in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = args.work / "logs"
        raise RuntimeError(f"{path.name}: worker {failed[0]} failed; see {logs}")
    path.notes["survivors_stopped"] = survivors_stopped


def _framing(uninterrupted: Trial, victim: int, received: int) -> float:
    """What the victim node's veth carried beyond the meter in the uninterrupted run, per metered
    byte received (TCP/IP headers, and the lighthouse's heartbeats and quorum calls)."""
    metered = _metered_rx(uninterrupted.notes["metrics"][victim])
    return max(0.0, received - metered) / max(metered, 1)


def _metered_rx(records: list[dict]) -> float:
    """The data and control bytes a rank received by its meter (a ring's control all-reduce
    receives what it sends)."""
    return sum(r.get("comm/rx_bytes", 0) + r.get("comm/control_bytes", 0) for r in records if "train/loss" in r)


def _heal_kernel(path: Trial, per_byte: float, victim: int) -> float:
    """The heal's bytes by the kernel: what the restarted node's veth received from its restart
    to the end, less what the meter says it received besides the heal, that times the framing
    the same veth added per metered byte in the uninterrupted run."""
    records = path.notes["metrics"][victim]
    restart_step = path.notes["killed_at_step"]
    metered = _metered_rx([r for r in records if r.get("step", 0) > restart_step])  # the restarted process's
    received = path.notes["received_at_end"] - path.notes["received_at_restart"]
    return (received - metered * (1 + per_byte)) / (1 + per_byte)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runnable = sorted(name for name, s in STRATEGIES.items() if s.replica_groups_refusal is None)
    parser.add_argument("--method", choices=runnable, default="diloco", help="(default diloco)")
    parser.add_argument("--nodes", type=int, default=4, help="nodes, one worker (replica group) each (default 4)")
    parser.add_argument("--kill-node", type=int, help="the node whose worker is killed (default: the last)")
    parser.add_argument("--kill-at-step", type=int, default=60, help="kill it once it has logged this step (60)")
    parser.add_argument("--rejoin-at-step", type=int, default=100,
                        help="start it again once the others have logged this step (100)")
    parser.add_argument("--steps", type=int, default=300, help="training steps of every run (300)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="periodic checkpoints (20)")
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                        help=f"how long the lighthouse keeps a silent group in the quorum "
                             f"({HEARTBEAT_TIMEOUT_S:g} s, the local launcher's)")
    parser.add_argument("--join-timeout", type=float, default=5.0,
                        help="how long a quorum waits for a group it expects (5 s)")
    parser.add_argument("--out", type=Path, default=Path("results/churn"), help="table, JSON and figure")
    parser.add_argument("--work", type=Path, default=Path("runs/churn"), help="run directories and worker logs")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (ip netns add)")
    # SIGTERM (timeout, kill) leaves as Ctrl-C does: the workers stopped, the namespaces deleted
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if args.nodes < 2:
        parser.error(f"--nodes must be at least 2, got {args.nodes}")
    args.kill_node = args.nodes - 1 if args.kill_node is None else args.kill_node
    if not 0 <= args.kill_node < args.nodes:
        parser.error(f"--kill-node must be a node of 0 ... {args.nodes - 1}, got {args.kill_node}")
    if not 0 < args.kill_at_step < args.rejoin_at_step < args.steps:
        parser.error("needs 0 < --kill-at-step < --rejoin-at-step < --steps")
    args.eval_every = max(1, args.steps // 15)
    # the method's quickstart settings, with the exchange replica groups run (MuLoCo's point
    # quantizes, Streaming DiLoCo's sends E3M0)
    point = STRATEGIES[args.method].quickstart[0]
    args.point = [o for o in point.overrides if not o.startswith("compression")]
    args.dense = list(STRATEGIES[args.method].replica_groups_overrides())
    as_listed = compose([f"optimizer={args.method}", *point.overrides])
    as_run = compose([f"optimizer={args.method}", *args.point, *args.dense])
    unchanged = all(as_listed[group] == as_run[group] for group in ("optimizer", "compression"))
    args.label = point.label if unchanged else f"{STRATEGIES[args.method].display.name} (its quickstart settings, dense)"
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work / args.method
    if args.work.exists():  # a finished run is not trained again: a measurement starts from nothing
        shutil.rmtree(args.work)
        print(f"[churn] removed the previous runs in {args.work}", flush=True)

    paths = {name: Trial(name) for name in PATHS}
    with node_network(args.nodes, prefix="lcchurn", login=True) as network:
        args.network = network
        args.namespaces = [node.namespace for node in network]
        lighthouse_server = start_lighthouse(max(1, args.nodes - 1), join_timeout_s=args.join_timeout,
                                             heartbeat_timeout_s=args.heartbeat_timeout)
        port = lighthouse_server.address().rsplit(":", 1)[1]
        lighthouse = f"http://{login_address(network)}:{port}"
        try:
            print(f"[churn] {args.nodes} nodes, {args.method}; lighthouse {lighthouse}", flush=True)
            before = network[args.kill_node].received()
            _run(paths["uninterrupted"], args, lighthouse)
            framing = _framing(paths["uninterrupted"], args.kill_node, network[args.kill_node].received() - before)
            _run(paths["replica groups"], args, lighthouse, kill_at=args.kill_at_step)
            _run(paths["requeue"], args, lighthouse, kill_at=args.kill_at_step,
                 back_after_s=paths["replica groups"].notes["down_s"])
        finally:
            lighthouse_server.shutdown()

    result = _result(paths, args, framing)
    table = _table(paths, result, args)
    figure = _plot(paths, args)
    (args.out / "summary.md").write_text(table + f"\n\n![loss vs wall time]({figure.name})\n")
    (args.out / "churn.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table)
    print(json.dumps(result))
    return 0


def _result(paths: dict[str, Trial], args: argparse.Namespace, framing: float) -> dict:
    ft, requeue, clean = paths["replica groups"], paths["requeue"], paths["uninterrupted"]
    victim = args.kill_node
    heals = [r for r in ft.notes["metrics"][victim] if r.get("event") == "heal"]
    summaries = ft.notes["summaries"]
    return {
        "method": args.method, "nodes": args.nodes, "namespaces": args.namespaces, "kill_node": victim, "killed_at_step": ft.notes["killed_at_step"],
        "rejoin_requested_at_step": args.rejoin_at_step, "steps": args.steps,
        "survivors_stopped": ft.notes["survivors_stopped"],
        "rejoined_at_step": heals[0]["step"] if heals else None,
        "final_val_loss": summaries[0]["final_val_loss"],
        "final_val_loss_per_group": [s["final_val_loss"] for s in summaries],
        "uninterrupted_final_val_loss": clean.notes["summaries"][0]["final_val_loss"],
        "requeue_final_val_loss": requeue.notes["summaries"][0]["final_val_loss"],
        "heal_MB_metered": summaries[victim]["heal_rx_MB"],
        "heal_MB_sent_metered": sum(s["heal_tx_MB"] for s in summaries),
        "heal_MB_kernel": _heal_kernel(ft, framing, victim) / 1e6,
        "down_s": ft.notes["down_s"],
        "wall_s": {name: path.wall_s for name, path in paths.items()},
        "goodput_ft": args.steps / ft.wall_s,
        "goodput_requeue": args.steps / requeue.wall_s,
        "goodput_uninterrupted": args.steps / clean.wall_s,
    }


def _table(paths: dict[str, Trial], result: dict, args: argparse.Namespace) -> str:
    lines = [f"{args.nodes} nodes x 1 worker, {args.label}, {args.steps} steps; "
             f"node {args.kill_node} killed at step {result['killed_at_step']}, back {result['down_s']:.1f} s later",
             "", "| path | wall s | goodput steps/s | final val loss | survivors stopped |", "|---|---:|---:|---:|---|"]
    finals = {"uninterrupted": result["uninterrupted_final_val_loss"], "replica groups": result["final_val_loss"],
              "requeue": result["requeue_final_val_loss"]}
    stopped = {"uninterrupted": "-", "replica groups": str(result["survivors_stopped"]).lower(), "requeue": "true"}
    for name, path in paths.items():
        lines.append(f"| {name} | {path.wall_s:.1f} | {args.steps / path.wall_s:.2f} | {finals[name]:.4f} | "
                     f"{stopped[name]} |")
    lines += ["", f"heal: {result['heal_MB_metered']:.3f} MB metered (received), {result['heal_MB_sent_metered']:.3f} MB "
                  f"metered (sent), {result['heal_MB_kernel']:.3f} MB by the kernel; rejoined at step "
                  f"{result['rejoined_at_step']}"]
    return "\n".join(lines)


def _plot(paths: dict[str, Trial], args: argparse.Namespace) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {"uninterrupted": ("0.5", "--"), "replica groups": ("C0", "-"), "requeue": ("C3", "-")}
    for name, path in paths.items():
        points = sorted(path.val_at.values())
        color, line = styles[name]
        ax.plot([t for t, _ in points], [loss for _, loss in points], line, color=color, marker=".", label=name)
    ft = paths["replica groups"]
    for at, what in ((ft.notes["restarted_at_s"] - ft.notes["down_s"], f"node {args.kill_node} killed"),
                     (ft.notes["restarted_at_s"], f"node {args.kill_node} back")):
        ax.axvline(at, color="k", lw=0.8, ls=":")
        ax.annotate(what, (at, 0.98), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, ha="right",
                    va="top")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("validation loss (group 0's)")
    ax.set_title(f"{args.label}: a node lost and back, survived vs requeued", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    out = args.out / "loss_vs_time.png"
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    sys.exit(main())
