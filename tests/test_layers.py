"""The layering of the README's "What is where" table, as the imports have it.

`make lint` runs import-linter over the contract in pyproject.toml (which layer may import
which). This file adds what import-linter cannot say: no module outside the entry points
hides a lowcomm import inside a function, and the contract itself fails on a violation.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lowcomm"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# Entry points may import late so that `--help` answers without loading torch.
ENTRY_POINTS = PACKAGE / "cli"


def function_level_lowcomm_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            names = []
            if isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                names = [inner.module]
            elif isinstance(inner, ast.ImportFrom) and inner.level > 0:
                names = [f"(relative) {inner.module}"]
            elif isinstance(inner, ast.Import):
                names = [alias.name for alias in inner.names]
            found += [f"{path.relative_to(PACKAGE.parent)}:{inner.lineno} imports {name} inside {node.name}()"
                      for name in names if name.startswith(("lowcomm", "(relative)"))]
    return found


def test_no_lowcomm_import_hides_inside_a_function_outside_the_entry_points():
    modules = [p for p in PACKAGE.rglob("*.py") if ENTRY_POINTS not in p.parents]
    assert len(modules) > 50
    offenders = [line for path in modules for line in function_level_lowcomm_imports(path)]
    assert offenders == []


def test_the_checker_sees_a_hidden_import(tmp_path):
    module = tmp_path / "lowcomm" / "x.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from lowcomm.train import loop\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "lowcomm"
    try:
        assert function_level_lowcomm_imports(module) == ["lowcomm/x.py:2 imports lowcomm.train inside f()"]
    finally:
        PACKAGE = saved


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency")
def test_the_layer_contract_holds_and_catches_an_upward_import(tmp_path):
    repo = PACKAGE.parents[1]
    kept = subprocess.run([str(LINT_IMPORTS)], cwd=repo, capture_output=True, text=True)
    assert kept.returncode == 0, kept.stdout + kept.stderr

    # A copy of the package in which the communicator imports the training loop must fail.
    copy = tmp_path / "src"
    shutil.copytree(PACKAGE, copy / "lowcomm", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "lowcomm" / "comm" / "upward.py").write_text("import lowcomm.train.loop  # noqa\n")
    config = (repo / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(config[config.index("[tool.importlinter]"):])
    broken = subprocess.run([str(LINT_IMPORTS)], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert broken.returncode != 0
    assert "lowcomm.comm.upward -> lowcomm.train.loop" in textwrap.dedent(broken.stdout)
