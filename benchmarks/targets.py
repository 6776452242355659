"""lowcomm's speed targets, measured in one run: each figure now, its target, met or not.

| figure | target |
|---|---|
| CPU, DeMo step / fused AdamW step, 117.4M parameters | <= 4x |
| CPU, DeMo step at 64 simulated senders / at 1 | <= 1.5x |
| GPU, DeMo step / torch AdamW step, 117.4M parameters | <= 2x |
| GPU, DeMo step at 64 simulated senders / at 1, OLMo-300M shapes | <= 1.3x |
| GPU, DeMo's 300M training step / AdamW-DDP's, W=1 | <= 1.03x |
| GPU, AdamW-DDP MFU by 6N, OLMo-300M | >= 40 % |
| GPU, DeMo's 1B training step / AdamW-DDP's, W=1 | <= 1.03x |
| GPU, AdamW-DDP MFU by OLMo-core's formula, OLMo-1B | >= 45 % |
| GPU, every other method's 300M training step / AdamW-DDP's, W=1 | <= 1.10x each |

The optimizer rows come from ``benchmarks/demo_step.py`` (OLMo-300M's block matrices, 7 blocks,
interleaved rounds, medians of per-round ratios); the senders rows from ``benchmarks/senders.py``
(DeMo's step as rank 0 of 64 whose other 63 senders' payloads were recorded, against its step
alone; on the CPU OLMo-300M with ``--senders-blocks`` of its blocks, 1 by default; on a GPU all
16); the training rows from ``benchmarks/throughput.py`` (lowcomm's own loop, one worker, on
random token ids through ``data=memmap``, 16 sequences of 2,048 tokens per step, best of
``--repeats`` windows), with each model's peak memory and, for OLMo-1B, the time one
checkpoint takes to write; the other methods' rows run every registered method in one worker
process, ``train.compile=false`` unless an override says otherwise (a compile per method would
not fit the 8 minutes: their ratio is to AdamW-DDP run the same way).

``--device cpu`` measures the CPU rows; ``--device cuda`` the GPU rows (one GPU), the model
compiled as ``train.compile``'s default does on a GPU. ``--rows`` picks rows by name. Each row
is printed as soon as it is measured, then the table. ``--profile N`` profiles N more steps of
each 300M training row and prints where their time goes (``profiles.py``), the profile a target
not met calls for. ``--smoke`` runs every row's code on tiny shapes (the tiny model, 4 senders,
one block) on the device given: what the tests run on the CPU before a GPU runs the real thing;
its figures are not compared with the targets.

    python benchmarks/targets.py                          # the CPU rows, about 2 minutes
    python benchmarks/targets.py --device cuda --threads 8 --repeats 1
    python benchmarks/targets.py --device cuda --rows senders training_300m --profile 3
    bash benchmarks/gpu_targets.sh OUT                    # every GPU row, in one prepared run
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_step  # noqa: E402  (a sibling script)
import senders  # noqa: E402
import throughput  # noqa: E402

TOKENS_PER_STEP = (16, 2048)  # sequences x tokens
SMOKE_TOKENS_PER_STEP = (4, 64)
ROWS = ("optimizer", "senders", "training_300m", "training_1b", "others")


@dataclass(frozen=True)
class Scale:
    """The shapes the rows run at: the real ones, or ``--smoke``'s tiny ones."""

    model_300m: str
    model_1b: str
    layers: int  # demo_step.py's OLMo-300M blocks
    senders: int  # the simulated senders of the senders row
    tokens_per_step: tuple[int, int]

    @classmethod
    def of(cls, smoke: bool) -> Scale:
        if smoke:
            return cls("tiny", "tiny", 1, 4, SMOKE_TOKENS_PER_STEP)
        return cls("olmo_300m", "olmo_1b", 7, 64, TOKENS_PER_STEP)


def optimizer_ratios(device: str, steps: int, threads: int, bucket_numel: int | None,
                     cuda_graph: bool = False, layers: int = 7) -> dict[str, float]:
    """DeMo's step over torch AdamW's (default and fused), each the median of per-round ratios."""
    demo = "demo_graph" if cuda_graph else "demo"
    names = ["adamw", "adamw_fused", demo]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        timing = pool.apply(demo_step.step_times, (names, layers, False, steps, threads, device, bucket_numel))
    times = timing["times"]
    return {"vs_adamw": demo_step.median_ratio(times, demo, "adamw"),
            "vs_fused": demo_step.median_ratio(times, demo, "adamw_fused"),
            "demo_ms": statistics.median(times[demo]) * 1e3,
            "adamw_ms": statistics.median(times["adamw"]) * 1e3,
            "fused_ms": statistics.median(times["adamw_fused"]) * 1e3,
            "numel": timing["numel"]}


def senders_ratio(device: str, model: str, blocks: int | None, world: int, steps: int) -> dict[str, float]:
    """DeMo's step as rank 0 of ``world`` (the others' payloads recorded) over its step alone."""
    setup = senders.Setup.of("demo", model, blocks, device)
    alone = senders.with_senders(setup, 1, steps=steps)
    many = senders.with_senders(setup, world, steps=steps)
    return {"ratio": many["ms"] / alone["ms"], "alone_ms": alone["ms"], "many_ms": many["ms"],
            "rx_MB": many["rx_MB"], "writes_ms": many["wire_ms"]}


def random_corpus(directory: Path, tokens: int, seed: int, vocabulary: int) -> Path:
    """A raw uint16 token file (OLMo's memmap format: no header) of random ids."""
    path = directory / f"random-{seed}.npy"
    np.random.default_rng(seed).integers(0, vocabulary, size=tokens, dtype=np.uint16).tofile(path)
    return path


def training_runs(model: str, methods: list[str], steps: int, repeats: int, overrides: list[str], *,
                  device: str = "cuda", tokens_per_step: tuple[int, int] = TOKENS_PER_STEP,
                  bucket_numel: int | None = None, cuda_graph: bool = False, profile_steps: int = 0,
                  checkpoint: bool = False, bare_loop: bool = True,
                  method_overrides: dict[str, list[str]] | None = None) -> dict[str, dict]:
    """``model`` on one worker, each of ``methods`` through lowcomm's loop (and the bare DDP +
    AdamW loop beside it unless not ``bare_loop``), in one set of worker processes: tokens/s,
    MFU, peak memory; with ``checkpoint``, one checkpoint's write time after each.
    ``method_overrides``: a method's own settings, after the common ones."""
    from lowcomm.config.compose import compose

    sequences, length = tokens_per_step
    vocabulary = int(compose([f"model={model}"])["model"]["vocab_size"])
    with tempfile.TemporaryDirectory() as root:
        train = random_corpus(Path(root), sequences * length * (2 * steps + 8), 0, vocabulary)
        val = random_corpus(Path(root), 8 * length + 1, 1, vocabulary)
        common = [f"model={model}", "data=memmap", f"data.paths=[{train}]", f"data.val_paths=[{val}]",
                  f"train.global_batch_size={sequences}", f"train.micro_batch_size={sequences}",
                  f"train.seq_len={length}", *overrides]

        def extra(name: str) -> list[str]:
            chosen = list((method_overrides or {}).get(name, []))
            chosen += [f"optimizer.bucket_numel={bucket_numel}"] if name == "demo" and bucket_numel else []
            return chosen + (["optimizer.cuda_graph=true"] if name == "demo" and cuda_graph else [])

        print(f"[targets] {model}, {', '.join(methods)}: {repeats} x {2 if bare_loop else 1} windows of {steps} "
              "steps each", flush=True)
        results = throughput.measure_each(1, steps, repeats, device,
                                          [[f"optimizer={name}", *common, *extra(name)] for name in methods],
                                          profile_steps=profile_steps, bare_loop=bare_loop, checkpoint=checkpoint)
    return dict(zip(methods, results, strict=True))


def _mfu(result: dict) -> str:
    if result.get("mfu_6n") is None:
        return ""
    return f", MFU 6N {result['mfu_6n']:.1%}, OLMo-core {result['mfu_olmo_core']:.1%}"


def main(argv: list[str] | None = None) -> int:
    from lowcomm.strategies import STRATEGIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS),
                        help="which rows (on the CPU only optimizer and senders have any)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer rounds and senders steps (medians), and "
                                                             "3x that many training steps per window")
    parser.add_argument("--repeats", type=int, default=2, help="training windows per loop (best kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the optimizer rows")
    parser.add_argument("--senders-blocks", type=int, default=None,
                        help="OLMo-300M blocks for the senders row (default: 1 on the CPU, all 16 on a GPU)")
    parser.add_argument("--bucket-numel", type=int, default=None, help="DeMo's optimizer.bucket_numel")
    parser.add_argument("--cuda-graph", action="store_true", help="DeMo's optimizer.cuda_graph=true (its step "
                                                                   "replayed as CUDA graphs; on a GPU)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after each 300M training row, profile this many more of its steps and print where "
                             "their time goes (kernels by kind, the device idle, MFU); with --device cuda")
    parser.add_argument("--smoke", action="store_true",
                        help="every row's code on tiny shapes on this device, figures not compared with targets")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the training rows, e.g. train.compile=true")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} is at least 1, got {getattr(args, name)}")
    if args.profile < 0:
        parser.error(f"--profile is 0 (none) or more steps, got {args.profile}")
    if args.profile and args.device != "cuda":
        parser.error("--profile profiles the training rows, which run on a GPU: use it with --device cuda")
    scale = Scale.of(args.smoke)
    gpu = args.device == "cuda"
    device = "GPU" if gpu else "CPU"
    rows: list[tuple[str, str, str, bool | None]] = []  # figure, measured, target, met (None: not compared)
    figures: list[str] = []  # what is measured beside the targets (memory, a checkpoint's write)
    began = time.perf_counter()

    def measured(figure: str, value: str, target: str, met: bool) -> None:
        """A row of the table, printed at once too: a run cut short still says what it measured."""
        print(f"[targets] {figure}: {value} (target {target}) [{time.perf_counter() - began:.0f} s]", flush=True)
        rows.append((figure, value, target, None if args.smoke else met))

    def row(name: str, run: Callable[[], None]) -> None:
        if name in args.rows:
            run()

    def optimizer() -> None:
        ratios = optimizer_ratios(args.device, args.steps, args.threads, args.bucket_numel, gpu and args.cuda_graph,
                                  scale.layers)
        size = f"{ratios['numel'] / 1e6:.1f}M params"
        if gpu:
            measured(f"GPU, DeMo step / torch AdamW step, {size}",
                     f"{ratios['vs_adamw']:.2f}x ({ratios['demo_ms']:.1f} / {ratios['adamw_ms']:.1f} ms; "
                     f"fused AdamW {ratios['fused_ms']:.1f} ms)", "<= 2x", ratios["vs_adamw"] <= 2)
        else:
            measured(f"CPU, DeMo step / fused AdamW step, {size}",
                     f"{ratios['vs_fused']:.2f}x ({ratios['demo_ms']:.1f} / {ratios['fused_ms']:.1f} ms)", "<= 4x",
                     ratios["vs_fused"] <= 4)

    def senders_row() -> None:
        blocks = args.senders_blocks or (None if gpu else 1)
        model = "tiny" if args.smoke else "olmo_300m"
        result = senders_ratio(args.device, model, None if args.smoke else blocks, scale.senders, args.steps)
        shapes = model + ("" if blocks is None or args.smoke else f", {blocks} of its blocks")
        target, bound = ("<= 1.3x", 1.3) if gpu else ("<= 1.5x", 1.5)
        measured(f"{device}, DeMo step at {scale.senders} simulated senders / at 1, {shapes}",
                 f"{result['ratio']:.2f}x ({result['many_ms']:.1f} / {result['alone_ms']:.1f} ms; "
                 f"{result['rx_MB']:.3g} MB received, written in {result['writes_ms']:.3g} ms more)", target,
                 result["ratio"] <= bound)

    def training(model: str, label: str, checkpoint: bool, mfu: str, mfu_target: float) -> None:
        runs = training_runs(model, ["adamw_ddp", "demo"], 3 * args.steps, args.repeats, args.overrides,
                             device=args.device, tokens_per_step=scale.tokens_per_step, bucket_numel=args.bucket_numel,
                             cuda_graph=args.cuda_graph, checkpoint=checkpoint,
                             profile_steps=args.profile if label == "300M" else 0)
        failed = {name: result["error"] for name, result in runs.items() if "error" in result}
        if failed:  # (out of memory, say): the rows say so, and the run goes on to the next rows
            for figure, target in ((f"DeMo's {label} training step / AdamW-DDP's, W=1", "<= 1.03x"),
                                   (f"AdamW-DDP MFU by {mfu}, {label}", f">= {mfu_target:.0%}")):
                measured(f"{device}, {figure}", "did not run: " + "; ".join(
                    f"{name}: {error[:120]}" for name, error in failed.items()), target, False)
            return
        adamw, demo = runs["adamw_ddp"], runs["demo"]
        for name, result in runs.items():
            print(f"[targets] {label} ({model}), {name}: {result['lowcomm']:,.0f} tokens/s (bare DDP + AdamW "
                  f"{result['bare']:,.0f}){_mfu(result)}, peak {result['memory_lowcomm']:,.0f} MB", flush=True)
            if result["profile"] is not None:
                print(f"[targets] {label}, {name}, " + throughput.profile_table(result, 1), flush=True)
            figures.append(f"{label} ({model}), {name}: peak memory {result['memory_lowcomm']:,.0f} MB "
                           f"({'allocated' if gpu else 'resident'}), {result['lowcomm']:,.0f} tokens/s")
            if result["checkpoint"] is not None:
                written = result["checkpoint"]
                figures.append(f"{label} ({model}), {name}: one checkpoint written in {written['seconds']:.2f} s "
                               f"({written['bytes'] / 1e9:.2f} GB by rank 0)")
        slower = adamw["lowcomm"] / demo["lowcomm"]  # tokens/s, so the step-time ratio
        measured(f"{device}, DeMo's {label} training step / AdamW-DDP's, W=1",
                 f"{slower:.3f}x ({demo['lowcomm']:,.0f} / {adamw['lowcomm']:,.0f} tokens/s)", "<= 1.03x",
                 slower <= 1.03)
        share = adamw["mfu_6n" if mfu == "6N" else "mfu_olmo_core"]
        if share is None:  # no peak FLOP/s on the CPU: no MFU
            measured(f"{device}, AdamW-DDP MFU by {mfu}, {label}", "no peak FLOP/s on the CPU",
                     f">= {mfu_target:.0%}", False)
        else:
            measured(f"{device}, AdamW-DDP MFU by {mfu}, {label}", f"{share:.1%} (6N {adamw['mfu_6n']:.1%}, "
                     f"OLMo-core's formula {adamw['mfu_olmo_core']:.1%})", f">= {mfu_target:.0%}",
                     share >= mfu_target)

    def others() -> None:
        # each method at its first comm-table row's settings (the paper's, as the comm table prints them)
        settings = {name: next(r for r in STRATEGIES[name].comm_table if not r.warmup)
                    for name in sorted(STRATEGIES) if name not in ("adamw_ddp", "demo")}
        overrides = args.overrides if any(o.startswith("train.compile") for o in args.overrides) else [
            *args.overrides, "train.compile=false"]
        runs = training_runs(scale.model_300m, ["adamw_ddp", *settings], 3 * args.steps, args.repeats, overrides,
                             device=args.device, tokens_per_step=scale.tokens_per_step, bare_loop=False,
                             method_overrides={name: list(r.overrides) for name, r in settings.items()})
        if "error" in runs["adamw_ddp"]:
            measured(f"{device}, every other method's 300M training step / AdamW-DDP's, W=1",
                     f"AdamW-DDP did not run: {runs['adamw_ddp']['error'][:160]}", "<= 1.10x each", False)
            return
        baseline = runs["adamw_ddp"]["lowcomm"]
        for name, setting in settings.items():
            result, figure = runs[name], f"{device}, {setting.label}: 300M training step / AdamW-DDP's, W=1"
            if "error" in result:
                measured(figure, f"cannot run at W=1: {result['error'][:160]}", "<= 1.10x", False)
                continue
            slower = baseline / result["lowcomm"]
            measured(figure, f"{slower:.3f}x ({result['lowcomm']:,.0f} / {baseline:,.0f} tokens/s)", "<= 1.10x",
                     slower <= 1.10)

    row("optimizer", optimizer)
    row("senders", senders_row)
    if gpu or args.smoke:
        row("training_300m", lambda: training(scale.model_300m, "300M", False, "6N", 0.40))
        row("training_1b", lambda: training(scale.model_1b, "1B", True, "OLMo-core's formula", 0.45))
        row("others", others)
    elif any(name in args.rows for name in ("training_300m", "training_1b", "others")):
        print("[targets] the training rows run on a GPU: --device cuda (or --smoke, on tiny shapes)", flush=True)

    what = "smoke run on tiny shapes: figures not compared with their targets" if args.smoke else "measured now"
    print(f"\nlowcomm's speed targets, {what} ({args.device}"
          + (f", {args.threads} threads" if not gpu else "") + f", {time.perf_counter() - began:.0f} s)\n")
    print("| figure | measured | target | met |\n|---|---:|---:|---|")
    for figure, value, target, met in rows:
        print(f"| {figure} | {value} | {target} | {'-' if met is None else ('yes' if met else 'no')} |")
    if figures:
        print("\nBeside the targets:\n" + "\n".join(f"- {line}" for line in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
