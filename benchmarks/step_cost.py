"""Every registered optimizer's step on OLMo-300M's shapes: its time against AdamW-DDP's, and
where the time goes.

One worker (W=1: a real process group of one, so every collective is a local copy and what is
timed is the optimizer's own compute), OLMo-300M's parameters (d_model 1024, its embedding
50304 x 1024 and ``--blocks`` of its 16 transformer blocks: the shapes the paper's runs step,
fewer of them so that a CPU finishes), gradients random and fixed. Each method runs its
registry's ``cycle`` (the overrides and steps that cover its whole synchronisation cycle, as the
byte contract tests it: DiLoCo H=2, Streaming DiLoCo's fragments, PowerSGD past its warm-up ...)
``--rounds`` times after one warm-up cycle, so a method that syncs every H steps pays its outer
step in what is timed, once per H steps, as in training.

The table gives, per method: the mean time per step over its cycles, its slowest step (the
synchronisation, for the outer-loop methods), the mean's ratio to AdamW-DDP's, and the phases of
one extra cycle under torch.profiler as shares of its wall time, split as ``profiles.py`` splits
a window: on the CPU each operator's own (``self``) time by kind, and the time outside operators;
on a GPU each kernel's time by kind, and the GPU's idle. The kinds: matmul, attention, fused
(compiled), DCT kernels (lowcomm's kernels of DeMo's block DCT: its encode with the top-k, its
decode with the update), top-k/sort, scatter/gather, communication, copy/cast, elementwise (the
rest); a column for each kind some method spent time in.

    python benchmarks/step_cost.py                        # CPU, 1 of 300M's 16 blocks, every method
    python benchmarks/step_cost.py --blocks 8 --methods adamw_ddp demo muon_ddp
    python benchmarks/step_cost.py --device cuda --blocks 8

A method the registry cannot build at W=1 (FlexDeMo shards inside a node and replicates across
nodes: it needs ranks of both) is listed with the reason. DeMo's own phases, finer (transform,
top-k, decode), and its block-DCT floors are benchmarks/demo_step.py's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiles import KIND_ORDER, profile_window  # noqa: E402  (a sibling script)


def _setup(name: str, blocks: int, device: torch.device):
    """The strategy ``name`` with its cycle's overrides, built over OLMo-300M with ``blocks``
    blocks on ``device``; the cycle's steps; fixed random gradients."""
    from omegaconf import OmegaConf

    from lowcomm.comm import Communicator
    from lowcomm.config import validate_optimizer
    from lowcomm.config.compose import compose
    from lowcomm.models import ModelSpec, build_model
    from lowcomm.strategies import STRATEGIES

    cycle = STRATEGIES[name].cycle
    raw = OmegaConf.to_container(compose([f"optimizer={name}", "model=olmo_300m", f"model.n_layers={blocks}",
                                          *cycle.overrides]), resolve=True)
    strategy_class, optimizer_cfg = validate_optimizer(raw)
    model = build_model(ModelSpec(**raw["model"]), device, seed=0)
    strategy = strategy_class(optimizer_cfg, raw.get("compression") or {}, Communicator.world(device))
    sync = None
    if strategy.learners:  # a learner of a synchronizer served by a thread here (one learner: W=1)
        from lowcomm.strategies.learners import LocalSynchronizer

        sync = LocalSynchronizer(strategy_class, optimizer_cfg, model, learners=1).__enter__()
        strategy.connect(sync.address, 0, tokens_per_step=1)
    wrapped, optimizer = strategy.build(model)
    generator = torch.Generator(device="cpu").manual_seed(0)
    grads = [torch.randn(p.shape, generator=generator).mul_(1e-3).to(device) for p in wrapped.parameters()]
    return wrapped, optimizer, grads, cycle.steps, sync


class _WholeBucket:
    """Every gradient of a DDP model as one bucket, in the shape DDP hands its comm hook
    (the methods of ``torch.distributed.GradBucket`` that lowcomm's hooks call): one flat buffer
    whose views are the gradients, as DDP's ``gradient_as_bucket_view``. One bucket whatever the
    config's ``optimizer.bucket_cap_mb``: the hook's cost with every matrix in one call, which for
    PowerSGD is its most batched case (at 25 MiB a 300M run's buckets batch nothing)."""

    def __init__(self, params: list[torch.nn.Parameter], buffer: torch.Tensor):
        self._params, self._buffer = params, buffer
        self._gradients = [param.grad for param in params]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _bucket(model, grads) -> torch.Tensor | None:
    """For a DDP model, the one bucket buffer its gradients will be views of (allocated once,
    as DDP's are); None for the other strategies."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    return torch.empty(sum(grad.numel() for grad in grads), dtype=grads[0].dtype, device=grads[0].device)


def _step(model, optimizer, grads, bucket: torch.Tensor | None) -> None:
    """One step from the fixed gradients. A DDP model's backward would also have run its comm
    hook (the metered all-reduce, PowerSGD's low-rank average ...): here it runs over all the
    gradients as one ``bucket`` (from :func:`_bucket`), whose views they are, and its result
    lands in the bucket as DDP puts it there. Other strategies exchange inside
    ``optimizer.step()``."""
    params = list(model.parameters())
    if bucket is not None:
        pieces = bucket.split([param.numel() for param in params])
        torch._foreach_copy_(list(pieces), [grad.reshape(-1) for grad in grads])
        for param, piece in zip(params, pieces, strict=True):
            param.grad = piece.view_as(param)
        for hook, state in model._comm_hooks:  # noqa: SLF001 - DDP keeps (hook, state) only here
            averaged = hook(state, _WholeBucket(params, bucket)).wait()
            if averaged.data_ptr() != bucket.data_ptr():
                bucket.copy_(averaged)
    else:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _cycle(model, optimizer, grads, bucket: torch.Tensor | None, steps: int) -> None:
    """One synchronisation cycle: ``steps`` steps."""
    for _ in range(steps):
        _step(model, optimizer, grads, bucket)


def _worker(rank: int, world: int, names: list[str], blocks: int, rounds: int, device_type: str) -> dict:  # noqa: ARG001
    from lowcomm.train.loop import DeviceClock

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    clock = DeviceClock(device)  # on a GPU, a step's time is until its kernels are done
    results = {}
    began = time.perf_counter()
    for number, name in enumerate(names, 1):
        try:
            model, optimizer, grads, steps, sync = _setup(name, blocks, device)
        except Exception as exc:  # noqa: BLE001 - a method that cannot run at W=1 is reported, not fatal
            results[name] = {"error": " ".join(str(exc).split())[:300]}
            print(f"[step_cost] {number}/{len(names)} {name}: cannot run at W=1: {results[name]['error'][:120]}",
                  flush=True)
            continue
        bucket = _bucket(model, grads)
        _cycle(model, optimizer, grads, bucket, steps)  # warm-up: state allocated, kernels chosen
        times = []
        for _ in range(rounds * steps):
            started = clock()
            _step(model, optimizer, grads, bucket)
            times.append(clock() - started)
        window = profile_window(functools.partial(_cycle, model, optimizer, grads, bucket, steps), steps, device)
        results[name] = {"mean_s": statistics.fmean(times), "slowest_s": max(times), "steps": steps,
                         "phases": window.shares(),
                         "parameters": sum(p.numel() for p in model.parameters())}
        # each row as soon as it is measured: a run cut short (a time limit) still says what it measured
        baseline = results[names[0]].get("mean_s")
        ratio = f", {results[name]['mean_s'] / baseline:.2f}x {names[0]}" if baseline else ""
        print(f"[step_cost] {number}/{len(names)} {name}: {results[name]['mean_s']:.4f} s/step{ratio} "
              f"({time.perf_counter() - began:.0f} s so far)", flush=True)
        if sync is not None:  # the learner leaves; its synchronizer ends
            optimizer.finish()
            sync.__exit__(None, None, None)
        del model, optimizer, grads, bucket
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    from lowcomm.config.compose import compose
    from lowcomm.strategies import STRATEGIES

    total_blocks = int(compose(["model=olmo_300m"])["model"]["n_layers"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=sorted(STRATEGIES), default=sorted(STRATEGIES),
                        help="registered optimizers to time (default: every one)")
    parser.add_argument("--blocks", type=int, default=1,
                        help=f"of OLMo-300M's {total_blocks} transformer blocks (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="timed cycles per method after one warm-up (default 3)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: every core)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds is at least 1, got {args.rounds}")
    if not 1 <= args.blocks <= total_blocks:
        parser.error(f"--blocks is 1 to {total_blocks} (OLMo-300M has {total_blocks} blocks), got {args.blocks}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    names = ["adamw_ddp", *(name for name in args.methods if name != "adamw_ddp")]

    from lowcomm.comm.spawn import spawn_workers

    threads = args.threads or torch.get_num_threads()
    started = time.perf_counter()
    results = spawn_workers(_worker, 1, names, args.blocks, args.rounds, args.device, timeout_s=7200,
                            threads=threads, backend="nccl" if args.device == "cuda" else "gloo")[0]
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {threads} threads"
    if "error" in results["adamw_ddp"]:
        print(f"step_cost: AdamW-DDP, the baseline, did not run: {results['adamw_ddp']['error']}", file=sys.stderr)
        return 1
    baseline = results["adamw_ddp"]["mean_s"]
    parameters = next(r["parameters"] for r in results.values() if "parameters" in r)
    # a column for every kind some method spent time in, and the time outside them: on the CPU each
    # row sums to 100 %; on a GPU kernels on several streams (NCCL beside compute) may sum to more
    measured = [result["phases"] for result in results.values() if "phases" in result]
    columns = [kind for kind in KIND_ORDER if any(phases[kind] > 0 for phases in measured)]
    columns += [key for key in measured[0] if key not in KIND_ORDER]
    print(f"optimizer step cost, OLMo-300M shapes with {args.blocks} of {total_blocks} blocks ({parameters:,} parameters), W=1, "
          f"{device}; mean over {args.rounds} cycles after a warm-up; phases: one more cycle under torch.profiler, "
          + ("its kernels by kind and the GPU's idle" if args.device == "cuda" else
             "its operators' own time by kind and the time outside operators")
          + f", as shares of its wall time (benchmarks/profiles.py); {time.perf_counter() - started:.0f} s in all\n")
    print("| method | cycle (steps) | mean s/step | slowest step s | x AdamW-DDP | " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(columns))
    for name in names:
        result = results[name]
        if "error" in result:
            print(f"| {name} | cannot run at W=1: {result['error']} |")
            continue
        phases = " | ".join(f"{result['phases'][kind]:.0%}" for kind in columns)
        print(f"| {name} | {result['steps']} | {result['mean_s']:.4f} | {result['slowest_s']:.4f} | "
              f"{result['mean_s'] / baseline:.2f}x | {phases} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
