"""The commands a newcomer meets first: quick, descriptive help, and one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lowcomm.cli.eval import TASK_NAMES

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]

PROBE = """
import importlib, sys
module, function = sys.argv[1].split(":")
try:
    getattr(importlib.import_module(module), function)(["--help"])
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
heavy = sorted(name for name in ("torch", "lm_eval", "matplotlib", "olmo", "hydra") if name in sys.modules)
print("HEAVY:" + ",".join(heavy))
"""


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_answers_without_loading_the_library(script):
    """--help must not pay for torch, lm-eval or matplotlib (6-21 s on a laptop before)."""
    result = subprocess.run([sys.executable, "-c", PROBE, SCRIPTS[script]], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"usage: {script}" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "HEAVY:"


def test_train_help_lists_the_groups_their_options_and_examples(capsys):
    from lowcomm.cli.train import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "config groups" in text and "examples:" in text
    for group, option in [("optimizer", "demo"), ("model", "olmo_1b"), ("cluster", "slurm_64gpu"),
                          ("data", "memmap")]:
        line = next(line for line in text.splitlines() if line.strip().startswith(group + " "))
        assert option in line


def test_the_eval_task_names_are_the_task_registry():
    from lowcomm.eval.tasks import TASKS

    assert TASK_NAMES == tuple(TASKS)


def test_the_comm_table_command_covers_the_tables_models():
    from lowcomm.cli.comm_table import MODELS
    from lowcomm.report import comm_table

    assert MODELS == comm_table.MODELS


def test_train_cfg_prints_the_config_as_it_would_run_with_overrides_on_both_sides(capsys, tmp_path):
    from lowcomm.cli.train import main

    assert main(["train.max_steps=5", "--cfg", "optimizer=demo", f"run_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 5" in out and "warmup_steps: 0" in out and "name: demo" in out
    assert list(tmp_path.iterdir()) == []


def _help_of(entry: str, *args: str) -> str:
    module, function = entry.split(":")
    result = subprocess.run([sys.executable, "-c", f"import sys; from {module} import {function} as m; m(sys.argv[1:])",
                             *args, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("command", [*([script] for script in sorted(SCRIPTS)),
                                     *(["lowcomm-sweep", sub] for sub in ("run", "submit", "status", "list"))],
                         ids=" ".join)
def test_help_is_plain_text_not_restructuredtext(command):
    """Help texts built from docstrings showed ``lowcomm-comm-table`` and :mod:`...` (issue 26)."""
    text = _help_of(SCRIPTS[command[0]], *command[1:])
    assert not re.search(r"``|:(mod|func|class|data|attr|meth):`", text), text


def test_plain_keeps_what_the_markup_named():
    from lowcomm.cli.helptext import plain

    assert plain("``lowcomm-x --a`` see :mod:`lowcomm.report` and :func:`~lowcomm.launch.plan_job`") == (
        "lowcomm-x --a see lowcomm.report and plan_job")
