"""OLMo's on-disk token format and a deterministic, rank-disjoint batch order over it.

A file is a raw flat array of token ids (no header, despite OLMo's ``.npy`` names), uint16 or
uint32, documents separated by EOS. Instance ``i`` of a file is tokens ``[i*L, (i+1)*L)``; the
tail shorter than ``L`` is dropped. Several files are concatenated instance-wise.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """A data file is missing, empty or does not match its declared format."""


def expand_paths(patterns: list[str] | tuple[str, ...], key: str) -> list[Path]:
    """Expand globs in order; each pattern must match at least one file."""
    if not patterns:
        raise DataError(f"{key} is empty: give at least one file path or glob")
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
        if not matches:
            raise DataError(f"{key}: no file matches {pattern!r}")
        paths.extend(Path(m) for m in matches)
    return paths


def available_tokens(patterns: list[str] | tuple[str, ...], dtype: str) -> tuple[int, int] | None:
    """``(files, tokens)`` that ``patterns`` hold (from the file sizes, nothing is read), or None
    when a pattern matches no file here (data not staged on this machine)."""
    try:
        paths = expand_paths(patterns, "data")
    except DataError:
        return None
    itemsize = np.dtype(DTYPES.get(dtype, np.uint16)).itemsize
    return len(paths), sum(path.stat().st_size // itemsize for path in paths)


def check_token_file(path: Path, dtype: str, *, seq_len: int | None = None, key: str = "data") -> int:
    """Validate one token file from its size alone (nothing is read); return its number of tokens.

    What needs its contents (the largest id, the layout, a fingerprint) is the whole-file scan's
    (:mod:`lowcomm.data.scan`), run once per file before anything is spawned."""
    if dtype not in DTYPES:
        raise DataError(f"data.dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    if not path.is_file():
        raise DataError(f"{key}: {path} does not exist")
    size = path.stat().st_size
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    if size == 0:
        raise DataError(f"{key}: {path} is empty")
    if size % itemsize:
        raise DataError(
            f"data.dtype={dtype} does not match {path} ({key}): its size, {size} bytes, is not a multiple of "
            f"{itemsize} bytes per token"
            + (" (is the file uint16? then set data.dtype=uint16)" if dtype == "uint32" else "")
        )
    n_tokens = size // itemsize
    if seq_len is not None and n_tokens < seq_len:
        raise DataError(short_file_message(path, n_tokens, seq_len, key,
                                           f"remove it from {key} or lower train.seq_len"))
    return n_tokens


def short_file_message(path: Path, n_tokens: int, seq_len: int, key: str, remedy: str) -> str:
    """A file that holds no whole instance: the loader would take nothing from it."""
    return (f"{key}: {path} holds {n_tokens:,} tokens, fewer than one sequence (train.seq_len={seq_len}), "
            f"so no instance can be read from it; {remedy}")


class MemmapDataset:
    """Fixed-length instances over one or more token files."""

    def __init__(self, paths: list[Path], seq_len: int, dtype: str = "uint16"):
        self.paths = [Path(p) for p in paths]
        self.seq_len = seq_len
        self.dtype = DTYPES[dtype]
        self._arrays = []
        self._offsets = [0]
        for path in self.paths:
            n_tokens = path.stat().st_size // np.dtype(self.dtype).itemsize
            self._arrays.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(n_tokens,)))
            self._offsets.append(self._offsets[-1] + n_tokens // seq_len)
        if len(self) == 0:
            raise DataError(f"{[str(p) for p in self.paths]} hold no instance of {seq_len} tokens")

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        file_index = int(np.searchsorted(self._offsets, index, side="right")) - 1
        start = (index - self._offsets[file_index]) * self.seq_len
        return np.asarray(self._arrays[file_index][start : start + self.seq_len], dtype=np.int64)

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self[int(i)] for i in indices]))


@dataclass
class BatchOrder:
    """Which instances each rank reads at each step: a fresh seeded permutation per epoch, the
    global batch cut into W contiguous rank slices, each slice into micro-batches.

    The whole order is a function of (seed, dataset size, global batch, W), so the read position
    is one integer, ``consumed`` (instances taken by all ranks together), and resuming needs
    nothing else."""

    num_instances: int
    global_batch_size: int
    rank: int
    world_size: int
    micro_batch_size: int
    seed: int = 0

    def __post_init__(self):
        if self.global_batch_size % (self.world_size * self.micro_batch_size):
            raise ValueError("global batch must be divisible by world size x micro-batch")
        self._epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_instances)
            self._epoch = epoch
        return self._perm

    def indices_for_step(self, step: int) -> list[np.ndarray]:
        """This rank's micro-batches (instance indices) for optimizer step ``step``."""
        first = step * self.global_batch_size + self.rank * self.local_batch_size
        positions = np.arange(first, first + self.local_batch_size)
        out = np.empty_like(positions)
        for epoch in np.unique(positions // self.num_instances):
            mask = positions // self.num_instances == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask] % self.num_instances]
        return np.split(out, self.local_batch_size // self.micro_batch_size)


def validation_indices(num_instances: int, max_instances: int, rank: int, world_size: int) -> np.ndarray:
    """A fixed, rank-disjoint slice of the validation set (the first ``max_instances``)."""
    return np.arange(min(num_instances, max_instances))[rank::world_size]
