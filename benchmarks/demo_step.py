"""Time and peak memory of one DeMo step against one torch AdamW step on the same parameters.

The parameters are OLMo-300M's block matrices (d_model 1024: att_proj 3072x1024, attn_out
1024x1024, ff_proj 8192x1024, ff_out 1024x4096), ``--layers`` blocks of them (7 by default:
117.4M parameters, all of them block matrices). The embedding (50304x1024, 51.5M) is left out
unless ``--embedding``. Gradients are random and fixed; DeMo runs with W=1 (compute only: its
all-gather is a local copy).

Step times come from one process where every optimizer steps the same parameters in turn,
``--steps`` rounds after one warm-up step each: a change in machine load hits all of them
alike, and each ratio column is the median of the per-round ratios to AdamW (the default
for-loop one, and fused). In the same rounds, the two block DCTs of a step (forward of each
gradient, inverse of a dense result) are timed alone as matrix products (``block_transform``:
four per parameter, what a DeMo step costs on a device without lowcomm's kernels) and as
``dct_transform`` (on the CPU, lowcomm's DCT kernel). DeMo's phases come from one extra step
under torch.profiler (``record_function`` ranges in ``DeMo.step``; the profiler adds a little
overhead). On the CPU kernels, ``transform`` includes the top-k (each tile is selected while it
is in cache from its transform) and ``decode`` the update (the aggregate is gathered per tile and
its inverse written straight into the parameters), so ``topk`` is the payload's packing and
the subtraction of what was sent, and ``update`` is empty. Peak memory comes from a fresh process per optimizer: the peak
resident set of two steps above the parameters and gradients, state included (Linux VmHWM,
reset through /proc/self/clear_refs; on CUDA, torch's peak allocation).

With ``--decode-workers W ...`` it also times DeMo's aggregation of W workers' payloads for
all the parameters in one bucket (``DCTTopK.aggregate_gathered``, what every worker runs on
the all-gathered buffer; W=1 needs none of its mean over senders), on synthetic payloads: k
distinct block-local indices per block and worker, random values, paper wire.

    python benchmarks/demo_step.py            # CPU, 2 threads, about a minute
    python benchmarks/demo_step.py --decode-workers 2 64
    python benchmarks/demo_step.py --device cuda --threads 8

Tokens/s, MFU and peak memory of the whole training loop (tiny or 300M model, CPU or CUDA) are
benchmarks/throughput.py's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from pathlib import Path

D_MODEL = 1024
BLOCK_SHAPES = {
    "att_proj": (3 * D_MODEL, D_MODEL),
    "attn_out": (D_MODEL, D_MODEL),
    "ff_proj": (8 * D_MODEL, D_MODEL),
    "ff_out": (D_MODEL, 4 * D_MODEL),
}
EMBEDDING_SHAPE = (50304, D_MODEL)
PHASES = ("transform", "topk", "communicate", "decode", "update")

OPTIMIZERS = {
    "adamw": "AdamW (default: for-loop)",
    "adamw_foreach": "AdamW (foreach=True)",
    "adamw_fused": "AdamW (fused=True)",
    "demo": "DeMo (dct, sign, paper wire)",
    "demo_param_domain": "DeMo, parameter-domain momentum",
    "demo_graph": "DeMo, captured as CUDA graphs",
}
DEFAULT_OPTIMIZERS = ["adamw", "adamw_fused", "demo", "demo_param_domain"]
# the two block DCTs of a step alone, timed beside the optimizers: as matrix products, as dct_transform
FLOORS = {"dense_dct": "block DCT as matrix products (fwd + inv)", "kernel_dct": "block DCT, dct_transform (fwd + inv)"}


def shapes(layers: int, embedding: bool) -> list[tuple[int, int]]:
    return ([EMBEDDING_SHAPE] if embedding else []) + [
        s for _ in range(layers) for s in BLOCK_SHAPES.values()
    ]


def _setup(layers: int, embedding: bool, threads: int, device: str):
    import torch

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes(layers, embedding):
        param = torch.nn.Parameter(torch.randn(shape, generator=generator).to(device))
        param.grad = torch.randn(shape, generator=generator).to(device) * 1e-2
        params.append(param)
    return params


def _optimizer(name: str, params, bucket_numel: int | None = None):
    import torch

    from lowcomm.optim import DeMo, DeMoArgs

    if name.startswith("adamw"):
        flags = {"adamw_foreach": {"foreach": True}, "adamw_fused": {"fused": True}}.get(name, {})
        return torch.optim.AdamW(params, lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), **flags)
    # the paper's settings (configs/optimizer/demo.yaml)
    # (cuda_graph: on the CPU the same step as "demo")
    optimizer = DeMo(params, DeMoArgs.defaults(bucket_numel=bucket_numel, cuda_graph=name == "demo_graph"))
    # internal switch, kept for tests and this comparison: three dense transforms per step
    optimizer._momentum_in_coefficients = name != "demo_param_domain"
    return optimizer


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_memory(name: str, layers: int, embedding: bool, threads: int, device: str,
                bucket_numel: int | None = None) -> float:
    """In a fresh process: the peak memory (MB) of four steps of ``name`` above the parameters
    and gradients, optimizer state included (DeMo captured as CUDA graphs: two warm-up steps,
    the capture and a replay)."""
    import torch

    params = _setup(layers, embedding, threads, device)
    optimizer = _optimizer(name, params, bucket_numel)
    _sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        base = _status_kb("VmRSS") * 1024
    for _ in range(4):
        optimizer.step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else _status_kb("VmHWM") * 1024
    return (peak - base) / 1e6


def _transforms(params, kernel: bool):
    """A step-like callable: the forward block DCT of every gradient and the inverse of the
    result (DeMo's chunk 64), into work space allocated once, as matrix products
    (``block_transform``) or as ``dct_transform`` (``kernel``: the CPU kernel where it runs)."""
    import torch

    from lowcomm.compress.dct import block_transform, dct_transform
    from lowcomm.compress.dct_topk import DCTTopK

    codec = DCTTopK(chunk=64)
    largest = max(param.numel() for param in params)
    out, scratch, back = (torch.empty(largest, device=params[0].device) for _ in range(3))

    def step() -> None:
        for param in params:
            layout = codec.layout(param.shape)
            size = param.numel()
            if kernel:
                dct_transform(param.grad, layout, out=out[:size], scratch=scratch[:size])
                dct_transform(out[:size], layout, inverse=True, out=back[:size], scratch=scratch[:size])
                continue
            bases = codec.bases(layout, param.device, param.dtype)
            block_transform(param.grad, layout, *bases, out=out[:size], scratch=scratch[:size])
            block_transform(out[:size], layout, *bases, inverse=True, out=back[:size], scratch=scratch[:size])

    return step


def step_times(names: list[str], layers: int, embedding: bool, steps: int, threads: int, device: str,
               bucket_numel: int | None = None) -> dict:
    """In one process, on shared parameters and gradients: one warm-up step each, then
    ``steps`` rounds that time one step of every optimizer in turn, and the dense transforms
    alone (so a change in machine load hits all of them alike); then one profiled DeMo step
    for the phase split."""
    import torch

    params = _setup(layers, embedding, threads, device)
    steppers = {name: _optimizer(name, params, bucket_numel).step for name in names}
    steppers["dense_dct"] = _transforms(params, kernel=False)
    steppers["kernel_dct"] = _transforms(params, kernel=True)
    for step in steppers.values():
        for _ in range(3):  # DeMo captured as CUDA graphs: two eager steps, then the capture
            step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(steps):
        for name, step in steppers.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    optimizers = {name: step.__self__ for name, step in steppers.items() if name not in FLOORS}
    phases, calls = {}, {}
    for name in names:
        if name.startswith("demo"):
            # the phases are host-side ranges: on CUDA, run with --device cuda to get the step
            # times right (synchronised); a phase's kernels may finish in a later range
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                optimizers[name].step()
                _sync(device)
            totals = {event.key: event.cpu_time_total / 1e3 for event in profile.key_averages()}
            phases[name] = {phase: totals.get(f"DeMo.{phase}", 0.0) for phase in PHASES}
            calls[name] = operator_calls(profile)
    return {"times": times, "phases": phases, "calls": calls, "numel": sum(p.numel() for p in params)}


def operator_calls(profile) -> dict[str, int]:
    """Operators called from Python in one profiled step (not those they call in turn): all of
    them, and those that run a kernel (views, slices and reshapes only make tensor metadata).
    Each is a round trip through the dispatcher; on CUDA each kernel is a launch."""
    metadata = {"aten::view", "aten::slice", "aten::reshape", "aten::unsqueeze", "aten::expand", "aten::transpose",
                "aten::numpy_T", "aten::split_with_sizes", "aten::select", "aten::split", "aten::as_strided",
                "aten::t", "aten::permute", "aten::_reshape_alias", "aten::alias", "aten::detach", "aten::lift_fresh"}
    top = [event.name for event in profile.events() if event.name.startswith("aten::")
           and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))]
    return {"all": len(top), "kernels": sum(name not in metadata for name in top)}


def median_ratio(times: dict[str, list[float]], name: str, reference: str) -> float:
    """The median over rounds of the per-round ratio of ``name``'s step to ``reference``'s."""
    return statistics.median(t / r for t, r in zip(times[name], times[reference], strict=True))


def _ratio(times: dict[str, list[float]], name: str, reference: str) -> str:
    return f"{median_ratio(times, name, reference):.2f}" if reference in times else "-"


def decode_times(workers: list[int], layers: int, embedding: bool, steps: int, threads: int, device: str) -> dict:
    """Median seconds of one aggregation of ``W`` workers' synthetic payloads for every
    parameter (one bucket), per W."""
    import torch

    from lowcomm.compress.base import Payload
    from lowcomm.compress.dct_topk import DCTTopK

    torch.set_num_threads(threads)
    codec = DCTTopK(chunk=64, topk=32)
    layouts = [codec.layout(shape) for shape in shapes(layers, embedding)]
    offsets = [sum(layout.numel for layout in layouts[:i]) for i in range(len(layouts))]
    total = sum(layout.numel for layout in layouts)
    out, counts = (torch.empty(total, device=device) for _ in range(2))
    generator = torch.Generator().manual_seed(0)
    medians = {}
    for world in workers:
        payloads = []
        for layout in layouts:
            # one index per residue class mod k: k distinct indices per block and worker
            size = (world, layout.num_blocks, codec.topk)
            stride = layout.block_numel // codec.topk
            index = torch.randint(0, stride, size, generator=generator) * codec.topk + torch.arange(codec.topk)
            values = torch.randn(size, generator=generator)
            payloads.append(Payload({"index": index.to(device), "values": values.to(device)}, {"dtype": values.dtype}))
        seconds = []
        for _ in range(steps + 1):  # the first is a warm-up
            _sync(device)
            start = time.perf_counter()
            codec.aggregate_gathered(payloads, layouts, offsets, out=out, counts=counts)
            _sync(device)
            seconds.append(time.perf_counter() - start)
        medians[world] = statistics.median(seconds[1:])
        del payloads
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=7, help="OLMo-300M blocks (7: 117.4M parameters)")
    parser.add_argument("--embedding", action="store_true", help="add the 50304x1024 embedding")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (medians reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--optimizers", nargs="+", default=DEFAULT_OPTIMIZERS, choices=list(OPTIMIZERS))
    parser.add_argument("--bucket-numel", type=int, default=None,
                        help="DeMo's optimizer.bucket_numel (default: the largest parameter's size); parameters of "
                             "one block geometry in one bucket are transformed, selected and decoded as one stack")
    parser.add_argument("--decode-workers", nargs="*", type=int, default=[], metavar="W",
                        help="also time the aggregation of W workers' payloads (synthetic), per W")
    args = parser.parse_args()
    geometry = (args.layers, args.embedding)

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        timing = pool.apply(step_times, (args.optimizers, *geometry, args.steps, args.threads, args.device,
                                          args.bucket_numel))
        decode = {}
        if args.decode_workers:
            decode = pool.apply(decode_times, (args.decode_workers, *geometry, args.steps, args.threads, args.device))
    memory = {}
    for name in args.optimizers:
        with context.Pool(1) as pool:
            memory[name] = pool.apply(peak_memory, (name, *geometry, args.threads, args.device, args.bucket_numel))

    times = timing["times"]
    what = "with" if args.embedding else "without"
    print(
        f"\nOne optimizer step on {timing['numel'] / 1e6:.1f}M fp32 parameters: {args.layers} OLMo-300M blocks "
        f"{what} the embedding; {args.device}, {args.threads} threads; medians of {args.steps} interleaved "
        "rounds. DeMo: W=1 (compute only), chunk 64, top-32, bucket_numel "
        f"{args.bucket_numel or 'the largest parameter'}.\n"
    )
    header = f"{'optimizer':<38} {'step ms':>9} {'x AdamW':>8} {'x fused':>8} {'peak extra MB':>14}"
    print(header)
    print("-" * len(header))
    labels = {**OPTIMIZERS, **FLOORS}
    for name in [*args.optimizers, *FLOORS]:
        ratios = [_ratio(times, name, reference) for reference in ("adamw", "adamw_fused")]
        step_ms = statistics.median(times[name]) * 1e3
        peak = f"{memory[name]:.0f}" if name in memory else "-"
        print(f"{labels[name]:<38} {step_ms:>9.1f} {ratios[0]:>8} {ratios[1]:>8} {peak:>14}")
    for name, phases in timing["phases"].items():
        total = sum(phases.values())
        where = " (host-side ranges: CUDA kernels run asynchronously)" if args.device.startswith("cuda") else ""
        print(f"\n{OPTIMIZERS[name]}: phases of one profiled step{where}")
        for phase, ms in phases.items():
            print(f"  {phase:<12} {ms:>8.1f} ms  {ms / total:6.1%}")
        print(f"  {'total':<12} {total:>8.1f} ms")
        calls = timing["calls"][name]
        print(f"  operators called from Python: {calls['all']:,}, of them running a kernel: {calls['kernels']:,}")
    if decode:
        print("\nDeMo's aggregation of W workers' payloads (all parameters, one bucket; synthetic, paper wire)")
        for world, seconds in decode.items():
            print(f"  W={world:<4} {seconds * 1e3:>9.1f} ms")


if __name__ == "__main__":
    main()
