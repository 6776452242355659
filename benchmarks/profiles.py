"""Where a profiled window's time goes, by kind of work: what ``throughput.py --profile-steps``
and ``step_cost.py`` print.

One split for both devices, from ``torch.profiler``'s events of the window:

* **On a GPU** every kernel, copy and fill the device ran, by its name; the kinds' times can
  overlap (an NCCL kernel beside a matmul), so the device's busy time is the union of the
  kernels' intervals, and the rest of the window's wall time is the **device idle**: where the GPU
  waited for the host (Python, launches, a synchronisation, and the profiler's own cost per
  operator, so the idle is somewhat larger under the profiler than without it).
* **On the CPU** each operator's own (``self``) time, nested operators counted once, and the
  rest of the window's wall time is **outside operators**: Python, the autograd engine's and
  torch.compile's own scopes, waits.

``record_function`` ranges (DeMo's ``DeMo.topk`` ...) are user annotations, not work: they are
left out, and so is their own time, which lands in the idle or outside line. One range is work:
on the CPU, torch.compile's generated C++ kernels run inside inductor's ``## Call
CompiledFxGraph`` range, whose own time is counted as fused (compiled) work (a user annotation
in some torch versions, a plain scope in others: read by its name either way).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from lowcomm.train.loop import DeviceClock

FUSED = "fused (compiled)"  # torch.compile's generated kernels: Triton's on a GPU, C++ on the CPU
# Names read by their beginning first: inductor names a Triton kernel after the operators it fused
# (triton_poi_fused_addmm_gelu_0 is pointwise work, not a matmul), and a Triton matmul template
# triton_tem_; on the CPU inductor's C++ kernels run inside a range it marks as a user annotation.
_PREFIXES = (("triton_tem", "matmul"), ("triton_", FUSED), ("## call compiledfxgraph", FUSED))
# Then the words, in the order kinds are matched. A collective's name holds "gather", so
# communication comes first; then lowcomm's DCT kernels (DeMo's encode and decode, whose names
# hold "topk" and "gather"); attention before matmul (flash attention's kernels are cutlass's).
KINDS: dict[str, tuple[str, ...]] = {
    "communication": ("gloo", "nccl", "c10d", "all_gather", "all_reduce", "broadcast", "allgather", "allreduce",
                      "reduce_scatter", "reducescatter", "sendrecv", "record_param_comms", "wait_tensor"),
    "DCT kernels": ("dct_",),
    "attention": ("attention", "flash", "fmha", "sdpa"),
    "matmul": ("mm", "bmm", "addmm", "matmul", "linalg", "baddbmm", "einsum", "addbmm", "gemm", "gemv", "cutlass",
               "xmma", "nvjet", "splitkreduce"),
    "top-k/sort": ("topk", "sort", "kthvalue"),
    "scatter/gather": ("scatter", "gather", "index", "take", "masked_select"),
    "copy/cast": ("copy", "clone", "cat", "stack", "contiguous", "empty", "zero", "fill", "memcpy", "memset"),
}
KIND_ORDER = ("matmul", "attention", FUSED, "DCT kernels", "top-k/sort", "scatter/gather", "communication",
              "copy/cast", "elementwise")  # the tables' columns
_OPERATOR = re.compile(r"(\w+)::(\w+)")  # an operator's name: aten::mm, c10d::allreduce_, lowcomm::dct_...
# scopes on the CPU that are not operators: the autograd engine's around a backward operator, and
# torch.compile's around a compiled region (its guards, its wrappers); their own time is theirs
SCOPES = re.compile(r"autograd::engine::.*|\w+Backward\d*|Torch-Compiled Region.*|TorchDynamo Cache Lookup"
                    r"|AOTDispatcher.*|Pregraph bytecode|CompiledFunction\w*")


def kind_of(name: str) -> str:
    """The kind of an operator (``aten::mm``, ``lowcomm::block_topk``, ``c10d::allreduce_``) or a
    GPU kernel (``ampere_bf16_s16816gemm_...``, a demangled ``void at::native::...<...>(...)``) by
    its name. A compiled kernel is read by its prefix (``triton_poi_fused_addmm_0`` is fused
    pointwise work). An operator is read by the words after its namespace (``lowcomm`` is not a
    matmul), its namespace counting too (``c10d``, ``_c10d_functional``); any other name is read
    whole. Keys of three letters or fewer (``mm``, ``cat``) match whole words only:
    ``FusedAdamMathFunctor`` holds no matmul."""
    lowered = name.lower()
    for prefix, kind in _PREFIXES:
        if lowered.startswith(prefix):
            return kind
    operator = _OPERATOR.fullmatch(lowered)
    namespace, text = operator.groups() if operator else ("", lowered)
    words = set(re.split(r"[^a-z0-9]+", text))
    for kind, keys in KINDS.items():
        if any(key in namespace for key in keys if len(key) > 3) or any(
                key in words if len(key) <= 3 else key in text for key in keys):
            return kind
    return "elementwise"


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(end - max(start, reach), 0.0)  # what reaches past the union so far
        reach = max(reach, end)
    return total


@dataclass
class Breakdown:
    """A window of ``steps`` steps on ``device`` (``cuda`` or ``cpu``) that took ``wall_s``:
    seconds per kind (``kinds``, every kind of :data:`KIND_ORDER`), the seconds the device was
    busy (the union of its kernels; on the CPU the operators' time), and the heaviest names."""

    device: str
    steps: int
    wall_s: float
    kinds: dict[str, float]
    busy_s: float
    top: list[tuple[str, float]] = field(default_factory=list)

    @property
    def uncovered_s(self) -> float:
        """The window's wall time the device's work does not cover: the GPU idle, or on the CPU
        the time outside operators."""
        return max(self.wall_s - self.busy_s, 0.0)

    @property
    def uncovered_label(self) -> str:
        return "device idle (waiting for the host)" if self.device == "cuda" else "outside operators (Python, autograd, waits)"

    def seconds(self) -> dict[str, float]:
        """Each kind's seconds, and the uncovered time's under its label."""
        return {**self.kinds, self.uncovered_label: self.uncovered_s}

    def shares(self) -> dict[str, float]:
        """:meth:`seconds` as shares of the window's wall time."""
        wall = self.wall_s or 1.0
        return {kind: seconds / wall for kind, seconds in self.seconds().items()}

    def table(self, flops_per_step: float | None = None, peak_flops: float | None = None) -> str:
        """The window as a markdown table, ms per step and share of the wall time, kinds with
        no time left out; with the step's FLOPs and the device's peak, the window's MFU and the
        share of peak those FLOPs would reach in the matmul and attention time alone (the FLOPs
        as the caller counts them: ``throughput.py`` gives 6 x parameters per token)."""
        per_step = 1e3 / self.steps
        lines = [f"where the time of {self.steps} profiled steps goes ({self.device}): "
                 f"{self.wall_s * per_step:.2f} ms/step wall, {self.busy_s * per_step:.2f} ms/step "
                 + ("of kernels (their union)" if self.device == "cuda" else "in operators"),
                 "", "| kind | ms/step | share of the step |", "|---|---:|---:|"]
        for kind, seconds in self.seconds().items():
            if seconds > 0:
                lines.append(f"| {kind} | {seconds * per_step:.2f} | {seconds / self.wall_s:.1%} |")
        if self.device == "cuda" and sum(self.kinds.values()) > self.busy_s * 1.001:
            lines.append(f"(kinds overlap by {(sum(self.kinds.values()) - self.busy_s) * per_step:.2f} ms/step: "
                         "kernels on several streams, as NCCL's beside compute)")
        if flops_per_step and peak_flops:
            dense = self.kinds["matmul"] + self.kinds["attention"]
            mfu = flops_per_step * self.steps / (self.wall_s * peak_flops)
            line = f"MFU (6N) of the window {mfu:.1%}"
            if dense > 0:
                line += (f"; the step's FLOPs in its matmul and attention time alone would be "
                         f"{flops_per_step * self.steps / (dense * peak_flops):.1%} of peak")
            lines += ["", line]
        if self.top:
            lines += ["", "heaviest: " + "; ".join(f"{name[:80]} {seconds * per_step:.2f} ms/step"
                                                  for name, seconds in self.top)]
        return "\n".join(lines)


def breakdown(events, device: str, steps: int, wall_s: float, top: int = 5) -> Breakdown:
    """The :class:`Breakdown` of a profiler window's ``events`` (``prof.events()``) on ``device``.
    On ``cuda`` the device's events (kernels, copies, fills) by their intervals; on ``cpu`` each
    CPU operator's self time. User annotations (``record_function`` ranges) and async events are
    not work and are skipped."""
    on_gpu = device == "cuda"
    seconds_by_name: dict[str, float] = {}
    intervals = []
    for event in events:
        if event.is_async or (event.is_user_annotation and (on_gpu or kind_of(event.name) != FUSED)):
            continue
        if on_gpu:
            if event.device_type.name != "CUDA":
                continue
            start, end = event.time_range.start, event.time_range.end
            intervals.append((start, end))
            seconds = (end - start) / 1e6
        else:
            if event.device_type.name != "CPU" or SCOPES.fullmatch(event.name):
                continue
            seconds = event.self_cpu_time_total / 1e6
        seconds_by_name[event.name] = seconds_by_name.get(event.name, 0.0) + seconds
    kinds = dict.fromkeys(KIND_ORDER, 0.0)
    for name, seconds in seconds_by_name.items():  # each name sorted once: a GPU window has many events, few names
        kinds[kind_of(name)] += seconds
    busy = covered(intervals) / 1e6 if on_gpu else sum(kinds.values())
    heaviest = sorted(seconds_by_name.items(), key=lambda item: -item[1])[:top]
    return Breakdown(device, steps, wall_s, kinds, busy, heaviest)


def profile_window(work: Callable[[], object], steps: int, device: torch.device) -> Breakdown:
    """``work`` (``steps`` steps of something) run once under torch.profiler, timed by the
    device's clock (on a GPU its queue drained before and after), and its :class:`Breakdown`."""
    from torch.profiler import ProfilerActivity, profile

    clock = DeviceClock(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    clock()  # work queued before the window is not the window's
    with profile(activities=activities) as prof:
        started = clock()
        work()
        wall = clock() - started
    return breakdown(prof.events(), device.type, steps, wall)
