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

The target is a prediction within 25 % of the measurement. Then, from the runs on the slowest
link, it draws validation loss against measured wall-clock time (each logged window's measured
step time; validation is timed in the window after it) and writes, in ``--out``:
``summary.md`` (the table), ``wan.json`` and ``loss_vs_time_<link>.png``.

    sudo .venv/bin/python benchmarks/wan.py                    # 100 and 10 Mbit/s, 100 steps: ~4 min
    sudo .venv/bin/python benchmarks/wan.py --links 100M 10M --steps 60 --out results/wan

Needs root and iproute2 (``ip netns``, ``tc``); the namespace is deleted on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
from netns import limit_rate, loopback_tx_bytes, network_namespace  # benchmarks/netns.py

from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.report.figures import FAMILY_MARKERS, run_colors
from lowcomm.report.runs import load_run
from lowcomm.report.wallclock import Link, compute_seconds_per_step, parse_bandwidth, timeline

WORLD = 4 if (os.cpu_count() or 1) >= 4 else 2  # a core per worker; the quickstart's batch takes 1, 2 or 4
TARGET = 0.25
OPTIMIZERS = {
    "AdamW-DDP": ["optimizer=adamw_ddp", "optimizer.lr=6e-3"],
    "DeMo k=32": ["optimizer=demo", "optimizer.lr=6e-3"],
    "DeMo k=32 one bucket": ["optimizer=demo", "optimizer.lr=6e-3", "optimizer.bucket_numel=10000000000"],
    "DiLoCo H=10": ["optimizer=diloco", "optimizer.lr=6e-3", "optimizer.sync_every=10"],
}


def _rate_name(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e6:g}Mbit" if bits_per_s < 1e9 else f"{bits_per_s / 1e9:g}Gbit"


def _overrides(label: str, steps: int, run_root: Path, workers: int) -> list[str]:
    return ["experiment=quickstart", "wandb.mode=disabled", f"cluster.workers={workers}", f"train.max_steps={steps}",
            f"train.warmup_steps={max(1, steps // 10)}", "train.checkpoint_every=0",
            f"train.log_every={max(1, steps // 10)}", f"train.eval_every={max(1, steps // 5)}",
            f"run_root={run_root}", f"label='{label}'", *OPTIMIZERS[label]]


def train_in(namespace: str, overrides: list[str]) -> None:
    """One lowcomm-train run inside the namespace (its local launcher starts the W workers there)."""
    command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "lowcomm.cli.train", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"training failed ({' '.join(overrides)}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


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
                        help="rates of the shaped loopback in bit/s (default: 100M 10M); the last draws the figure")
    parser.add_argument("--workers", type=int, default=WORLD, help=f"gloo workers (default {WORLD})")
    parser.add_argument("--steps", type=int, default=100, help="training steps of every run (default 100)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--out", type=Path, default=Path("results/wan"), help="tables, JSON and figure")
    parser.add_argument("--work", type=Path, default=Path("runs/wan"), help="run directories (default: runs/wan)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (ip netns add, tc)")
    rates = [parse_bandwidth(text) for text in args.links]
    work = args.work
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"world_size": args.workers, "steps": args.steps, "optimizers": args.optimizers, "links": {},
                     }
    runs: dict[str, dict] = {}
    started = time.perf_counter()
    with network_namespace("lowcomm-wan") as namespace:
        for rate in [None, *rates]:
            name = "unshaped" if rate is None else _rate_name(rate)
            shown = limit_rate(namespace, rate)
            print(f"[wan] link {name}: {shown or 'no qdisc'}", flush=True)
            results["links"][name] = {"tc": shown, "bits_per_s": rate, "runs": {}}
            runs[name] = {}
            for label in args.optimizers:
                print(f"[wan]   {label} ({time.perf_counter() - started:.0f} s)", flush=True)
                overrides = _overrides(label, args.steps, work / name, args.workers)
                before = loopback_tx_bytes(namespace)
                train_in(namespace, overrides)
                carried = loopback_tx_bytes(namespace) - before
                run = load_run(validate(compose(overrides)).run_dir)
                runs[name][label] = run
                entry = {"measured_step_s": compute_seconds_per_step(run), "final_val_loss": run.final_val_loss,
                         "kernel_MB_per_step": carried / 1e6 / args.steps,
                         "metered_tx_MB_per_step": args.workers * run.summary["tx_MB_per_step"]}
                if rate is not None:
                    per_rank = rate / args.workers
                    messages = args.workers * run.series("comm/cum_messages")[1][-1]
                    framing = max(0.0, carried - args.workers * run.summary["tx_MB_per_step"] * 1e6 * args.steps)
                    entry["framing_bytes_per_message"] = framing / max(messages, 1)
                    link = Link(name, per_rank, entry["framing_bytes_per_message"] * 8 / per_rank)
                    compute = results["links"]["unshaped"]["runs"][label]["measured_step_s"]
                    predicted = timeline(run, link, compute_s=compute)
                    entry["predicted_step_s"] = predicted.total_s / predicted.steps[-1]
                    entry["comm_s_per_step"] = predicted.comm_s_per_step
                    entry["overlap"] = predicted.overlap
                    entry["error"] = entry["predicted_step_s"] / entry["measured_step_s"] - 1
                results["links"][name]["runs"][label] = entry
            limit_rate(namespace, None)
    table = format_table(results)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "wan.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    figure = plot(results, runs, _rate_name(rates[-1]), args.out)
    print(f"table:  {args.out / 'summary.md'}\njson:   {args.out / 'wan.json'}\nfigure: {figure}")
    return 0


def format_table(results: dict) -> str:
    lines = [f"Time per training step, {results['world_size']} gloo workers, tiny OLMo, {results['steps']} steps "
             f"per run; predicted = unshaped step time + the run's metered traffic on the link "
             f"(bandwidth / {results['world_size']} per rank, the measured framing per message), target within "
             f"{TARGET:.0%}.", "",
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
