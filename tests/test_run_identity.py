"""A run directory holds one run: a launch under an explicit run_name whose config changes what
is trained is refused, naming each change, before anything is written; a resume never rewrites
config.yaml, the record of the run."""

from __future__ import annotations

import pytest

from lowcomm.config import ConfigError
from lowcomm.launch.local import RESUME_CONFIG, prepare_run_dir
from runs import tiny_run


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


def test_a_resume_that_changes_only_logistics_keeps_the_record_and_gives_the_workers_its_own(tmp_path):
    first = tiny_run(tmp_path, "run_name=mine")
    config = prepare_run_dir(first)
    recorded = config.read_bytes()
    assert prepare_run_dir(first) == config  # the same launch again: the same file, untouched
    resumed = tiny_run(tmp_path, "run_name=mine", "train.log_every=5", "train.checkpoint_every=3")
    given = prepare_run_dir(resumed)
    assert given == first.run_dir / RESUME_CONFIG and "log_every: 5" in given.read_text()
    assert config.read_bytes() == recorded
