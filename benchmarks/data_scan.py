"""Throughput of the whole-file data scan (largest token id + SHA-256 of every byte), the check
every launch runs once per data file before anything is spawned.

    python benchmarks/data_scan.py [--mb 400] [--dtype uint16] [--repeats 3] [--dir /scratch/tmp]

Writes a file of random token ids of ``--mb`` megabytes in ``--dir`` (removed afterwards), then
times, in one run: SHA-256 alone over the same bytes already in memory (the ceiling), the scan
from the page cache (warm), the scan after the file was dropped from the page cache with
``posix_fadvise(DONTNEED)`` (cold: from the disk), and a second launch's check (served from the
scan cache). Best of ``--repeats``; MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from lowcomm.data.scan import CHUNK_TOKENS, cached_scan, scan_file


def _drop_from_page_cache(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400, help="file size in MB (default 400)")
    parser.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the file (default: the system temp dir)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path, cache = Path(tmp) / "tokens.bin", Path(tmp) / "scans"
        itemsize = np.dtype(args.dtype).itemsize
        n_tokens = args.mb * 1_000_000 // itemsize
        rng = np.random.default_rng(0)
        with path.open("wb") as handle:  # in chunks: bounded memory whatever --mb
            for start in range(0, n_tokens, CHUNK_TOKENS):
                count = min(CHUNK_TOKENS, n_tokens - start)
                handle.write(rng.integers(0, 50_280, size=count).astype(args.dtype).tobytes())
        size_mb = path.stat().st_size / 1e6
        in_memory = path.read_bytes()
        hash_only = _best(lambda: hashlib.sha256(in_memory).digest(), args.repeats)
        in_memory = b""

        def cold() -> None:
            _drop_from_page_cache(path)
            scan_file(path, args.dtype)

        rows = [
            ("SHA-256 alone, bytes in memory", hash_only),
            ("scan, file in the page cache", _best(lambda: scan_file(path, args.dtype), args.repeats)),
            ("scan, file read from disk", _best(cold, args.repeats)),
        ]
        time.sleep(2.1)  # past the racy window: the scan may be cached
        scan_file(path, args.dtype, cache_dir=cache)
        rows.append(("next launch: cached scan", _best(lambda: cached_scan(path, args.dtype, cache), args.repeats)))

    print(f"whole-file scan of {size_mb:,.0f} MB of {args.dtype} tokens (best of {args.repeats})")
    print(f"{'':34} {'seconds':>9} {'MB/s':>9} {'vs SHA-256':>11}")
    ceiling = size_mb / rows[0][1]
    for name, seconds in rows[:-1]:
        rate = size_mb / seconds
        print(f"{name:34} {seconds:9.3f} {rate:9,.0f} {rate / ceiling:10.2f}x")
    name, seconds = rows[-1]
    print(f"{name:34} {seconds:9.5f} {'-':>9} {'-':>11}  (reads no data: a stat and a JSON file)")


if __name__ == "__main__":
    main()
