"""Tokens/s of lowcomm's training loop against a bare PyTorch DDP loop doing the same work.

Same model (tiny OLMo by default), same global batch, micro-batches and sequence length, same
workers (gloo on CPU, NCCL with ``--device cuda``, one GPU per worker), same data files, same
AdamW hyperparameters (torch's AdamW, fused on a GPU as lowcomm's, in one parameter group),
clipping, LR schedule, precision, weight dtype and compilation (``train.precision``,
``train.param_dtype``, ``train.compile``). Both loops run in the same worker processes, alternating, and
the best of ``--repeats`` windows of each is compared, so the ratio is measured in one run. The
bare loop is always AdamW-DDP: with another lowcomm optimizer (``optimizer=demo``) the ratio is
that optimizer's whole-step cost against the baseline's:

    python benchmarks/throughput.py [--workers 4] [--steps 40] [--repeats 3] [overrides...]
    python benchmarks/throughput.py --device cuda --workers 8 model=olmo_300m \
        train.global_batch_size=64 train.micro_batch_size=8 train.seq_len=2048

lowcomm's number comes from its own ``perf/tokens_per_s`` metric over the timed window (the
loop with metering, schedule and logging; on CUDA its clock synchronises the device); the bare
loop is timed around the same steps. MFU is FLOPs per token x tokens/s over the peak FLOP/s of
all workers (``--peak-flops`` per worker; on CUDA the GPU's dense bf16 peak by its name, else
the H100's; none on CPU), with FLOPs per token counted both ways the field does
(:class:`lowcomm.models.FlopsPerToken`): 6 x parameters, and OLMo-core's formula with attention.
Peak memory is per worker: torch's peak allocation on CUDA, the peak resident set on CPU.

``--profile-steps N`` then runs N more of lowcomm's steps, warm, under torch.profiler and prints
where their time goes by kind (``profiles.py``): on a GPU its kernels and the device's idle, with
the window's MFU; on the CPU its operators and the time outside them.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowcomm.hardware import H100_BF16_PEAK_FLOPS, bf16_peak_flops

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiles import Breakdown, profile_window  # noqa: E402  (a sibling script)

_OPTIMIZER_KEYS = ("optimizer", "compression")  # overrides that pick lowcomm's optimizer, not the baseline's


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS


def _bare_loop(run, data, steps: int, device: torch.device, bucket_cap_mb: float) -> float:
    """Plain DDP (buckets of ``bucket_cap_mb`` MiB, the measured run's when it sets them) + AdamW
    over the same batches, with the run's weight dtype and compilation; returns tokens/s."""
    from torch.nn.parallel import DistributedDataParallel

    from lowcomm.data import BatchOrder
    from lowcomm.models import build_model
    from lowcomm.train.loop import next_token_loss, with_speed_settings

    train = run.train
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, autocast, loss_of = with_speed_settings(build_model(run.model, device, seed=run.seed), train, device)
    model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                    device_ids=[device.index] if device.type == "cuda" else None)
    cfg = run.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, fused=device.type == "cuda" or None)
    order = BatchOrder(len(data.train), train.global_batch_size, rank, world, train.micro_batch_size, run.seed)

    def lr_at(step):
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = min((step - train.warmup_steps) / max(train.max_steps - train.warmup_steps, 1), 1.0)
        return train.alpha_f + (1 - train.alpha_f) * 0.5 * (1 + math.cos(math.pi * progress))

    def one_step(step):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * lr_at(step)
        micro = order.indices_for_step(step)
        for i, indices in enumerate(micro):
            tokens = data.train.batch(indices).to(device, non_blocking=True)
            ctx = model.no_sync() if i < len(micro) - 1 else torch.enable_grad()
            with ctx, autocast:
                loss = next_token_loss(model, tokens, loss=loss_of)
                (loss / len(micro)).backward()
        if train.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for step in range(3):  # warm-up: bucket rebuild, allocator
        one_step(step)
    _sync(device)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for step in range(3, 3 + steps):
        one_step(step)
    _sync(device)
    torch.distributed.barrier()
    return train.global_batch_size * train.seq_len * steps / (time.perf_counter() - t0)


def _lowcomm_loop(run):
    """lowcomm's own loop over the run: rank 0's tokens/s of its second (warm) logged window,
    NaN elsewhere, and the Trainer, still open and warm."""
    from lowcomm.distenv import DistEnv
    from lowcomm.launch.local import prepare_run_dir, start_synchronizer
    from lowcomm.train.loop import Trainer
    from lowcomm.train.metrics import read_metrics
    from lowcomm.train.synchronizer import uses_synchronizer

    world = torch.distributed.get_world_size()
    # as the local launcher sets it: one node, so the Trainer takes cores / W threads per worker
    env = DistEnv(torch.distributed.get_rank(), world, torch.distributed.get_rank(), world)
    synchronizer = None
    if uses_synchronizer(run) and env.rank == 0:  # learners: their synchronizer first, as the launcher starts it
        synchronizer = start_synchronizer(run, prepare_run_dir(run))
    try:
        trainer = Trainer(run, env)
        trainer.fit()
    finally:
        if synchronizer is not None:
            synchronizer.stop()
    if trainer.comm.rank != 0:
        return float("nan"), trainer
    records = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "perf/tokens_per_s" in r]
    return records[-1]["perf/tokens_per_s"], trainer  # the second, warm window


def _profile(trainer, steps: int) -> dict:
    """``steps`` more of the warm Trainer's own steps (``Trainer.train_step``: compiled, buckets
    built, state allocated) under torch.profiler, each waiting for its loss as the loop does;
    their :class:`profiles.Breakdown`, as a dict (it crosses a process boundary)."""
    trainer.model.train()
    torch.distributed.barrier()
    # the run's first steps' batches again: the time does not depend on them
    window = profile_window(lambda: [float(trainer.train_step(step)) for step in range(steps)], steps, trainer.device)
    return vars(window)


def _checkpoint_write(trainer, step: int) -> dict:
    """One checkpoint of the warm Trainer, written as the loop writes its own (every rank its
    share, atomically): the seconds until the slowest rank's files are on disk, and the bytes
    this rank wrote."""
    before = set(trainer.checkpoints.root.rglob("*")) if trainer.checkpoints.root.exists() else set()
    torch.distributed.barrier()
    began = time.perf_counter()
    trainer.checkpoints.save(step, trainer.model, trainer.optimizer, consumed=0)
    torch.distributed.barrier()
    seconds = time.perf_counter() - began
    written = [path for path in trainer.checkpoints.root.rglob("*") if path.is_file() and path not in before]
    return {"seconds": seconds, "bytes": sum(path.stat().st_size for path in written)}


def _worker(rank, world, override_sets, steps, repeats, root, device_type, profile_steps=0, bare_loop=True,
            checkpoint=False):
    """Each set of overrides in turn, in this one process: its bare loop (unless not
    ``bare_loop``), its lowcomm loop, ``repeats`` times alternating; a list of results. A set
    that cannot run (a method that needs more workers) gives ``{"error": ...}``."""
    results = []
    for overrides in override_sets:
        try:
            results.append(_measure_one(rank, world, overrides, steps, repeats, root, device_type, profile_steps,
                                        bare_loop, checkpoint))
        except Exception as exc:  # noqa: BLE001 - one method's failure is its row, not the run's end
            if len(override_sets) == 1:
                raise
            results.append({"error": " ".join(str(exc).split())[:300]})
        gc.collect()
        if device_type == "cuda":
            torch.cuda.empty_cache()
    return results


def _measure_one(rank, world, overrides, steps, repeats, root, device_type, profile_steps, bare_loop, checkpoint):
    import shutil

    from lowcomm.config import validate
    from lowcomm.config.compose import compose
    from lowcomm.data import open_data
    from lowcomm.models import build_model, count_parameters, flops_per_token

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    common = [f"cluster.workers={world}", f"cluster.device={device_type}", "wandb.mode=disabled", f"run_root={root}",
              "train.eval_every=0", "train.checkpoint_every=0", "train.eval_instances=8",
              f"train.max_steps={2 * steps}", "train.warmup_steps=3", f"train.log_every={steps}"]
    run = validate(compose([*common, *overrides]))
    # the bare loop is always the AdamW-DDP baseline, at adamw_ddp's defaults
    baseline = validate(compose([*common, *(o for o in overrides if not o.lstrip("+~").startswith(_OPTIMIZER_KEYS)),
                                 "optimizer=adamw_ddp"]))
    # lowcomm logs a window every `steps` steps: the second one (steps+1 .. 2*steps) is warm
    data = open_data(run.data, run.train.seq_len, run.run_root, run.model.tokenizer)
    bare, ours, bare_memory, our_memory = [], [], [], []
    for _ in range(repeats):
        trainer = None  # the last repeat's Trainer is dropped: its memory is not the next loops'
        gc.collect()
        if bare_loop:
            _reset_peak_memory(device)
            bare.append(_bare_loop(baseline, data, steps, device,
                                   getattr(run.optimizer, "bucket_cap_mb", baseline.optimizer.bucket_cap_mb)))
            bare_memory.append(_peak_memory_mb(device))
        if rank == 0:
            shutil.rmtree(run.run_dir, ignore_errors=True)
        torch.distributed.barrier()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _reset_peak_memory(device)
        tokens_per_s, trainer = _lowcomm_loop(run)
        ours.append(tokens_per_s)
        our_memory.append(_peak_memory_mb(device))
        torch.distributed.barrier()
    profiled = _profile(trainer, profile_steps) if profile_steps else None
    written = _checkpoint_write(trainer, 2 * steps + 1) if checkpoint else None
    parameters = count_parameters(build_model(run.model, "meta"))
    return {"bare": bare, "lowcomm": ours, "run": run.run_name, "tokens_per_step":
            run.train.global_batch_size * run.train.seq_len, "memory_bare": max(bare_memory, default=float("nan")),
            "memory_lowcomm": max(our_memory), "parameters": parameters,
            "flops_per_token": flops_per_token(run.model, parameters, run.train.seq_len),
            "model": run.model.name, "optimizer": run.optimizer_name, "profile": profiled, "checkpoint": written}


def measure(workers: int, steps: int, repeats: int, device: str, overrides: list[str],
            peak_flops: float | None = None, profile_steps: int = 0, checkpoint: bool = False) -> dict:
    """Both loops on ``workers`` processes: the best tokens/s of each (``bare``, ``lowcomm``),
    every window's (``all_*``), peak memory per worker (``memory_*``, MB), FLOPs per token and
    lowcomm's MFU both ways (``mfu_6n``, ``mfu_olmo_core``; None without a peak: on CPU unless
    ``peak_flops`` is given). With ``profile_steps``, ``profile``: rank 0's
    :class:`profiles.Breakdown` of that many more of lowcomm's steps (else None). With
    ``checkpoint``, ``checkpoint``: the seconds and rank 0's bytes of one checkpoint written
    after the loops (else None)."""
    return measure_each(workers, steps, repeats, device, [overrides], peak_flops, profile_steps,
                        checkpoint=checkpoint)[0]


def measure_each(workers: int, steps: int, repeats: int, device: str, override_sets: list[list[str]],
                 peak_flops: float | None = None, profile_steps: int = 0, bare_loop: bool = True,
                 checkpoint: bool = False) -> list[dict]:
    """:func:`measure` of each set of overrides, all in the same worker processes (one start
    for all: a table of methods); without ``bare_loop`` only lowcomm's loop runs (``bare`` is
    then NaN). A set that cannot run (several sets only) is ``{"error": ...}``. The data are
    the first set's."""
    peak_flops = peak_flops or (
        (bf16_peak_flops(torch.cuda.get_device_name(0)) or H100_BF16_PEAK_FLOPS) if device == "cuda" else None)

    from lowcomm.comm.spawn import spawn_workers
    from lowcomm.config import validate
    from lowcomm.config.compose import compose
    from lowcomm.data import materialize

    with tempfile.TemporaryDirectory() as root:
        run = validate(compose([f"run_root={root}", f"cluster.workers={workers}", *override_sets[0]]))
        materialize(run.data, run.train.seq_len, root, run.model.tokenizer)
        per_rank = spawn_workers(_worker, workers, override_sets, steps, repeats, root, device, profile_steps,
                                 bare_loop, checkpoint, timeout_s=3600,
                                 backend="nccl" if device == "cuda" else "gloo")
    return [_summarised([results[index] for results in per_rank], workers, peak_flops)
            for index in range(len(override_sets))]


def _summarised(results: list[dict], workers: int, peak_flops: float | None) -> dict:
    """One set's results over the ranks: rank 0's figures, the best windows, the MFUs."""
    out = results[0]
    if "error" in out:
        return out
    flops = out["flops_per_token"]
    best = {"bare": max(out["bare"], default=float("nan")), "lowcomm": max(out["lowcomm"])}
    # per loop and FLOP count: {"bare_6n": ..., "lowcomm_olmo_core": ...}; lowcomm's also as mfu_*
    mfu = {f"{loop}_{name}": None if peak_flops is None else per_token * best[loop] / (workers * peak_flops)
           for loop in best for name, per_token in (("6n", flops.six_n), ("olmo_core", flops.olmo_core))}
    return {**best, "mfu": mfu, "mfu_6n": mfu["lowcomm_6n"], "mfu_olmo_core": mfu["lowcomm_olmo_core"],
            "all_bare": out["bare"], "all_lowcomm": out["lowcomm"], "peak_flops": peak_flops,
            "memory_bare": max(r["memory_bare"] for r in results),
            "memory_lowcomm": max(r["memory_lowcomm"] for r in results),
            "profile": None if out["profile"] is None else Breakdown(**out["profile"]),
            **{key: out[key] for key in ("model", "optimizer", "parameters", "tokens_per_step", "flops_per_token",
                                         "checkpoint")}}


def profile_table(result: dict, workers: int) -> str:
    """The profiled window of a :func:`measure` result as a table, with its MFU (6N) where the
    peak is known: one worker's FLOPs per step (6 x parameters x its tokens) over its peak."""
    flops_per_step = result["flops_per_token"].six_n * result["tokens_per_step"] / workers
    return result["profile"].table(flops_per_step, result["peak_flops"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per worker, NCCL, bf16 autocast")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="peak FLOP/s of one worker for MFU (default on cuda: the GPU's dense bf16 peak by its "
                             f"name, else the H100's {H100_BF16_PEAK_FLOPS:.4g})")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timing, profile this many more of lowcomm's steps and print where their "
                             "time goes, by kind (default 0: no profile)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: the quickstart's tiny model)")
    args = parser.parse_args(argv)
    for name in ("workers", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} is at least 1, got {getattr(args, name)}")
    if args.profile_steps < 0:
        parser.error(f"--profile-steps is 0 (no profile) or more, got {args.profile_steps}")
    if args.device == "cuda" and torch.cuda.device_count() < args.workers:
        parser.error(f"--device cuda needs one GPU per worker: {args.workers} workers, "
                     f"{torch.cuda.device_count()} GPUs visible")
    result = measure(args.workers, args.steps, args.repeats, args.device, args.overrides, args.peak_flops,
                     args.profile_steps)
    backend = "NCCL GPU" if args.device == "cuda" else "gloo CPU"
    print(f"throughput, {result['model']} ({result['parameters']:,} parameters), lowcomm optimizer "
          f"{result['optimizer']}, {args.workers} {backend} workers, {result['tokens_per_step']} tokens/step, "
          f"{args.steps} timed steps, best of {args.repeats}:")
    flops, peak_flops = result["flops_per_token"], result["peak_flops"]

    def mfu(key: str) -> str:
        return "-" if result["mfu"][key] is None else f"{result['mfu'][key]:.1%}"

    print(f"  MFU 6N: 6 x parameters = {flops.six_n:,} FLOPs/token; MFU OLMo-core: its num_flops_per_token, "
          f"attention included = {flops.olmo_core:,} FLOPs/token; peak "
          + (f"{peak_flops:.4g} FLOP/s per worker" if peak_flops else "unknown on CPU (--peak-flops)"))
    print(f"  {'loop':<22}{'tokens/s':>12}{'MFU 6N':>9}{'MFU OLMo-core':>15}{'peak MB/worker':>16}   all repeats")
    for name, key in (("bare PyTorch DDP", "bare"), ("lowcomm", "lowcomm")):
        best = result[key]
        print(f"  {name:<22}{best:>12,.0f}{mfu(key + '_6n'):>9}{mfu(key + '_olmo_core'):>15}"
              f"{result['memory_' + key]:>16,.0f}   {', '.join(f'{x:,.0f}' for x in result['all_' + key])}")
    bare, ours = result["bare"], result["lowcomm"]
    print(f"  ratio lowcomm / bare: {ours / bare:.3f}  (target >= 0.95 with optimizer=adamw_ddp)")
    if result["profile"] is not None:
        print("\n" + profile_table(result, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
