"""Numbers as a person reads them: byte counts and SLURM time limits, in one place.

A foundation module (no torch): command lines and the data scan format with it alike."""

from __future__ import annotations

import math


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
