"""One pass over a whole token file: its largest id, a SHA-256 of its bytes and a sample of its
layout, cached per file so that a corpus is read once, not on every launch.

Checks that look at the first megabytes of a file miss what lies further in: an id out of the
vocabulary at 90 % of a shard only surfaces when a batch reaches it, after the allocation has
started (an ``IndexError`` on CPU, a device-side assert on a GPU), and a rewrite in place leaves
a sampled fingerprint unchanged. The scan reads every byte once, in chunks of a few million
tokens (bounded memory, vectorised numpy), and hashes the same bytes in the same pass.

The result is cached in ``<cache_dir>/<hash of the path and dtype>.json`` together with the
file's identity (inode, size, mtime and ctime in ns): any write to the file changes its ctime,
which no tool can set back, so a changed file is always scanned again. A file written in the
last seconds is not cached yet (a later write in the same timestamp tick would not show).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from lowcomm.data.memmap import DTYPES, DataError
from lowcomm.units import decimal_bytes

# Bumped when what a scan records changes: older cache entries are then scanned again.
SCAN_VERSION = 1
# 4 Mi tokens a chunk: 8 MiB of uint16, 16 MiB of uint32.
CHUNK_TOKENS = 4 << 20
# Timestamps are coarser than nanoseconds (a kernel tick; 1-2 s on some filesystems).
RACY_WINDOW_NS = 2_000_000_000
# Tokens of each chunk looked at for the layout heuristic (the rest costs time, not certainty).
LAYOUT_SAMPLE = 1 << 16


@dataclass(frozen=True)
class FileScan:
    """What one pass over a token file found."""

    path: str  # resolved
    dtype: str
    size: int  # bytes
    tokens: int
    max_id: int
    max_id_at: int  # token index of the first occurrence of max_id
    sha256: str  # of every byte of the file
    # The layout heuristic: sampled pairs of adjacent tokens (positions 2k, 2k+1) and how many of
    # them hold 0 or 1 at the even / odd position. A uint32 file read as uint16 has its high
    # halves, all 0 (or 1 above id 65535), at every odd position.
    pairs: int
    even_small: int
    odd_small: int
    seconds: float
    cached: bool = False

    def looks_like_uint32_as_uint16(self) -> bool:
        return (self.dtype == "uint16" and self.pairs >= 64 and self.odd_small >= 0.99 * self.pairs
                and self.even_small <= 0.5 * self.pairs)


def file_identity(path: Path) -> dict:
    """What changes whenever the file's bytes may have (ctime cannot be set back by any tool)."""
    stat = path.stat()
    return {"inode": stat.st_ino, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


class ScanProgress:
    """Progress of the scans of a set of files, on ``stream``: a line every ``interval_s`` once
    they have taken longer than ``after_s`` (rewritten in place on a terminal), so that a 100 GB
    corpus is seen being read, at what rate, and how long it will still take."""

    def __init__(self, stream: TextIO | None = None, *, interval_s: float = 10.0, after_s: float = 2.0):
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s, self.after_s = interval_s, after_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.begin(0, 0)

    def begin(self, total_bytes: int, files: int) -> None:
        self.total_bytes, self.files = total_bytes, files
        self.started = time.monotonic()
        self.done_bytes, self.file_index, self.shown = 0, 0, False
        self._last = self.started + self.after_s - self.interval_s
        self._path: Path | None = None

    def file_started(self, path: Path) -> None:
        self._path = path
        self.file_index += 1

    def advance(self, n_bytes: int) -> None:
        self.done_bytes += n_bytes
        now = time.monotonic()
        if now - self._last < (0.5 if self.tty and self.shown else self.interval_s):
            return
        self._last = now
        rate = self.done_bytes / max(now - self.started, 1e-9)
        left = (self.total_bytes - self.done_bytes) / rate if rate > 0 else float("inf")
        total = max(self.total_bytes, self.done_bytes)
        line = (f"[lowcomm] scanning data, file {self.file_index} of {self.files} ({self._path}): "
                f"{decimal_bytes(self.done_bytes)} of {decimal_bytes(total)} ({100 * self.done_bytes / max(total, 1):.0f}%) "
                f"at {decimal_bytes(rate)}/s, ~{max(left, 0):.0f} s left")
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def scan_file(path: Path, dtype: str, *, cache_dir: Path | None = None,
              progress: ScanProgress | None = None) -> FileScan:
    """Scan ``path`` read as ``dtype`` tokens, or return the cached scan of the same file."""
    _check_dtype(dtype)
    cached = cached_scan(path, dtype, cache_dir) if cache_dir is not None else None
    if cached is not None:
        return cached
    path = Path(path).resolve()
    identity = _identity(path)
    scan_started_ns = time.time_ns()
    scan = _scan(path, dtype, identity, progress)
    # A file changed within a timestamp tick of the scan could change again without its times
    # moving (git's "racy" files): such a scan is not cached, the next launch reads it again.
    settled = max(identity["mtime_ns"], identity["ctime_ns"]) < scan_started_ns - RACY_WINDOW_NS
    if cache_dir is not None and settled:
        record = {"version": SCAN_VERSION, "identity": identity, "scan": dataclasses.asdict(scan)}
        _write_cache(_cache_entry(cache_dir, path, dtype), record)
    return scan


def cached_scan(path: Path, dtype: str, cache_dir: Path) -> FileScan | None:
    """The cached scan of ``path`` as ``dtype`` if the file has not changed since, else None."""
    _check_dtype(dtype)
    path = Path(path).resolve()
    identity = _identity(path)
    try:
        record = json.loads(_cache_entry(cache_dir, path, dtype).read_text())
        if (record.get("version") == SCAN_VERSION and record.get("identity") == identity
                and record["scan"]["path"] == str(path) and record["scan"]["dtype"] == dtype):
            return dataclasses.replace(FileScan(**record["scan"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none, unreadable or from another version: scan again
    return None


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise DataError(f"data.dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")


def _identity(path: Path) -> dict:
    try:
        return file_identity(path)
    except FileNotFoundError:
        raise DataError(f"{path} does not exist") from None


def _cache_entry(cache_dir: Path, path: Path, dtype: str) -> Path:
    key = hashlib.sha256(f"{path}\0{dtype}".encode()).hexdigest()[:24]
    return Path(cache_dir) / f"{key}.json"


def _write_cache(entry: Path, record: dict) -> None:
    """Best effort: a cache that cannot be written (read-only or full run root) costs a rescan."""
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, entry)
    except OSError:
        tmp.unlink(missing_ok=True)


def _scan(path: Path, dtype: str, identity: dict, progress: ScanProgress | None) -> FileScan:
    np_dtype = np.dtype(DTYPES[dtype])
    itemsize = np_dtype.itemsize
    started = time.perf_counter()
    # SHA-256 rather than BLAKE2b: with the SHA extensions of current x86 and ARM CPUs, OpenSSL's
    # SHA-256 hashes ~1.6 GB/s on one core here, BLAKE2b ~0.9 (benchmarks/data_scan.py).
    digest = hashlib.sha256()
    max_id, max_id_at, done, tokens_seen = -1, -1, 0, 0
    pairs = even_small = odd_small = 0
    if progress is not None:
        progress.file_started(path)
    # read() into two buffers in turn, the next chunk read by a thread while this one is hashed
    # (both release the GIL): ~1.3 GB/s from a cold cache here, against ~0.9 serially. Not mmap:
    # a file truncated while mapped kills the launcher with SIGBUS.
    buffers = [bytearray(CHUNK_TOKENS * itemsize) for _ in range(2)]
    with path.open("rb", buffering=0) as handle, ThreadPoolExecutor(1, thread_name_prefix="scan") as reader:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        current = 0
        pending = reader.submit(handle.readinto, buffers[current])
        while n_bytes := pending.result():
            buffer = buffers[current]
            current ^= 1
            pending = reader.submit(handle.readinto, buffers[current])
            digest.update(memoryview(buffer)[:n_bytes])
            done += n_bytes
            # a size that is not whole tokens is reported by check_token_file; the hash covers it all
            tokens = np.frombuffer(buffer, dtype=np_dtype, count=n_bytes // itemsize)
            if tokens.size:
                chunk_max = int(tokens.max())
                if chunk_max > max_id:
                    max_id, max_id_at = chunk_max, tokens_seen + int(tokens.argmax())
                sample = tokens[: min(LAYOUT_SAMPLE, tokens.size) // 2 * 2].reshape(-1, 2)
                pairs += sample.shape[0]
                even_small += int(np.count_nonzero(sample[:, 0] <= 1))
                odd_small += int(np.count_nonzero(sample[:, 1] <= 1))
                tokens_seen += tokens.size
            if progress is not None:
                progress.advance(n_bytes)
    if file_identity(path) != identity or done != identity["size"]:
        raise DataError(f"{path} changed while it was being scanned; is something still writing it?")
    return FileScan(path=str(path), dtype=dtype, size=done, tokens=tokens_seen, max_id=max_id, max_id_at=max_id_at,
                    sha256=digest.hexdigest(), pairs=pairs, even_small=even_small, odd_small=odd_small,
                    seconds=time.perf_counter() - started)
