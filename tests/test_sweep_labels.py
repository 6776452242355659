"""A sweep labels its own jobs (issue 26): from what varies, or from the sweep file's ``label``
template; two jobs that train different things never share a label; the seed table's baseline is
named or inferred, and checked before anything trains."""

from __future__ import annotations

import textwrap

import pytest

from lowcomm.config.sweep import choose_baseline, load_sweep, plan_sweep
from lowcomm.report.runs import distinct_labels


def _sweep(tmp_path, text: str):
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(text))
    return load_sweep(str(path))


def _labels(sweep) -> list[str]:
    return [plan.run.label for plan in plan_sweep(sweep, check_data_files=False)]


FIVE_JOBS = """\
    base: [experiment=quickstart, train.max_steps=20]
    points:
      - [optimizer=adamw_ddp]
      - overrides: [optimizer=demo]
        grid:
          optimizer.compression_chunk: [16, 32]
          optimizer.compression_topk: [8, 16]
    """


@pytest.mark.slow
def test_jobs_are_labelled_by_what_varies(tmp_path):
    """Before: five jobs labelled 'demo', 'demo', 'demo', 'demo', 'adamw_ddp'."""
    sweep = _sweep(tmp_path, FIVE_JOBS)
    assert _labels(sweep) == ["AdamW-DDP", "DeMo s=16 k=8", "DeMo s=16 k=16", "DeMo s=32 k=8", "DeMo s=32 k=16"]
    assert choose_baseline(sweep, plan_sweep(sweep, check_data_files=False)) == "AdamW-DDP"


@pytest.mark.slow
def test_a_setting_beyond_the_method_name_is_shown_and_seeds_are_not(tmp_path):
    sweep = _sweep(tmp_path, """\
        base: [experiment=quickstart]
        points:
          - [optimizer=diloco, optimizer.sync_every=10]
          - [optimizer=diloco, optimizer.sync_every=50, optimizer.outer_lr=0.5]
          - [optimizer=adamw_ddp]
        grid:
          seed: [0, 1]
        """)
    labels = _labels(sweep)
    # H defines the method as configured: in its label whatever varies (issue 45)
    assert labels == ["DiLoCo H=10", "DiLoCo H=10", "DiLoCo H=50", "DiLoCo H=50", "AdamW-DDP", "AdamW-DDP"]


def test_a_label_template_and_a_points_own_label(tmp_path):
    sweep = _sweep(tmp_path, """\
        base: [experiment=quickstart]
        label: "{name} lr={optimizer.lr}"
        points:
          - [optimizer=adamw_ddp, "label='the reference'"]
          - [optimizer=demo, optimizer.lr=0.001]
          - [optimizer=demo, optimizer.lr=0.002]
        baseline: the reference
        """)
    assert _labels(sweep) == ["the reference", "DeMo lr=0.001", "DeMo lr=0.002"]
    assert choose_baseline(sweep, plan_sweep(sweep, check_data_files=False)) == "the reference"


def test_a_template_naming_a_missing_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"label '\{name\} b=\{optimizer.bogus\}': job 1 has no key 'optimizer.bogus'"):
        _sweep(tmp_path, """\
            points: [[optimizer=demo]]
            label: "{name} b={optimizer.bogus}"
            """)


def test_two_different_jobs_with_one_label_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match=r"jobs 1, 2 are all labelled 'DeMo': give each its own label"):
        _sweep(tmp_path, """\
            points:
              - [optimizer=demo, "label='DeMo'"]
              - [optimizer=demo, optimizer.lr=0.01, "label='DeMo'"]
            """)


@pytest.mark.slow
def test_the_baseline_must_be_a_label_and_is_inferred_only_when_unambiguous(tmp_path):
    sweep = _sweep(tmp_path, FIVE_JOBS)
    planned = plan_sweep(sweep, check_data_files=False)
    with pytest.raises(ValueError, match=r"baseline 'AdamW' is not the label of a job of mine \(did you mean "
                                         r"AdamW-DDP\?\); its labels: 'AdamW-DDP', 'DeMo s=16 k=8'"):
        choose_baseline(sweep, planned, "AdamW")
    assert choose_baseline(sweep, planned, "DeMo s=32 k=8") == "DeMo s=32 k=8"
    demo_only = _sweep(tmp_path, "points: [[optimizer=demo], [optimizer=demo, optimizer.lr=0.01]]\n")
    with pytest.raises(ValueError, match=r"mine has no AdamW-DDP job to compare with: name the baseline "
                                         r"\(baseline: <label> in the sweep file, or --baseline LABEL\)"):
        choose_baseline(demo_only, plan_sweep(demo_only, check_data_files=False))


@pytest.mark.slow
def test_every_shipped_sweep_labels_its_jobs_uniquely():
    from lowcomm.paths import repo_root

    for path in sorted((repo_root() / "sweeps").glob("*.yaml")):
        sweep = load_sweep(str(path))  # raises on a clash
        labels = [next(o for o in reversed(job) if o.startswith("label=")) for job in sweep.jobs]
        trains = [tuple(o for o in job if not o.startswith(("label=", "seed="))) for job in sweep.jobs]
        assert len(set(zip(labels, trains, strict=True))) == len(set(trains)) == len(set(labels)), path.name


@pytest.mark.slow
def test_reports_label_runs_as_the_sweep_did(tmp_path):
    """The label a sweep gives a job is written into its config, which the reports read."""
    sweep = _sweep(tmp_path, FIVE_JOBS)
    configs = [plan.run.raw for plan in plan_sweep(sweep, check_data_files=False)]

    class Run:  # the two things distinct_labels reads of a RunRecord
        def __init__(self, config):
            self.config, self.label = config, config["label"]
            self.path, self.name = tmp_path / "x", "x"

    assert distinct_labels([Run(c) for c in configs]) == _labels(sweep)


def test_lowcomm_sweep_help_documents_every_sweep_file_key():
    """Before: tune and seeds were documented only by the error for a wrong value."""
    from lowcomm.cli.sweep import build_parser
    from lowcomm.config.sweep import POINT_KEYS, SWEEP_KEYS, TUNE_KEYS

    epilog = build_parser().format_help().split("a sweep file (YAML")[1]
    for key in (*SWEEP_KEYS, *POINT_KEYS, *TUNE_KEYS):
        assert f"{key}:" in epilog, key


def test_a_misspelt_sweep_name_gets_a_did_you_mean(capsys):
    from lowcomm.cli.sweep import main

    with pytest.raises(SystemExit):
        main(["run", "table1-1b"])
    assert "no sweep 'table1-1b' (did you mean table1_1b?)" in capsys.readouterr().err


@pytest.mark.slow
def test_status_of_a_local_sweep_shows_labels_and_validation_loss_without_a_slurm_hint(tmp_path, capsys):
    """Before: 'queue not read (...)' for a sweep that never used SLURM, every started run
    'not submitted', and the training loss where the tables show the validation loss."""
    import json

    from lowcomm.cli.sweep import main

    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(FIVE_JOBS))
    overrides = [f"run_root={tmp_path / 'runs'}"]
    planned = plan_sweep(load_sweep(str(path)), overrides, check_data_files=False)
    started = planned[1].run.run_dir
    started.mkdir(parents=True)
    (started / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 10, "train/loss": 4.25}, {"step": 10, "val/loss": 4.5}, {"step": 12, "train/loss": 4.0}]) + "\n")

    assert main(["status", str(path), *overrides]) == 0

    out = capsys.readouterr().out
    assert "sweep mine: 5 runs (1 stopped, 4 not started)" in out
    assert "queue" not in out and "submitted" not in out
    line = next(line for line in out.splitlines() if str(started) in line)
    assert line.split()[:6] == ["stopped", "-", "12/20", "4.5000", "@10", "DeMo"]
    assert "DeMo s=16 k=8" in line
    assert f"stopped runs resume from their last checkpoint: lowcomm-sweep run {path}" in out


def test_one_run_name_for_jobs_that_train_different_things_is_refused(tmp_path):
    """Before: every job after the first was dropped without a word (same run directory)."""
    from lowcomm.config import ConfigError

    sweep = _sweep(tmp_path, """\
        base: [experiment=quickstart, run_name=mine]
        points: [[optimizer=adamw_ddp], [optimizer=demo]]
        """)
    with pytest.raises(ConfigError, match=r"job 2 \(optimizer=demo\): would train in job 1's run directory .*/mine "
                                          r"\(run_name=mine\) although it changes optimizer.name: 'adamw_ddp' -> "
                                          r"'demo'.*give each job its own run_name, or none"):
        plan_sweep(sweep, check_data_files=False)


@pytest.mark.parametrize("overrides, label", [
    (["optimizer=muloco", "compression=quantize"], "MuLoCo 2-bit H=30"),
    (["optimizer=diloco", "optimizer.sync_every=5"], "DiLoCo H=5"),
    (["optimizer=diloco", "compression=quantize", "compression.bits=4"], "DiLoCo 4-bit H=10"),
    (["optimizer=demo", "optimizer.compression_topk=8"], "DeMo s=64 k=8"),
    (["optimizer=adamw_ddp"], "AdamW-DDP"),
])
def test_a_methods_label_carries_its_defining_constants(overrides, label):
    """The bits, H and s/k that define a method as configured are in its label even where no
    other job of the sweep shares its name (issue 45: a lone MuLoCo 2-bit H=10 was "MuLoCo")."""
    from omegaconf import OmegaConf

    from lowcomm.config.compose import compose
    from lowcomm.config.labels import method_label
    assert method_label(OmegaConf.to_container(compose(overrides), resolve=True)) == label
