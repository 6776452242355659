"""benchmarks/step_cost.py: every optimizer's step timed, and where its time goes (the split is
benchmarks/profiles.py's, tested in test_profiles.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


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
    # the phases: a column per kind some method ran and the time outside operators, each row 100 %
    header = next(line for line in out.splitlines() if line.startswith("| method |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")][5:]
    assert "DCT kernels" in columns and "elementwise" in columns and columns[-1] == "outside operators (Python, autograd, waits)"
    for name in ("adamw_ddp", "demo"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        shares = [float(cell.strip().rstrip("%")) for cell in row.strip("|").split("|")[5:]]
        assert len(shares) == len(columns)
        assert sum(shares) == pytest.approx(100, abs=len(shares))  # each share rounded to a whole percent
