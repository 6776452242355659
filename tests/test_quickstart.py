"""The main job's driver: every point of the quickstart sweep validates, and a reduced sweep
runs end to end into a table and figures whose numbers are the runs' own."""

from __future__ import annotations

import csv
import json

import pytest

from lowcomm.cli.quickstart import main
from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep
from runs import micro_sweep_overrides


@pytest.mark.slow
def test_every_quickstart_run_validates_with_a_distinct_run_name():
    sweep = load_sweep("quickstart")
    runs = [validate(compose(job)) for job in sweep.jobs]
    assert len({run.run_name for run in runs}) == len(runs) >= 5
    assert all(run.experiment == "quickstart" and run.world_size == 4 for run in runs)
    assert all(run.raw["label"] for run in runs)


@pytest.mark.slow
@pytest.mark.usefixtures("forked_launches")  # the drivers are under test, not the launcher
def test_a_reduced_quickstart_writes_the_table_and_figures(tmp_path, capsys):
    sweep = tmp_path / "mini.yaml"
    sweep.write_text(
        "base: [experiment=quickstart]\n"
        "points:\n"
        "  - [optimizer=adamw_ddp, \"label='AdamW-DDP'\"]\n"
        "  - [optimizer=demo, optimizer.compression_topk=4, \"label='DeMo k=4'\"]\n"
    )
    out = tmp_path / "out"
    overrides = [*micro_sweep_overrides(tmp_path / "runs"), "train.max_steps=4", "train.warmup_steps=1",
                 "train.eval_every=2", "train.log_every=2"]
    assert main(["--sweep", str(sweep), "--out", str(out), "--eval-limit", "2", *overrides]) == 0
    printed = capsys.readouterr().out
    for name in ("summary.md", "summary.csv", "loss_vs_step.png", "loss_vs_cum_MB.png", "loss_vs_mb.png"):
        assert (out / name).is_file() and str(out / name) in printed

    rows = {row["label"]: row for row in csv.DictReader((out / "summary.csv").open())}
    assert set(rows) == {"AdamW-DDP", "DeMo k=4"}
    for run_dir in (tmp_path / "runs" / "quickstart").iterdir():
        summary = json.loads((run_dir / "summary.json").read_text())
        row = rows["AdamW-DDP" if summary["optimizer"] == "adamw_ddp" else "DeMo k=4"]
        assert float(row["final_val_loss"]) == summary["final_val_loss"]
        assert float(row["payload_MB_per_step"]) == summary["payload_MB_per_step"]
        evaluation = json.loads((run_dir / "eval" / "step_000000004.json").read_text())
        assert float(row["piqa_acc_norm"]) == evaluation["tasks"]["piqa"]["acc_norm"]
        # an accuracy is never without its standard error and its n
        assert float(row["piqa_acc_norm_stderr"]) == evaluation["tasks"]["piqa"]["acc_norm_stderr"]
        assert row["piqa_acc_norm_n"] == "2"
    assert float(rows["DeMo k=4"]["payload_MB_per_step"]) < float(rows["AdamW-DDP"]["payload_MB_per_step"]) / 10
    table = (out / "summary.md").read_text()
    assert table.count(", n=2 |") == 2 * 3 and " ± " in table

    # By default the benchmarks are left out (chance on this model), even for evaluated runs.
    assert main(["--sweep", str(sweep), "--out", str(tmp_path / "default"), *overrides]) == 0
    assert "PIQA" not in (tmp_path / "default" / "summary.md").read_text()
    assert "final val loss" in (tmp_path / "default" / "summary.md").read_text()
