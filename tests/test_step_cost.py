"""benchmarks/step_cost.py's split of a step's operator time by kind, on names the profiler
reports for lowcomm's steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_cost import kind_of  # noqa: E402  (a benchmark script, not a package)


@pytest.mark.parametrize(("name", "kind"), [
    ("aten::mm", "matmul"),
    ("aten::baddbmm_", "matmul"),
    ("lowcomm::block_topk", "top-k/sort"),  # "lowcomm" holds "mm": the namespace is not the op
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
