"""A run directory holds one run: a launch under an explicit run_name whose config changes what
is trained is refused, naming each change, before anything is written; a resume never rewrites
config.yaml, the record of the run."""

from __future__ import annotations

import pytest

from lowcomm.config import ConfigError
from lowcomm.launch.local import RESUME_CONFIG, launch_local, prepare_run_dir
from lowcomm.rundir import RunDir
from runs import tiny_run, train_in_workers


def test_a_changed_config_under_an_explicit_run_name_is_refused_naming_the_changes(tmp_path):
    first = tiny_run(tmp_path, "run_name=mine", "optimizer.lr=0.0004", "seed=0")
    config = prepare_run_dir(first)
    recorded = config.read_bytes()
    changed = tiny_run(tmp_path, "run_name=mine", "optimizer.lr=0.1", "seed=7")
    with pytest.raises(ConfigError) as refused:
        prepare_run_dir(changed)
    message = str(refused.value)
    assert "optimizer.lr: 0.0004 -> 0.1" in message and "seed: 0 -> 7" in message
    assert "Choose another run_name" in message
    assert config.read_bytes() == recorded  # nothing rewritten
    other = tiny_run(tmp_path, "run_name=mine", "optimizer=demo")
    with pytest.raises(ConfigError, match="optimizer.name: 'adamw_ddp' -> 'demo'"):
        prepare_run_dir(other)


@pytest.mark.slow
def test_a_finished_run_under_the_run_name_is_no_answer_for_a_changed_config(tmp_path, capsys):
    """Before: "mine is complete ...; nothing to do" and exit 0, for a config never trained."""
    first = tiny_run(tmp_path, "run_name=mine", "optimizer.lr=0.0004", workers=1, max_steps=2)
    train_in_workers(first)
    assert RunDir(first.run_dir).summary.is_file()
    with pytest.raises(ConfigError, match=r"holds another run \(run_name=mine\); this config changes optimizer.lr: "
                                          r"0.0004 -> 0.1"):
        launch_local(tiny_run(tmp_path, "run_name=mine", "optimizer.lr=0.1", workers=1, max_steps=2))
    capsys.readouterr()
    launch_local(first)  # the same config: finished, nothing to do
    assert "is complete" in capsys.readouterr().out


def test_a_resume_that_changes_only_logistics_keeps_the_record_and_gives_the_workers_its_own(tmp_path):
    first = tiny_run(tmp_path, "run_name=mine")
    config = prepare_run_dir(first)
    recorded = config.read_bytes()
    assert prepare_run_dir(first) == config  # the same launch again: the same file, untouched
    resumed = tiny_run(tmp_path, "run_name=mine", "train.log_every=5", "train.checkpoint_every=3")
    given = prepare_run_dir(resumed)
    assert given == first.run_dir / RESUME_CONFIG and "log_every: 5" in given.read_text()
    assert config.read_bytes() == recorded
