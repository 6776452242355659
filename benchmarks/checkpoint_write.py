"""What one rank writes per second when it saves its share of a checkpoint, alone and with other
ranks writing theirs at the same time: the rate behind the dry run's checkpoint time
(``cluster.rank_write_MBps``).

    python benchmarks/checkpoint_write.py [--mb 1000] [--ranks 1 2] [--repeats 3] [--dir /scratch/tmp]

Each writer process saves a state dict of fp32 tensors of ``--mb`` megabytes (a rank's optimizer
state, e.g. DeMo's momentum) through the checkpoint writer itself (``torch.save`` into a file
that is hashed as it is written, then ``fsync``-ed and renamed: what every rank does in
``CheckpointManager.save``). With N ranks, N processes write N files in ``--dir`` at once, as
the ranks of a job do; the rate per rank is its bytes over the slowest writer's time. Best of
``--repeats``; MB = 1e6 bytes. Run it on a compute node, in the directory the runs write to, to
measure your cluster's filesystem: this machine's disk is not a parallel filesystem.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

import torch

from lowcomm.train.checkpoint import _atomic_save  # the writer every rank uses


def _state(megabytes: int) -> dict[str, torch.Tensor]:
    """fp32 tensors of ``megabytes`` in all, in 64 MB pieces (a model's parameters' shapes vary;
    the writer's cost is per byte)."""
    numel, piece = megabytes * 1_000_000 // 4, 16_000_000
    generator = torch.Generator().manual_seed(0)
    return {f"momentum.{i}": torch.randn(min(piece, numel - start), generator=generator)
            for i, start in enumerate(range(0, numel, piece))}


def _writer(directory: str, rank: int, megabytes: int, start, done) -> None:
    state = _state(megabytes)
    start.wait()
    began = time.perf_counter()
    _atomic_save(state, Path(directory) / f"optim_rank{rank}.pt")
    done.put(time.perf_counter() - began)


def _write_together(directory: Path, ranks: int, megabytes: int) -> float:
    """Seconds until the slowest of ``ranks`` writers has its file on disk."""
    context = multiprocessing.get_context("spawn")
    start, done = context.Barrier(ranks + 1), context.Queue()
    writers = [context.Process(target=_writer, args=(str(directory), rank, megabytes, start, done))
               for rank in range(ranks)]
    for writer in writers:
        writer.start()
    start.wait()  # every writer has built its state: time the writing only
    seconds = max(done.get() for _ in writers)
    for writer in writers:
        writer.join()
    for path in directory.glob("optim_rank*.pt"):
        path.unlink()
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1000, help="megabytes each rank writes (default 1000)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="writers at once (default 1 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = parser.parse_args(argv)

    print(f"checkpoint write: {args.mb:,} MB per rank, torch.save + sha256 + fsync (best of {args.repeats})")
    print(f"{'ranks at once':>13} {'seconds':>9} {'MB/s per rank':>14} {'MB/s in all':>12}")
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            seconds = min(_write_together(Path(tmp), ranks, args.mb) for _ in range(args.repeats))
        print(f"{ranks:>13} {seconds:9.2f} {args.mb / seconds:14,.0f} {ranks * args.mb / seconds:12,.0f}")


if __name__ == "__main__":
    main()
