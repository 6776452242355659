"""Metered bytes against the kernel's own count: W gloo workers in a private network namespace.

Every byte the workers exchange crosses that namespace's loopback, whose counters
(/sys/class/net/lo/statistics) count it with its TCP/IP headers and acknowledgements; nothing
else runs there. For each probe (bare collectives, then a few steps of optimizers on the tiny
model) the script reads the counter around a window of work and prints, summed over ranks, the
meter's tx bytes and messages beside the kernel's bytes. Two probes fix the wire's overhead:

- per byte: a 1 MB all-gather (few messages, so the bytes dominate);
- per message: many 16-byte all-gathers (the bytes are negligible, the messages dominate);

and the other windows' kernel bytes are then predicted from their metered tx and messages alone:
kernel ~ tx x (1 + overhead per byte) + messages x overhead per message. The other windows: a
1 MB ring all-reduce, the quantized all-reduce of a 2-bit tensor with about 1 MB of codes
(an all-to-all and an all-gather: about 2 (W-1)/W of its payload), a 1 MB point-to-point
exchange between pairs of ranks (NoLoCo's), and a few steps each of AdamW-DDP, DeMo,
MuLoCo-style DiLoCo (2-bit quantized pseudo-gradient, error feedback, the quantized all-reduce
at every step) and NoLoCo (its peer exchange at every step).

    sudo .venv/bin/python benchmarks/wire_check.py               # makes, uses and deletes a namespace
    sudo .venv/bin/python benchmarks/wire_check.py --steps 40 --json out.json

tests/test_wire.py runs the inside part (``--inside``) in a namespace of its own and asserts
the figures. Needs root and iproute2 (``ip netns``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from netns import network_namespace  # benchmarks/netns.py (this script's directory is on sys.path)

WORLD = 4
STEPS = 10
SMALL_GATHERS = 300  # 16-byte all-gathers of the per-message probe
LARGE_BYTES = 1_000_000  # the per-byte probe's all-gather payload per rank
REPEATS = 3  # large all-gathers / all-reduces per probe


def loopback_counters() -> tuple[int, int]:
    """(bytes, packets) sent on this namespace's loopback. On lo a packet is counted once as
    sent and once as received, so tx alone is the traffic."""
    base = Path("/sys/class/net/lo/statistics")
    return int((base / "tx_bytes").read_text()), int((base / "tx_packets").read_text())


def _metered(comm) -> tuple[int, int]:
    """Every tx byte and message the meter holds (data and control), this rank."""
    totals = comm.meter.breakdown().values()
    return sum(t["tx"] for t in totals), sum(t["messages"] for t in totals)


def tiny_stepper(name: str, overrides: list[str], rank: int, comm):
    """One training step of optimizer ``name`` (with ``overrides``) on the tiny model, this rank's
    own random tokens, its traffic through ``comm``: the unit every probe window repeats. Also
    used by node_wire.py."""
    import torch
    from omegaconf import OmegaConf

    from lowcomm.config import validate_optimizer
    from lowcomm.config.compose import compose
    from lowcomm.models import ModelSpec, build_model

    raw = OmegaConf.to_container(compose([f"optimizer={name}", *overrides]), resolve=True)
    strategy_cls, cfg = validate_optimizer(raw)
    strategy = strategy_cls(cfg, raw["compression"], comm)
    model, optimizer = strategy.build(build_model(ModelSpec(**raw["model"]), "cpu", seed=0))
    generator = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, 256, (2, 64), generator=generator)
        logits = model(tokens[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _probe_worker(rank: int, world: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from lowcomm.comm import Communicator

    if rank == 0 and sorted(os.listdir("/sys/class/net")) != ["lo"]:
        raise RuntimeError("not inside a private network namespace: /sys/class/net has "
                           f"{sorted(os.listdir('/sys/class/net'))}; run under `ip netns exec`")
    windows: dict[str, dict] = {}

    def window(name: str, comm, work) -> None:
        """Kernel and meter counts around ``work``. A barrier after the first reading holds every
        rank back until it is taken (a rank leaving a barrier early would otherwise send before
        it); that barrier and the closing one are in the kernel's count, and the ``empty``
        window measures them, to be subtracted."""
        dist.barrier()
        kernel_before = loopback_counters()
        dist.barrier()
        metered_before = _metered(comm)
        work()
        metered_after = _metered(comm)
        dist.barrier()
        kernel_after = loopback_counters()
        windows[name] = {
            "kernel_bytes": kernel_after[0] - kernel_before[0],
            "kernel_packets": kernel_after[1] - kernel_before[1],
            "tx": metered_after[0] - metered_before[0],
            "messages": metered_after[1] - metered_before[1],
        }

    comm = Communicator()
    window("empty", comm, lambda: None)
    large = torch.zeros(LARGE_BYTES // 4)
    window("all_gather 1 MB", comm, lambda: [comm.all_gather(large) for _ in range(REPEATS)])
    window("all_reduce 1 MB", comm, lambda: [comm.all_reduce(large) for _ in range(REPEATS)])
    from lowcomm.compress.quantize import Quantize

    codes = torch.randn(4 * LARGE_BYTES, generator=torch.Generator().manual_seed(rank)).view(1000, -1)
    window("all_reduce_quantized 1 MB", comm,
           lambda: [comm.all_reduce_quantized([codes.clone()], Quantize(bits=2)) for _ in range(REPEATS)])
    # point to point in pairs (0-1, 2-3: NoLoCo's gossip): one payload each way, no ring
    peers = [rank ^ 1] if world % 2 == 0 else []
    window("exchange 1 MB", comm, lambda: [comm.exchange([large], peers) for _ in range(REPEATS)])
    small = torch.zeros(4)
    window("all_gather 16 B", comm, lambda: [comm.all_gather(small) for _ in range(SMALL_GATHERS)])

    for label, name, overrides in (("adamw_ddp", "adamw_ddp", []), ("demo", "demo", []),
                                   ("diloco 2-bit", "diloco", ["compression=quantize", "optimizer.error_feedback=0.9",
                                                               "optimizer.sync_every=1"]),
                                   ("noloco", "noloco", ["optimizer.sync_every=1"])):
        comm = Communicator()
        step = tiny_stepper(name, overrides, rank, comm)
        step()  # outside the window: DDP's one-time bucket-order broadcast happens here
        window(f"{label} x {steps} steps", comm, lambda step=step: [step() for _ in range(steps)])
    return windows


def fit_overheads(windows: dict[str, dict]) -> tuple[float, float]:
    """(overhead per byte, bytes per message) from the large and the small all-gather probes:
    two equations kernel - barrier = tx (1 + a) + messages b, solved exactly."""
    barrier = windows["empty"]["kernel_bytes"]
    large, small = windows["all_gather 1 MB"], windows["all_gather 16 B"]
    # small: tx is tiny, so b first (a's share there is below a byte per message); then a
    per_message = (small["kernel_bytes"] - barrier - small["tx"]) / small["messages"]
    per_byte = (large["kernel_bytes"] - barrier - large["tx"] - large["messages"] * per_message) / large["tx"]
    # one refinement of b with a known (the small probe's tx carries a's share too)
    per_message = (small["kernel_bytes"] - barrier - small["tx"] * (1 + per_byte)) / small["messages"]
    return per_byte, per_message


def summarize(per_rank: list[dict]) -> dict:
    """Sum the meter over ranks (the kernel counter is the namespace's: take rank 0's reading)
    and predict each window's kernel bytes from its metered tx and messages."""
    windows = {}
    for name in per_rank[0]:
        windows[name] = {
            "kernel_bytes": per_rank[0][name]["kernel_bytes"],
            "kernel_packets": per_rank[0][name]["kernel_packets"],
            "tx": sum(rank[name]["tx"] for rank in per_rank),
            "messages": sum(rank[name]["messages"] for rank in per_rank),
        }
    per_byte, per_message = fit_overheads(windows)
    barrier = windows["empty"]["kernel_bytes"]
    for window in windows.values():
        window["predicted_bytes"] = barrier + window["tx"] * (1 + per_byte) + window["messages"] * per_message
    return {"world_size": len(per_rank), "overhead_per_byte": per_byte, "overhead_per_message": per_message,
            "windows": windows}


def run_inside(steps: int) -> dict:
    from lowcomm.comm.spawn import spawn_workers

    return summarize(spawn_workers(_probe_worker, WORLD, steps, timeout_s=300))


def format_report(result: dict) -> str:
    lines = [f"W = {result['world_size']} gloo workers, one network namespace; sums over ranks, MB = 1e6 bytes",
             f"{'window':<24} {'metered tx MB':>14} {'messages':>9} {'kernel MB':>10} {'kernel/tx':>10} "
             f"{'predicted MB':>13} {'kernel/pred':>11}"]
    for name, w in result["windows"].items():
        ratio = w["kernel_bytes"] / w["tx"] if w["tx"] else float("nan")
        lines.append(f"{name:<24} {w['tx'] / 1e6:14.4f} {w['messages']:9d} {w['kernel_bytes'] / 1e6:10.4f} "
                     f"{ratio:10.3f} {w['predicted_bytes'] / 1e6:13.4f} {w['kernel_bytes'] / w['predicted_bytes']:11.3f}")
    packets = ", ".join(f"{name}: {w['kernel_packets']}" for name, w in result["windows"].items())
    lines.append(f"kernel packets: {packets}")
    lines.append(f"overhead per byte {100 * result['overhead_per_byte']:.3f}%, per message "
                 f"{result['overhead_per_message']:.0f} bytes (TCP/IP headers, acknowledgements, gloo's framing); "
                 f"'empty' is the closing barrier, in every window's kernel count")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per optimizer window")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    parser.add_argument("--inside", action="store_true",
                        help="run the probes here (already inside a namespace; used by tests/test_wire.py)")
    args = parser.parse_args(argv)
    if args.inside:
        result = run_inside(args.steps)
    else:
        if os.geteuid() != 0:
            print("wire_check: needs root (ip netns add)", file=sys.stderr)
            return 2
        with network_namespace("lowcomm-wire") as name:
            command = ["ip", "netns", "exec", name, sys.executable, str(Path(__file__).resolve()), "--inside",
                       "--steps", str(args.steps), "--json", "/dev/stdout"]
            done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
            result = json.loads(done.stdout)
    if args.json:
        text = json.dumps(result, indent=2)
        if str(args.json) == "/dev/stdout":
            sys.stdout.write(text)
            return 0
        args.json.write_text(text)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
