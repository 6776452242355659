"""The README's command blocks that run in minutes here are run, so the README cannot drift
from the code. A block opts in with the line ``<!-- readme-test: ... -->`` just above its
opening fence; the marked blocks run in order in one shell (a variable set in one is seen by
the next), from the repository root with ``.venv/bin`` first on the PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- readme-test"


def marked_blocks(text: str) -> list[str]:
    blocks = re.findall(rf"^{re.escape(MARKER)}[^\n]*\n```bash\n(.*?)^```", text, flags=re.M | re.S)
    return [block.strip() for block in blocks]


def test_the_marker_finds_blocks():
    text = f"intro\n{MARKER} -->\n```bash\necho one\n```\n```bash\necho unmarked\n```\n"
    assert marked_blocks(text) == ["echo one"]


@pytest.mark.slow
def test_the_readme_commands_run_as_written():
    blocks = marked_blocks((REPO / "README.md").read_text())
    assert len(blocks) >= 3, "the README lost its tested command blocks"
    script = "set -euo pipefail\n" + "\n".join(blocks) + "\n"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "USER": os.environ.get("USER", "lowcomm")}
    result = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"README commands failed:\n{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "dry run: nothing submitted" in result.stdout
    # the dry run's table and totals, and --only 11 --show-script: one job's batch script and srun line
    assert "total: 11 jobs, " in result.stdout and " at the peak (keep_checkpoints + 1 each)" in result.stdout
    assert "sweep table1_1b: 11 jobs, 1 selected (--only)" in result.stdout
    assert "      #SBATCH --nodes=8" in result.stdout and "    srun        srun --unbuffered" in result.stdout
    assert "DeMo s=64 k=8" in result.stdout  # the comm table's rows
    # step 7, a sweep of one's own: run here (seeds grouped), planned for the cluster, analysed from
    # a copy of its run directories without the data or the overrides it ran with
    assert "[my_sweep] 3 groups of 1 to 2 seeds, 5 runs" in result.stdout
    assert "| 1 seed: no verdict |" in result.stdout and "| baseline |" in result.stdout
    assert "total: 5 jobs, " in result.stdout and "sweep my_sweep: 5 jobs, 1 selected (--only)" in result.stdout
    assert "5 jobs found by their runs' recorded configs" in result.stderr
    assert "| tiny | DeMo s=64 k=2 |" in result.stdout and "loss_vs_mb.png" in result.stdout
    # lowcomm-eval on the tiny run: the label and chance row, then the rerun's reuse, then --force
    assert "AdamW-DDP" in result.stdout and "chance: the accuracy of a uniform guess" in result.stdout
    assert "2 to compute, 0 reused" in result.stderr and "0 to compute, 2 reused" in result.stderr
    assert "reused arc_easy, piqa of " in result.stderr and "(--force: nothing reused)" in result.stderr
