"""Analysis reads run directories only (issue 26): a sweep trained on token files, its run
directories copied elsewhere (off a cluster, onto a laptop) and the data gone, still builds its
table and figures with ``--sweep``. It used to stop at ``data.paths: no file matches``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from lowcomm.cli.report import loss_vs_mb_main, table1_main
from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.report.select import select_by_sweep
from runs import TINY, train_in_workers

pytestmark = pytest.mark.slow

JOBS = [["optimizer=adamw_ddp"], ["optimizer=demo", "optimizer.compression_topk=4"]]


def test_a_copied_sweep_builds_its_table_and_figures_without_its_data(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, count in (("train.bin", 40_000), ("val.bin", 8_000)):
        rng.integers(0, 257, size=count).astype(np.uint16).tofile(data / name)
    base = [*TINY, "data=memmap", f"data.paths=[{data}/train.bin]", f"data.val_paths=[{data}/val.bin]",
            "cluster.workers=1", "train.max_steps=2", "train.eval_every=2", "train.checkpoint_every=0"]
    sweep = tmp_path / "mine.yaml"
    sweep.write_text(yaml.safe_dump({"description": "two runs on token files", "base": base, "points": JOBS,
                                     "baseline": "AdamW-DDP"}))
    cluster_root = tmp_path / "cluster_runs"
    for job in JOBS:
        train_in_workers(validate(compose([*base, *job, f"run_root={cluster_root}"])))

    laptop_root = tmp_path / "laptop_runs"
    shutil.copytree(cluster_root, laptop_root)
    shutil.rmtree(data)
    shutil.rmtree(cluster_root)

    selection = select_by_sweep(str(sweep), [f"run_root={laptop_root}"])
    assert selection.missing == []
    assert sorted(run.optimizer for run in selection.runs) == ["adamw_ddp", "demo"]
    assert all(Path(run.path).is_relative_to(laptop_root) for run in selection.runs)

    out = tmp_path / "figures"
    assert table1_main(["--sweep", str(sweep), "--run-root", str(laptop_root), "--no-paper", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "AdamW-DDP" in table and "DeMo" in table
    assert loss_vs_mb_main(["--sweep", str(sweep), "--run-root", str(laptop_root), "--out", str(out),
                            "--formats", "png"]) == 0
    assert (out / "table1.md").is_file() and list(out.glob("*.png"))

    # The sweep file as written for the cluster (no data, the full budget), without the overrides
    # it ran with here: each job's run is the one whose recorded config sets what the job sets.
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump({"base": ["experiment=paper_ablation_300m"], "points": JOBS}))
    found = select_by_sweep(str(cluster_file), [f"run_root={laptop_root}", "experiment_name=default"])
    assert found.missing == [] and [run.path for run in found.runs] == [run.path for run in selection.runs]
    (header, *listed) = found.found_lines(verbose=True)
    assert header.startswith("note: 2 jobs found by their runs' recorded configs") and "data.paths" in header
    assert found.found_lines() == [header.replace("they ran with; ", "they ran with; --verbose lists them; ")]
    assert listed == [f"  job {number} ({run.label}: {' '.join(job)}): {run.path}"
                      for number, (job, run) in enumerate(zip(JOBS, found.runs, strict=True), start=1)]
    assert select_by_sweep(str(sweep), [f"run_root={laptop_root}"]).found_by_config == []  # exact: nothing to say

    # two runs that set what job 2 sets: neither is guessed
    demo = next(run.path for run in found.runs if run.optimizer == "demo")
    shutil.copytree(demo, demo.with_name(demo.name + "-copy"))
    ambiguous = select_by_sweep(str(cluster_file), [f"run_root={laptop_root}", "experiment_name=default"])
    assert [run.optimizer for run in ambiguous.runs] == ["adamw_ddp"]
    (missing,) = ambiguous.missing
    assert "2 runs in" in missing and "job 2 (DeMo s=64 k=4: optimizer=demo optimizer.compression_topk=4)" in missing
