"""The documentation's command blocks that run in minutes here are run, so the README and the
guides cannot drift from the code. A block opts in with the line ``<!-- readme-test: ... -->``
just above its opening fence. The marked blocks of the pages in :data:`PAGES` run in that order
(the README first, then the guides in the order listed) in one shell, so a variable set in one
block (``$DATA``, ``$MINE``) is seen by every later one, from the repository root with
``.venv/bin`` first on the PATH.

The rest is instant: every relative link and ``#anchor`` of the README and the guides resolves,
and the README stays a front page (at most :data:`README_MAX_LINES` lines, no dated measurement:
those live under ``results/``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- readme-test"
# The pages whose marked blocks run, in this order, in one shell. The README's blocks define
# $DATA before they use it; docs/sweeps-and-slurm.md defines it again before its own use, so each
# page's blocks stand on their own.
PAGES = ("README.md", "docs/sweeps-and-slurm.md", "docs/byte-accounting.md", "docs/evaluation.md")
README_MAX_LINES = 300


def marked_blocks(text: str) -> list[str]:
    blocks = re.findall(rf"^{re.escape(MARKER)}[^\n]*\n```bash\n(.*?)^```", text, flags=re.M | re.S)
    return [block.strip() for block in blocks]


def documented_pages() -> list[Path]:
    """The README and every guide in docs/: the pages whose links are checked."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_marker_finds_blocks():
    text = f"intro\n{MARKER} -->\n```bash\necho one\n```\n```bash\necho unmarked\n```\n"
    assert marked_blocks(text) == ["echo one"]


def test_every_page_with_marked_blocks_is_run_and_every_listed_page_has_some():
    with_blocks = {str(page.relative_to(REPO)) for page in documented_pages() if marked_blocks(page.read_text())}
    assert with_blocks == set(PAGES), "a page with marked blocks is missing from PAGES (or one in it has none)"


@pytest.mark.slow
def test_the_readme_commands_run_as_written():
    blocks = [block for page in PAGES for block in marked_blocks((REPO / page).read_text())]
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
    assert "note: 5 jobs found by their runs' recorded configs" in result.stderr
    assert "  job 1 (" not in result.stderr  # one line, the jobs on request (--verbose; issue 45)
    assert "| tiny | DeMo s=64 k=2 |" in result.stdout and "loss_vs_mb.png" in result.stdout
    # lowcomm-eval on the tiny run: the label and chance row, then the rerun's reuse, then --force
    assert "AdamW-DDP" in result.stdout and "chance: the accuracy of a uniform guess" in result.stdout
    assert "2 to compute, 0 reused" in result.stderr and "0 to compute, 2 reused" in result.stderr
    assert "reused arc_easy, piqa of " in result.stderr and "(--force: nothing reused)" in result.stderr


# ------------------------------------------------------------------ links, anchors, the front page

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> str:
    """The text without code: fenced blocks and inline code hold no links (and a ``#`` line in a
    shell block is no heading)."""
    return INLINE_CODE.sub("code", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but hyphens and
    underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every ``#anchor`` a heading of ``page`` makes (a repeated heading gets -1, -2, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """``page: target (why)`` for every relative link of ``page`` that does not resolve: a path
    that is no file or directory relative to the page, or an ``#anchor`` that no heading of the
    (Markdown) page it points into makes."""
    broken = []
    where = page.relative_to(REPO) if page.is_relative_to(REPO) else page.name
    for target in LINK.findall(prose(page.read_text())):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, fragment = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{where}: {target} (no such file or directory)")
        elif fragment and linked.is_file() and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{where}: {target} (no heading makes #{fragment} in {linked.name})")
    return broken


def test_every_relative_link_and_anchor_in_the_readme_and_the_guides_resolves():
    pages = documented_pages()
    assert len(pages) > 5, "docs/ lost its guides"
    assert [problem for page in pages for problem in broken_links(page)] == []


def test_every_relative_link_in_the_results_analysis_and_slurm_pages_resolves():
    pages = [*sorted((REPO / "results").rglob("README.md")), REPO / "analysis" / "README.md", REPO / "slurm" / "README.md"]
    assert (REPO / "results" / "README.md") in pages
    assert [problem for page in pages for problem in broken_links(page)] == []


def test_the_link_check_sees_a_missing_file_a_missing_anchor_and_ignores_code(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `lowcomm-sweep` dry run: costs\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n"
                    "[fine](other.md) [fine](other.md#the-lowcomm-sweep-dry-run-costs) [fine](#page) "
                    "![fine](other.md) [web](https://example.org/nowhere.md) [dir](.)\n"
                    "[gone](missing.md) ![gone](img/missing.png) [bad anchor](other.md#nowhere) [here](#nothing)\n"
                    "`[in code](missing-in-code.md)`\n```bash\n# [in a fence](missing-in-fence.md)\n```\n")
    assert broken_links(page) == [
        "page.md: missing.md (no such file or directory)",
        "page.md: img/missing.png (no such file or directory)",
        "page.md: other.md#nowhere (no heading makes #nowhere in other.md)",
        "page.md: #nothing (no heading makes #nothing in page.md)",
    ]


def test_github_slugs():
    assert slug("5. Preemption, time limits and lost nodes") == "5-preemption-time-limits-and-lost-nodes"
    assert slug("The paper's claim on a laptop: `table1_tiny`") == "the-papers-claim-on-a-laptop-table1_tiny"
    assert slug("AdamW-DDP") == "adamw-ddp"


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_readme_holds_no_dated_measurement():
    dated = [line for line in (REPO / "README.md").read_text().splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert dated == [], "dated measurements belong on a page under results/, linked in one line"
