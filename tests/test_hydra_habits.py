"""Hydra's habits in lowcomm-train (issue 26): a comma list or ``-m`` is answered with the sweep
file that runs it, written out; a key given without its section names the key it belongs to."""

from __future__ import annotations

import re

import pytest

from lowcomm.cli.train import main as train_main
from lowcomm.config import ConfigError
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep


def _suggested_sweep(message: str, tmp_path):
    """The sweep file a message says to write, written, and loaded as lowcomm-sweep would."""
    match = re.search(r"write a sweep file holding (\{.*\}) and run lowcomm-sweep run FILE", message)
    assert match, message
    path = tmp_path / "suggested.yaml"
    path.write_text(match.group(1) + "\n")
    return load_sweep(str(path))


@pytest.mark.parametrize("argv", [
    ["optimizer=demo,adamw_ddp", "train.max_steps=50"],
    ["-m", "optimizer=demo,adamw_ddp", "train.max_steps=50"],
    ["train.max_steps=50", "optimizer=demo,adamw_ddp", "--multirun"],
])
def test_a_comma_list_is_answered_with_the_sweep_file_that_runs_it(argv, tmp_path, capsys):
    """Before: `configs/optimizer/ChoiceSweep(tags=set(), list=[...]).yaml does not exist`, and
    `unrecognized arguments: -m`."""
    try:
        code = train_main(argv)
    except SystemExit as exited:  # -m: refused while parsing the command line
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert "ChoiceSweep" not in err and "unrecognized" not in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "sweep" in line]) == 1
    flags = [arg for arg in argv if arg.startswith("-")]
    if flags:  # the flag the user gave is named (issue 45)
        assert err.startswith(f"lowcomm-train: {flags[0]} (Hydra's multirun) is not lowcomm's: "), err
    sweep = _suggested_sweep(err, tmp_path)
    assert [[o for o in job if not o.startswith("label=")] for job in sweep.jobs] == [
        ["train.max_steps=50", "optimizer=demo"], ["train.max_steps=50", "optimizer=adamw_ddp"]]


def test_a_grid_over_two_keys_is_counted_and_written_whole(tmp_path):
    with pytest.raises(ConfigError) as refused:
        compose(["optimizer=demo", "optimizer.lr=0.1,0.01", "seed=0,1"])
    (message,) = refused.value.errors  # said once, not once per comma list
    assert message.startswith("optimizer.lr=0.1,0.01 seed=0,1 is a sweep of 4 runs and lowcomm-train runs one")
    assert len(_suggested_sweep(message, tmp_path).jobs) == 4


def test_minus_m_alone_points_to_lowcomm_sweep(capsys):
    with pytest.raises(SystemExit) as exited:
        train_main(["-m"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "lowcomm-train: there is no -m / --multirun: lowcomm-train runs one config; for several, write a sweep "
        "file (base: [...], points: or grid: {key: [values]}) and run lowcomm-sweep run FILE "
        "(lowcomm-sweep submit FILE --dry-run for SLURM)")


@pytest.mark.parametrize("override, meant", [
    ("compression_topk=8", "optimizer.compression_topk (a key of optimizer=demo or distro or flexdemo)"),
    ("max_steps=3", "train.max_steps (a key of train)"),
    ("lr=0.1", "optimizer.lr (a key of every optimizer)"),
])
def test_a_key_without_its_section_names_the_key_it_belongs_to(override, meant):
    """Before: `compression_topk=8` suggested `compression`, a group that has no such key."""
    with pytest.raises(ConfigError) as refused:
        compose([override])
    (message,) = refused.value.errors
    assert f"did you mean {meant}?" in message
    key = meant.split(" ")[0]
    compose(["optimizer=demo", f"{key}={override.split('=')[1]}"])  # the key it names exists


def test_a_comma_list_on_the_sweep_command_line_is_one_line_not_one_per_job(capsys):
    """The command line's overrides go to every job: a list there was the same 500-character
    message once per job (8 for the quickstart; issue 45). Said once, with the grid that does it."""
    from lowcomm.cli.sweep import main as sweep_main
    with pytest.raises(SystemExit) as exited:
        sweep_main(["run", "quickstart", "optimizer.lr=0.001,0.002", "seed=3"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "lowcomm-sweep: optimizer.lr=0.001,0.002 on the command line is a list of values, but the command line's "
        "overrides go to every job of the sweep alike: to run each job with each value, add "
        "grid: {optimizer.lr: [0.001, 0.002]} to the sweep file")


@pytest.mark.parametrize("flag", ["-m", "--multirun"])
def test_minus_m_to_lowcomm_sweep_is_named_and_answered(flag, capsys):
    from lowcomm.cli.sweep import main as sweep_main
    with pytest.raises(SystemExit) as exited:
        sweep_main(["submit", "quickstart", flag, "--dry-run"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lowcomm-sweep: {flag} (Hydra's multirun) is not needed: lowcomm-sweep runs every job of "
                          "the sweep file") and "unrecognized" not in err
