"""lowcomm's CPU kernels (``cpu_kernels.cpp``): compiled on first use, once per machine.

Where torch's operators need several passes over a large tensor for what one pass can do, a
C++ kernel does it on the CPU: today the per-block top-k of DeMo's and SparseLoCo's
selection (:func:`lowcomm.compress.block_topk.block_topk`), which on OLMo-300M's 117M
block-matrix parameters takes about 90 ms against 280 for the two-round torch selection
(``benchmarks/demo_step.py``). Every kernel has a torch path with the same result (tested
against each other), taken on other devices and whenever the kernels are not there.

They are built with torch's own extension builder (``torch.utils.cpp_extension``: a C++17
compiler and ninja) into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``),
under a name keyed by the source, torch's version and this CPU, since they are compiled for the
CPU they are built on (``-march=native``): nodes of another CPU sharing a home directory build
their own. Concurrent builds (a run's workers starting together) wait on torch's lock; a lock left by a build
killed part way is removed after ``STALE_LOCK_S``. ``make
venv`` builds them ahead (``lowcomm-build-kernels``, which also says where they are).

``LOWCOMM_CPU_KERNELS=0`` turns them off (the torch paths run). A failed build warns once and
leaves the torch paths, which give the same results, more slowly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["SWITCH", "available", "build_directory", "enabled", "ops"]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
SWITCH = "LOWCOMM_CPU_KERNELS"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
# torch's builder holds a lock file while it compiles and makes every other process wait for it
# to go, with no time limit: a build killed part way (Ctrl-C in a run's first step) would leave
# every later run waiting. A build takes seconds; a lock this old is such a leftover.
STALE_LOCK_S = 300


def _cpu_identity() -> str:
    """What the compiled code depends on: the CPU's model and instruction sets."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")
    seen: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in wanted and key not in seen:
            seen[key] = value.strip()
    return f"{platform.machine()} " + " | ".join(f"{key}={seen[key]}" for key in sorted(seen))


def build_directory() -> Path:
    """Where this machine's build lives (see the module doc)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(_FLAGS).encode(), _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / f"lowcomm_cpu_kernels_{digest.hexdigest()[:16]}"


def enabled() -> bool:
    """Are the kernels wanted (``LOWCOMM_CPU_KERNELS``, default 1)?"""
    value = os.environ.get(SWITCH, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"{SWITCH}={os.environ[SWITCH]!r}: set it to 1 (build and use lowcomm's CPU "
                         "kernels, the default) or 0 (torch operators only)")
    return value not in ("0", "false", "no", "off")


@functools.cache
def ops() -> Any | None:
    """``torch.ops.lowcomm`` with the kernels loaded, building them first if this machine has
    no build yet; None when they are turned off or cannot be built (warned once)."""
    if not enabled():
        return None
    directory = build_directory()
    try:
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(directory / "lock")
        built = any(directory.glob("*.so"))
        started = time.perf_counter()
        if not built:
            print(f"lowcomm: building the CPU kernels in {directory} (once per machine, about 15 s)",
                  file=sys.stderr, flush=True)
        cpp_extension.load(
            name="lowcomm_cpu_kernels", sources=[str(SOURCE)], build_directory=str(directory),
            extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )
        if not built:
            print(f"lowcomm: built the CPU kernels in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
    except Exception as error:  # noqa: BLE001 - any build failure leaves the torch paths
        reason = " ".join(str(error).split())[:300]
        warnings.warn(
            f"lowcomm's CPU kernels could not be built in {directory} ({type(error).__name__}: {reason}); "
            f"the torch paths run instead (same results, slower). {SWITCH}=0 skips the attempt.",
            RuntimeWarning, stacklevel=2,
        )
        return None
    return torch.ops.lowcomm


def _remove_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        print(f"lowcomm: removing {lock}, left {age / 60:.0f} min ago by a build that did not finish",
              file=sys.stderr, flush=True)
        lock.unlink(missing_ok=True)


def available() -> bool:
    """Are the kernels built and loaded (building them if need be)?"""
    return ops() is not None
