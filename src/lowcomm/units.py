"""Numbers as a person reads them: byte counts, link rates and SLURM time limits, in one place.

A foundation module (no torch): command lines and the data scan format with it alike."""

from __future__ import annotations

import math
import re


def decimal_bytes(count: float) -> str:
    """``count`` bytes in decimal units (1 MB = 1e6 bytes, as every table here): ``917.9 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count:,.0f} B"


def slurm_time(minutes: float) -> str:
    """A time limit as ``sbatch --time`` writes it, ``H:MM:00``, whole minutes rounded up."""
    minutes = math.ceil(minutes)
    return f"{minutes // 60}:{minutes % 60:02d}:00"


_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def parse_bandwidth(text: str) -> float:
    """Bits per second from ``1G``, ``100Mbit``, ``10Mbit/s`` or ``2.5e8`` (positive)."""
    match = re.fullmatch(r"([0-9.eE+-]+)\s*([kKMGT]?)(?:bit(?:/s)?|bps)?", str(text).strip())
    try:
        value = float(match.group(1)) * _SI[match.group(2)] if match else math.nan
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise ValueError(f"bandwidth {text!r} is not a number of bits/s like 1G or 100Mbit")
    if not 0 < value < math.inf:
        raise ValueError(f"bandwidth {text!r}: a link's rate must be > 0 and finite")
    return value
