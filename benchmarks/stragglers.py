"""Unequal workers on real nodes: time to a target loss when one node computes slower, or has a
thinner link, measured on network-namespace nodes beside the wall-clock model's prediction.

N nodes (benchmarks/netns.py ``node_network``: a namespace per node, a veth from each to a
bridge, one gloo worker per node as torchrun would start it) train the tiny model with each
method's quickstart settings, in four cases:

- ``unshaped``: every veth unshaped; its measured step time is the compute the model starts from;
- ``equal``: every node's veth shaped to ``--link``;
- ``slow compute``: the same links, node ``--slow-node`` computing ``--slowdown`` times slower,
  for real (``cluster.slow_ranks`` / ``cluster.slowdown``: lowcomm.train.slowdown);
- ``slow link`` (with ``--slow-link``): node ``--slow-node``'s veth shaped to that rate instead.

For each it measures the wall time to ``--target-loss`` (the first validation at or below it;
default: the highest of the equal runs' best validation losses, which every method reaches) and
the validation loss at a fixed wall time (the method's equal run's whole time), and predicts the
time to the target with ``lowcomm.report.wallclock``: each run's steps placed in time from the
unshaped run's compute (x the slowdown in the slow-compute case for every method that waits for
its slowest worker at its exchanges; a learner of Decoupled or asynchronous DiLoCo does not), plus
the run's metered traffic on the link (in the slow-link case the slow node's: a ring collective
goes at its slowest hop), its framing per message measured from the veths' kernel counters. The
target is a prediction within 25 %.

It prints a table and, last, one JSON line with each method's measured and predicted time to the
target per case; writes ``summary.md``, ``stragglers.json`` and ``loss_vs_time.png`` to ``--out``.

    sudo .venv/bin/python benchmarks/stragglers.py --nodes 4 --slow-node 3 --slowdown 2 --slow-link 10M
    sudo .venv/bin/python benchmarks/stragglers.py --methods adamw_ddp diloco --steps 40 --out /tmp/s

On a machine with fewer cores than nodes the workers share cores: an equal run's compute is what
the shared cores give, and a slow node, stretched by ``(F - 1) x`` its step's CPU time, is slower
on the wall clock by ``1 + (F - 1) x s`` where ``s`` is a worker's share of a core (cores over
nodes, at most 1: 1.5 for F = 2 with 4 nodes on 2 cores). That is the slowdown the model is given
(``slowdown_on_the_wall_clock`` in the JSON). What it leaves out: while the slow node sleeps its
core goes to the others, which then compute faster than the equal run did. Needs root and
iproute2; the namespaces are deleted on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
from wan import IN_THE_COMPUTE, TARGET, Nodes, measured_times

from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.report.figures import FAMILY_MARKERS, run_colors
from lowcomm.report.runs import load_run
from lowcomm.report.wallclock import compute_seconds_per_step, recorded_link_bps, timeline
from lowcomm.strategies import STRATEGIES
from lowcomm.units import parse_bandwidth

# the synchronous and local-update methods issue 47 compares, each with its quickstart settings
METHODS = ("adamw_ddp", "diloco", "streaming_diloco", "eager_diloco", "noloco", "decoupled_diloco", "async_diloco")


def _label(method: str) -> str:
    return STRATEGIES[method].quickstart[0].label


def _overrides(method: str, case: str, args: argparse.Namespace) -> list[str]:
    steps = args.steps
    slow = ([f"cluster.slow_ranks=[{args.slow_node}]", f"cluster.slowdown={args.slowdown:g}"]
            if case == "slow compute" else [])
    # the links as the run's own settings (Nodes.train shapes each node's veth from them)
    links = [] if case == "unshaped" else [f"cluster.link_rate={args.link}"]
    if case == "slow link":
        links += [f"cluster.slow_link_nodes=[{args.slow_node}]", f"cluster.slow_link_rate={args.slow_link}"]
    return ["experiment=quickstart", "wandb.mode=disabled", f"cluster.workers={args.nodes}",
            f"train.max_steps={steps}", f"train.warmup_steps={max(1, steps // 10)}", "train.checkpoint_every=0",
            f"train.log_every={max(1, steps // 20)}", f"train.eval_every={max(1, steps // 10)}",
            f"run_root={args.work / case.replace(' ', '_')}", f"optimizer={method}",
            *STRATEGIES[method].quickstart[0].overrides, *slow, *links]


def core_share(workers: int) -> float:
    """How much of a core each of ``workers`` busy workers gets on this machine (at most one)."""
    return min(1.0, len(os.sched_getaffinity(0)) / workers)


def _time_to(target: float, steps: list[int], seconds: list[float], run) -> float | None:
    """The time of the first validation at or below ``target``."""
    at = dict(zip(steps, seconds, strict=True))
    for step, loss in zip(*run.series("val/loss"), strict=True):
        if loss <= target and step in at:
            return at[step]
    return None


def _loss_at(fixed_s: float, run) -> float | None:
    """The last validation loss measured by ``fixed_s`` seconds of training."""
    at = dict(zip(*measured_times(run), strict=True))
    seen = [loss for step, loss in zip(*run.series("val/loss"), strict=True) if step in at and at[step] <= fixed_s]
    return seen[-1] if seen else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="nodes, one worker each (default 4)")
    parser.add_argument("--slow-node", type=int, help="the unequal node (default: the last)")
    parser.add_argument("--slowdown", type=float, default=2.0, help="how many times slower it computes (default 2)")
    parser.add_argument("--slow-link", metavar="RATE", help="its veth's rate in the slow-link case (e.g. 10M; "
                                                            "default: no slow-link case)")
    parser.add_argument("--link", default="100M", metavar="RATE", help="every other veth's rate (default 100M)")
    parser.add_argument("--methods", nargs="+", choices=sorted(STRATEGIES), default=list(METHODS),
                        help=f"(default: {' '.join(METHODS)})")
    parser.add_argument("--steps", type=int, default=60, help="training steps of every run (default 60)")
    parser.add_argument("--target-loss", type=float, help="validation loss to time (default: the highest of the "
                                                          "equal runs' best, which every method reaches)")
    parser.add_argument("--out", type=Path, default=Path("results/stragglers"), help="table, JSON and figure")
    parser.add_argument("--work", type=Path, default=Path("runs/stragglers"), help="run directories")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (ip netns add, tc)")
    if args.nodes < 2:
        parser.error(f"--nodes must be at least 2, got {args.nodes}")
    args.slow_node = args.nodes - 1 if args.slow_node is None else args.slow_node
    if not 0 <= args.slow_node < args.nodes:
        parser.error(f"--slow-node must be a node of 0 ... {args.nodes - 1}, got {args.slow_node}")
    if not args.slowdown > 1:
        parser.error(f"--slowdown must be a factor > 1, got {args.slowdown}")
    if args.steps < 10:
        parser.error(f"--steps must be at least 10 (a validation every tenth), got {args.steps}")
    try:
        for rate in (args.link, *([args.slow_link] if args.slow_link else [])):
            parse_bandwidth(rate)
    except ValueError as exc:
        parser.error(str(exc))
    cases = ["unshaped", "equal", "slow compute", *(["slow link"] if args.slow_link else [])]
    args.out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, dict[str, object]] = {method: {} for method in args.methods}
    carried: dict[str, dict[str, int]] = {method: {} for method in args.methods}
    shaped: dict[str, str] = {}
    started = time.perf_counter()
    # the methods of learners' synchronizer on a node of its own, its veth at the others' rate
    learners = any(STRATEGIES[method].learners for method in args.methods)
    with Nodes(args.nodes, 1, synchronizer_node=learners) as topology:
        namespaces = topology.namespaces()
        for case in cases:
            print(f"[stragglers] {case}", flush=True)
            for method in args.methods:
                print(f"[stragglers]   {_label(method)} ({time.perf_counter() - started:.0f} s)", flush=True)
                overrides = _overrides(method, case, args)
                before = topology.carried()
                shaped[case] = topology.train(overrides)  # each node's veth as the run's config has it
                carried[method][case] = topology.carried() - before
                runs[method][case] = load_run(validate(compose(overrides)).run_dir)

    target = args.target_loss
    if target is None:
        target = max(min(runs[method]["equal"].series("val/loss")[1]) for method in args.methods)
    results = {"nodes": args.nodes, "slow_node": args.slow_node, "slowdown": args.slowdown, "link": args.link,
               "slow_link": args.slow_link, "steps": args.steps, "target_loss": target, "shaped": shaped,
               "namespaces": namespaces, "methods": {}}
    # the slow node's steps on the wall clock: lowcomm stretches a rank by (F - 1) x its step's CPU
    # time, and a worker that shares a core gets only its share of the wall time as CPU time
    share = core_share(args.nodes)
    realised = 1.0 + (args.slowdown - 1.0) * share
    results.update(core_share=share, slowdown_on_the_wall_clock=realised)
    for method in args.methods:
        own = runs[method]
        compute = compute_seconds_per_step(own["unshaped"])
        fixed = measured_times(own["equal"])[1][-1]
        entries = {}
        for case in cases[1:]:
            run = own[case]
            rate = recorded_link_bps(run)  # the run's own record of its links: the slowest node's
            link, ranks_per_link = topology.link(case, rate, run, carried[method][case])
            # the case's own run placed in time from the unshaped run's compute: its traffic and its
            # losses step by step (the same as the unshaped run's for every method whose training
            # does not depend on arrival times; the learners' does)
            predicted = timeline(run, link, intra=IN_THE_COMPUTE, ranks_per_link=ranks_per_link,
                                 compute_s=compute, slowdown=realised if case == "slow compute" else 1.0)
            measured_s = _time_to(target, *measured_times(run), run)
            predicted_s = _time_to(target, predicted.steps, predicted.seconds, run)
            entries[case] = {
                "measured_s": measured_s, "predicted_s": predicted_s,
                "error": None if not measured_s or predicted_s is None else predicted_s / measured_s - 1,
                "measured_step_s": compute_seconds_per_step(run), "final_val_loss": run.final_val_loss,
                "val_loss_at_fixed_time": _loss_at(fixed, run), "framing_bytes_per_message": link.framing_bytes,
                "link_bps": rate,
                "stretched_s": (run.summary or {}).get("stretched_s"),
            }
        results["methods"][_label(method)] = {"fixed_time_s": fixed, "compute_s_per_step": compute, "cases": entries}

    table = format_table(results, cases[1:])
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "stragglers.json").write_text(json.dumps(results, indent=2) + "\n")
    figure = plot(runs, cases[1:], target, args.out)
    print(table)
    print(f"table:  {args.out / 'summary.md'}\njson:   {args.out / 'stragglers.json'}\nfigure: {figure}")
    print(json.dumps({"target_loss": target, "methods": {
        label: {case: {"measured_s": entry["measured_s"], "predicted_s": entry["predicted_s"]}
                for case, entry in method["cases"].items()}
        for label, method in results["methods"].items()}}))
    return 0


def format_table(results: dict, cases: list[str]) -> str:
    def seconds(value):
        return "not reached" if value is None else f"{value:.2f}"

    lines = [f"{results['nodes']} nodes (one gloo worker each, netns), {results['steps']} steps of the tiny model; "
             f"node {results['slow_node']} slow: x{results['slowdown']:g} compute (on the wall clock "
             f"x{results['slowdown_on_the_wall_clock']:.2f}, a worker having {results['core_share']:.2f} of a core)"
             + (f", or its link {results['slow_link']} instead of {results['link']}" if results["slow_link"] else "")
             + f". Target: validation loss <= {results['target_loss']:.4f}.", "",
             "| method | case | time to target, measured (s) | predicted (s) | error | val loss at the equal run's "
             "whole time | final val loss |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for label, method in results["methods"].items():
        for case in cases:
            entry = method["cases"][case]
            error = "-" if entry["error"] is None else f"{entry['error']:+.0%}"
            at_fixed = entry["val_loss_at_fixed_time"]
            lines.append(f"| {label} | {case} | {seconds(entry['measured_s'])} | {seconds(entry['predicted_s'])} | "
                         f"{error} | {'-' if at_fixed is None else f'{at_fixed:.4f}'} | {entry['final_val_loss']:.4f} |")
    errors = [abs(entry["error"]) for method in results["methods"].values() for entry in method["cases"].values()
              if entry["error"] is not None]
    if errors:
        within = sum(error <= TARGET for error in errors)
        lines += ["", f"{within} of {len(errors)} predictions within {TARGET:.0%} of the measurement."]
    return "\n".join(lines)


def plot(runs: dict, cases: list[str], target: float, out: Path) -> Path:
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.8), sharey=True, squeeze=False)
    colors = run_colors([own["equal"] for own in runs.values()])
    for ax, case in zip(axes[0], cases, strict=True):
        for own in runs.values():
            run = own[case]
            at = dict(zip(*measured_times(run), strict=True))
            points = [(at[s], v) for s, v in zip(*run.series("val/loss"), strict=True) if s in at]
            ax.plot([t for t, _ in points], [v for _, v in points], lw=1.3, ms=4, label=_label(run.optimizer),
                    marker=FAMILY_MARKERS.get(run.optimizer, "."), color=colors[id(own["equal"])])
        ax.axhline(target, color="0.5", lw=0.8, ls="--")
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("measured wall-clock time of the steps (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss")
    axes[0][-1].legend(fontsize=7)
    path = out / "loss_vs_time.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
