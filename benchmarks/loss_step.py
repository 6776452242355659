"""The next-token loss's forward and backward, eager against compiled: what ``train.compile``
saves in the loss alone, measured in one run.

    python benchmarks/loss_step.py                       # CPU: 8 x 512 positions, OLMo's 50,304 logits
    python benchmarks/loss_step.py --device cuda         # one micro-batch of the 300M rows: 16 x 2,048

Eagerly the loss writes a float32 copy of the logits and passes over it in its softmax, forward
and backward; compiled (``lowcomm.train.loop.compiled_cross_entropy``, what the Trainer takes
when it compiles the model) the cast is fused into the reductions. For float32 logits and bf16
ones (autocast's on a GPU), the eager and the compiled loss are timed in alternation, ``--repeats``
times each after a warm-up (the compile), and their medians compared; the two losses' values are
printed beside them (the same expression: equal up to the order of a sum).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from lowcomm.train.loop import DeviceClock, compiled_cross_entropy, cross_entropy


def _forward_backward(loss, logits: torch.Tensor, targets: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Seconds for one forward and backward of ``loss`` (on a GPU until its kernels are done),
    and the loss's value."""
    clock = DeviceClock(device)
    logits.grad = None
    started = clock()
    value = loss(logits, targets)
    value.backward()
    return clock() - started, float(value.detach())


def measure(batch: int, positions: int, vocabulary: int, repeats: int, device: torch.device,
            dtype: torch.dtype) -> dict[str, float]:
    """Median seconds of the eager and the compiled loss (``eager_s``, ``compiled_s``), and each
    one's value."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, positions, vocabulary, generator=generator).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocabulary, (batch, positions), generator=generator).to(device)
    losses = {"eager": cross_entropy, "compiled": compiled_cross_entropy()}
    values = {name: _forward_backward(loss, logits, targets, device)[1] for name, loss in losses.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in losses}
    for _ in range(repeats):
        for name, loss in losses.items():
            times[name].append(_forward_backward(loss, logits, targets, device)[0])
    return {**{f"{name}_s": statistics.median(seconds) for name, seconds in times.items()},
            **{f"{name}_loss": value for name, value in values.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=None, help="sequences (default: 8 on cpu, 16 on cuda)")
    parser.add_argument("--positions", type=int, default=None, help="per sequence (default: 512 on cpu, 2,048 on cuda)")
    parser.add_argument("--vocabulary", type=int, default=50304, help="logits per position (default OLMo's 50,304)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward-backwards of each loss (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    for name in ("batch", "positions", "vocabulary", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} is at least 1, got {getattr(args, name)}")
    cuda = args.device == "cuda"
    batch, positions = args.batch or (16 if cuda else 8), args.positions or (2048 if cuda else 512)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(0) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"next-token loss, forward + backward, {batch} x {positions} positions x {args.vocabulary:,} logits, "
          f"{name}; medians of {args.repeats}, eager and compiled in alternation after a warm-up\n")
    print("| logits | eager | compiled | speed-up | loss eager | loss compiled |\n|---|---:|---:|---:|---:|---:|")
    for label, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        result = measure(batch, positions, args.vocabulary, args.repeats, device, dtype)
        print(f"| {label} | {result['eager_s'] * 1e3:,.2f} ms | {result['compiled_s'] * 1e3:,.2f} ms | "
              f"{result['eager_s'] / result['compiled_s']:.2f}x | {result['eager_loss']:.6f} | "
              f"{result['compiled_loss']:.6f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
