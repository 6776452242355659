"""The GPU-speed issue's four targets, measured in one run: each figure now, its target, met or not.

| figure | target |
|---|---|
| CPU, DeMo step / fused AdamW step, 117.4M parameters | <= 4x |
| GPU, DeMo step / torch AdamW step, 117.4M parameters | <= 2x |
| GPU, DeMo's OLMo-300M training step / AdamW-DDP's, W=1 | <= 1.05x |
| GPU, AdamW-DDP OLMo-300M MFU (6 x parameters) | >= 40 % |

The optimizer rows come from ``benchmarks/demo_step.py`` (OLMo-300M's block matrices, 7 blocks,
interleaved rounds, medians of per-round ratios), the training rows from
``benchmarks/throughput.py`` (lowcomm's own loop, one worker, OLMo-300M on random token ids
through ``data=memmap``, 16 sequences of 2,048 tokens per step, best of ``--repeats`` windows).
With ``--device cpu`` only the CPU row is measured; with ``--device cuda`` the three GPU rows
(one GPU), the model compiled as ``train.compile``'s default (``auto``) does on a GPU (over
320 s on an H200, about a minute of it compiling each 300M run; 187 s eager,
``train.compile=false``). DeMo's bucket is its GPU default (200M elements: one bucket for the
optimizer rows' 117.4M parameters) unless ``--bucket-numel``; ``--cuda-graph`` replays its step
as CUDA graphs, in both kinds of row; ``--profile N`` profiles N more steps of each training row
and prints where their time goes (``profiles.py``: kernels by kind, the GPU's idle, the MFU of the
window), the profile a target not met calls for. Each row is printed as soon as it is measured,
then the table.

    python benchmarks/targets.py                     # CPU row, about 15 s
    python benchmarks/targets.py --device cuda --threads 8 --repeats 1
    python benchmarks/targets.py --device cuda --threads 8 --repeats 1 --profile 3   # and where the time goes
    python benchmarks/targets.py --device cuda --threads 8 --cuda-graph train.compile=false
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_step  # noqa: E402  (a sibling script)
import throughput  # noqa: E402

VOCABULARY = 50280  # OLMo-300M's tokenizer (the ids are random: speed does not depend on them)
TOKENS_PER_STEP = (16, 2048)  # sequences x tokens


def optimizer_ratios(device: str, steps: int, threads: int, bucket_numel: int | None,
                     cuda_graph: bool = False) -> dict[str, float]:
    """DeMo's step over torch AdamW's (default and fused), each the median of per-round ratios."""
    demo = "demo_graph" if cuda_graph else "demo"
    names = ["adamw", "adamw_fused", demo]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        timing = pool.apply(demo_step.step_times, (names, 7, False, steps, threads, device, bucket_numel))
    times = timing["times"]
    return {"vs_adamw": demo_step.median_ratio(times, demo, "adamw"),
            "vs_fused": demo_step.median_ratio(times, demo, "adamw_fused"),
            "demo_ms": statistics.median(times[demo]) * 1e3,
            "adamw_ms": statistics.median(times["adamw"]) * 1e3,
            "fused_ms": statistics.median(times["adamw_fused"]) * 1e3}


def random_corpus(directory: Path, tokens: int, seed: int) -> Path:
    """A raw uint16 token file (OLMo's memmap format: no header) of random ids."""
    path = directory / f"random-{seed}.npy"
    np.random.default_rng(seed).integers(0, VOCABULARY, size=tokens, dtype=np.uint16).tofile(path)
    return path


def training_runs(steps: int, repeats: int, bucket_numel: int | None, overrides: list[str],
                  device: str = "cuda", cuda_graph: bool = False, profile_steps: int = 0) -> dict[str, dict]:
    """OLMo-300M, one worker (one GPU): lowcomm's AdamW-DDP and DeMo, tokens/s and MFU; with
    ``profile_steps``, where the time of that many more of each one's steps goes, printed after
    its row."""
    sequences, length = TOKENS_PER_STEP
    results = {}
    with tempfile.TemporaryDirectory() as root:
        train = random_corpus(Path(root), sequences * length * (2 * steps + 8), 0)
        val = random_corpus(Path(root), 8 * length + 1, 1)
        common = ["model=olmo_300m", "data=memmap", f"data.paths=[{train}]", f"data.val_paths=[{val}]",
                  f"train.global_batch_size={sequences}", f"train.micro_batch_size={sequences}",
                  f"train.seq_len={length}", *overrides]
        for name in ("adamw_ddp", "demo"):
            extra = [f"optimizer.bucket_numel={bucket_numel}"] if name == "demo" and bucket_numel else []
            extra += ["optimizer.cuda_graph=true"] if name == "demo" and cuda_graph else []
            print(f"[targets] OLMo-300M, {name}: {repeats} x 2 windows of {steps} steps", flush=True)
            result = results[name] = throughput.measure(1, steps, repeats, device,
                                                        [f"optimizer={name}", *common, *extra],
                                                        profile_steps=profile_steps)
            mfu = "" if result["mfu_6n"] is None else (
                f", MFU 6N {result['mfu_6n']:.1%}, OLMo-core {result['mfu_olmo_core']:.1%}")
            print(f"[targets] OLMo-300M, {name}: {result['lowcomm']:,.0f} tokens/s (bare DDP + AdamW "
                  f"{result['bare']:,.0f}){mfu}", flush=True)
            if result["profile"] is not None:
                print(f"[targets] OLMo-300M, {name}, " + throughput.profile_table(result, 1), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="optimizer rounds (medians), and 3x that many "
                                                             "training steps per window")
    parser.add_argument("--repeats", type=int, default=2, help="training windows per loop (best kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the optimizer rows")
    parser.add_argument("--bucket-numel", type=int, default=None, help="DeMo's optimizer.bucket_numel")
    parser.add_argument("--cuda-graph", action="store_true", help="DeMo's optimizer.cuda_graph=true (its step "
                                                                   "replayed as CUDA graphs; on a GPU)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after each training row, profile this many more of its steps and print where "
                             "their time goes (kernels by kind, the device idle, MFU); with --device cuda")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the training rows, e.g. train.compile=true")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} is at least 1, got {getattr(args, name)}")
    if args.profile < 0:
        parser.error(f"--profile is 0 (none) or more steps, got {args.profile}")
    if args.profile and args.device != "cuda":
        parser.error("--profile profiles the training rows, which run on a GPU: use it with --device cuda")

    rows: list[tuple[str, str, str, bool | None]] = []  # figure, measured, target, met (None: not measured)

    def measured(figure: str, value: str, target: str, met: bool) -> None:
        """A row of the table, printed at once too: a run cut short still says what it measured."""
        print(f"[targets] {figure}: {value} (target {target})", flush=True)
        rows.append((figure, value, target, met))

    if args.device == "cpu":
        ratios = optimizer_ratios("cpu", args.steps, args.threads, args.bucket_numel)
        measured("CPU, DeMo step / fused AdamW step, 117.4M params",
                 f"{ratios['vs_fused']:.2f}x ({ratios['demo_ms']:.1f} / {ratios['fused_ms']:.1f} ms)", "<= 4x",
                 ratios["vs_fused"] <= 4)
    else:
        ratios = optimizer_ratios("cuda", args.steps, args.threads, args.bucket_numel, args.cuda_graph)
        measured("GPU, DeMo step / torch AdamW step, 117.4M params",
                 f"{ratios['vs_adamw']:.2f}x ({ratios['demo_ms']:.1f} / {ratios['adamw_ms']:.1f} ms; "
                 f"fused AdamW {ratios['fused_ms']:.1f} ms)", "<= 2x", ratios["vs_adamw"] <= 2)
        steps = training_runs(3 * args.steps, args.repeats, args.bucket_numel, args.overrides,
                              cuda_graph=args.cuda_graph, profile_steps=args.profile)
        adamw, demo = steps["adamw_ddp"], steps["demo"]
        slower = adamw["lowcomm"] / demo["lowcomm"]  # tokens/s, so the step-time ratio
        measured("GPU, DeMo's 300M training step / AdamW-DDP's, W=1",
                 f"{slower:.3f}x ({demo['lowcomm']:,.0f} / {adamw['lowcomm']:,.0f} tokens/s)", "<= 1.05x",
                 slower <= 1.05)
        measured("GPU, AdamW-DDP 300M MFU (6N)",
                 f"{adamw['mfu_6n']:.1%} (OLMo-core's formula {adamw['mfu_olmo_core']:.1%})", ">= 40 %",
                 adamw["mfu_6n"] >= 0.40)
        rows.append(("(CPU row)", "run with --device cpu", "<= 4x", None))
    if args.device == "cpu":
        rows += [(figure, "needs --device cuda", target, None) for figure, target in (
            ("GPU, DeMo step / torch AdamW step, 117.4M params", "<= 2x"),
            ("GPU, DeMo's 300M training step / AdamW-DDP's, W=1", "<= 1.05x"),
            ("GPU, AdamW-DDP 300M MFU (6N)", ">= 40 %"))]
    print(f"\nThe GPU-speed targets, measured now ({args.device}"
          + (f", {args.threads} threads" if args.device == "cpu" else "") + ")\n")
    print("| figure | measured | target | met |\n|---|---:|---:|---|")
    for figure, value, target, met in rows:
        print(f"| {figure} | {value} | {target} | {'-' if met is None else ('yes' if met else 'no')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
