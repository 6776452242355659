"""lowcomm's CPU kernels (``cpu_kernels.cpp``): compiled on first use, once per machine.

Where torch's operators need several passes over a large tensor for what one pass can do, a
C++ kernel does it on the CPU:

- the per-block top-k of DeMo's and SparseLoCo's selection
  (:func:`lowcomm.compress.block_topk.block_topk`);
- the block DCT (:func:`lowcomm.compress.dct.dct_transform`): each tile of 64-row blocks read
  and written once, with the DCT's even/odd split in place of dense products;
- DeMo's encode, that transform with the top-k of each tile taken while it is in cache
  (:meth:`lowcomm.compress.dct_topk.DCTTopK.transform_select`), and its decode, the gathered
  payloads' inverse added straight into the parameters
  (:meth:`lowcomm.compress.dct_topk.DCTTopK.decode_add`).

On OLMo-300M's 117.4M block-matrix parameters they bring DeMo's step from 466 to about 290 ms,
against fused AdamW's 75 (``benchmarks/demo_step.py``). Every kernel has a torch path, taken on
other devices and whenever the kernels are not there, tested against it: the top-k selects the
same entries in the same order wherever the magnitudes are distinct; the DCT agrees with the
matrix products to rounding (a few float32 ulps: it adds in another order), and the decode's
aggregate is the torch one's bit for bit.

They are built with torch's own extension builder (``torch.utils.cpp_extension``: a C++17
compiler with GCC's vector extensions, GCC or Clang, and ninja) into ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), under a name keyed by the source, the torch installation and this CPU, since they are compiled
for the CPU they are built on (``-march=native``): nodes of another CPU sharing a home directory
build their own. ``make venv`` builds them ahead (``lowcomm-build-kernels``, which also says
where they are).

Processes that start together (a run's workers) take turns on an exclusive ``flock`` of
``build.flock`` in that directory around torch's builder, so one builds and the others then
load. torch's builder keeps its own lock file while it runs and waits for that file to go
with no time limit, so a build killed part way (Ctrl-C in a run's first step) would leave every
later run waiting; the operating system drops a killed process's flock, so whoever holds it
next knows such a file is a leftover and removes it.

``LOWCOMM_CPU_KERNELS=0`` turns them off (the torch paths run). A failed build says so on
stderr, once per process, with the end of the compiler's output (all of it in
``build-error.log`` beside the build), and leaves the torch paths.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["SWITCH", "available", "build_directory", "enabled", "ops"]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
SWITCH = "LOWCOMM_CPU_KERNELS"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


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
    installation = f"{torch.__version__} {Path(torch.__file__).parent}"  # another venv builds its own
    for part in (SOURCE.read_bytes(), installation.encode(), " ".join(_FLAGS).encode(), _cpu_identity().encode()):
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
    no build yet; None when they are turned off or cannot be built (said once, on stderr)."""
    if not enabled():
        return None
    directory = build_directory()
    try:
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "build.flock", "a") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            leftover = directory / "lock"
            if leftover.exists():  # torch's lock, while nobody holds the flock: a killed build's
                print(f"lowcomm: removing {leftover}, left by a build that did not finish", file=sys.stderr, flush=True)
                leftover.unlink(missing_ok=True)
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
        text = f"{type(error).__name__}: {error}"
        log = directory / "build-error.log"
        try:
            log.write_text(text + "\n")
        except OSError:
            log = None
        tail = " | ".join(line.strip() for line in text.splitlines() if line.strip())
        where = f"; all of it in {log}" if log else ""
        print(f"lowcomm: warning: the CPU kernels could not be built in {directory} (...{tail[-400:]}{where}); "
              f"the torch paths run instead, more slowly. {SWITCH}=0 skips the attempt.", file=sys.stderr, flush=True)
        return None
    return torch.ops.lowcomm


def available() -> bool:
    """Are the kernels built and loaded (building them if need be)?"""
    return ops() is not None
