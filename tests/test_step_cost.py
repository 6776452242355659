"""benchmarks/step_cost.py's split of a step's operator time by kind, on names the profiler
reports for lowcomm's steps."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_cost import kind_of  # noqa: E402  (a benchmark script, not a package)


@pytest.mark.parametrize(("name", "kind"), [
    ("aten::mm", "matmul"),
    ("aten::baddbmm_", "matmul"),
    ("lowcomm::block_topk", "top-k/sort"),  # "lowcomm" holds "mm": the namespace is not the op
    ("lowcomm::dct_blocks_topk", "DCT kernels"),  # DeMo's encode: the transform, then its top-k
    ("lowcomm::dct_gathered_update", "DCT kernels"),  # DeMo's decode: not a gather
    ("aten::topk", "top-k/sort"),
    ("aten::index_add_", "scatter/gather"),
    ("c10d::allreduce_", "communication"),
    ("gloo:all_gather", "communication"),
    ("aten::copy_", "copy/cast"),
    ("aten::sign_", "elementwise"),
    ("DeMo.topk", "top-k/sort"),
])
def test_operators_are_sorted_by_what_they_do(name, kind):
    assert kind_of(name) == kind


@pytest.mark.slow
def test_each_method_is_reported_as_soon_as_it_is_measured(capfd):
    """A run cut short by a time limit (a GPU lease, a job's) still says what it measured: one
    line per method as it finishes, with its time against the baseline, before the table."""
    from step_cost import main

    assert main(["--methods", "demo", "adamw_ddp", "--rounds", "1", "--threads", "2"]) == 0
    out = capfd.readouterr().out
    progress = re.findall(r"^\[step_cost\] (\d)/2 (\w+): ([\d.]+) s/step, ([\d.]+)x adamw_ddp \((\d+) s so far\)$",
                          out, re.MULTILINE)
    assert [(number, name) for number, name, *_ in progress] == [("1", "adamw_ddp"), ("2", "demo")]
    assert progress[0][3] == "1.00"
    assert int(progress[1][4]) >= int(progress[0][4])  # seconds since the worker began, not since a step
    table = out.index("| method |")
    assert all(out.index(f"[step_cost] {n}/2") < table for n in (1, 2))
    assert re.search(rf"^\| demo \| 1 \| {re.escape(progress[1][2])} \|", out, re.MULTILINE)
