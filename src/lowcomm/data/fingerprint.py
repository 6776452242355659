"""A content fingerprint of a run's data files, so that a resume on changed data stops.

Run names hash the data *paths*, not their contents: a file rewritten, truncated or regenerated
between a run's start and its resume would silently continue on other tokens. Each file is
summarised by its size and the SHA-256 of all its bytes, computed by the whole-file scan
(:mod:`lowcomm.data.scan`, cached per file) in the same pass as its largest token id, so a
rewrite anywhere in a file is seen, at no cost beyond that scan.

Run directories started before this hashed three 64 KiB windows of each file
(``sha256_windows``). Their resume compares those windows as before, says that it did, and
records the whole-file hash from then on.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from lowcomm.data.memmap import DataError
from lowcomm.data.scan import FileScan, scan_file

FINGERPRINT_FILE = "data_fingerprint.json"  # in the run directory
LEGACY_WINDOW = 64 * 1024  # the older sampled fingerprint: start, middle and end windows


def legacy_window_hash(path: Path) -> str:
    """The fingerprint older run directories recorded: SHA-256 of three 64 KiB windows."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for offset in sorted({0, max(size // 2 - LEGACY_WINDOW // 2, 0), max(size - LEGACY_WINDOW, 0)}):
            handle.seek(offset)
            digest.update(handle.read(LEGACY_WINDOW))
    return digest.hexdigest()


def fingerprint(scans: list[FileScan]) -> dict[str, dict]:
    return {scan.path: {"size": scan.size, "sha256": scan.sha256} for scan in scans}


def check_unchanged(run_dir: Path, paths: list[Path], *, resuming: bool,
                    scans: list[FileScan] | None = None) -> list[str]:
    """Record the files' fingerprint in the run directory; when ``resuming`` (the run has
    checkpoints) and one was recorded, raise DataError naming each file that changed.

    ``scans`` are the files' whole-file scans, in the order of ``paths`` (scanned here when not
    given). Returns notes to show the user (an older record accepted and upgraded)."""
    if scans is None:
        scans = [scan_file(Path(path), "uint16") for path in paths]
    record = Path(run_dir) / FINGERPRINT_FILE
    now = fingerprint(scans)
    if not (resuming and record.is_file()):
        _write(record, now)
        return []
    before = json.loads(record.read_text())
    problems, legacy = [], []
    for name, was in before.items():
        is_ = now.get(name)
        if is_ is None:
            problems.append(f"{name} is no longer among the data files")
        elif is_["size"] != was["size"]:
            problems.append(f"{name} changed size: {was['size']:,} bytes when the run started, "
                            f"{is_['size']:,} now")
        elif "sha256" not in was and "sha256_windows" in was:
            legacy.append(name)
            if legacy_window_hash(Path(name)) != was["sha256_windows"]:
                problems.append(f"{name} changed content (same size, {was['size']:,} bytes)")
        elif is_["sha256"] != was.get("sha256"):
            problems.append(f"{name} changed content (same size, {was['size']:,} bytes)")
    problems += [f"{name} was not among the data files when the run started" for name in now if name not in before]
    if problems:
        raise DataError("the data changed since this run's checkpoints were written, so resuming would train "
                        f"on other tokens: {'; '.join(problems)}. Restore the files, or start a new run "
                        f"(another run_root or seed)")
    if not legacy:
        return []
    _write(record, now)
    return [f"{record} came from an older lowcomm that hashed three 64 KiB windows of each file: those "
            f"match for {len(legacy)} file(s), so the run resumes; a change elsewhere in a file before today "
            "cannot be seen. The whole-file SHA-256 is recorded from now on"]


def _write(record: Path, fingerprints: dict[str, dict]) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f".{record.name}.tmp")
    tmp.write_text(json.dumps(fingerprints, indent=1, sort_keys=True))
    os.replace(tmp, record)
