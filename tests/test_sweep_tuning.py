"""The tuning phase of two-phase sweeps: the choice of a value (never a diverged run) and the
widening of the grid, one factor of 2 at a time, where the best sits at an edge, as the pure
planning functions on made-up losses; then ``lowcomm-sweep run`` with a stand-in for training
that writes each run's summary from a made-up loss landscape (no training, seconds)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from lowcomm.cli import sweep as sweep_cli
from lowcomm.config.sweep import (
    TuningDiverged,
    best_value,
    load_sweep,
    tuning_job,
    tuning_jobs,
    tuning_step,
)
from lowcomm.launch import local
from lowcomm.report.seeds import grid_table
from lowcomm.rundir import RunDir
from runs import micro_sweep_overrides

GRID = [0.003, 0.006, 0.012]  # 0.5x, 1x, 2x of 6e-3


def bowl(optimum: float) -> Callable[[float], float]:
    """A loss with its minimum at ``optimum``, symmetric in log2(lr)."""
    return lambda lr: 3.0 + math.log2(lr / optimum) ** 2


def tune(loss: Callable[[float], float], grid: list[float] = GRID, widen: int = 2):
    """What ``lowcomm-sweep run`` does for one job: the grid, then each next value asked for."""
    losses = {value: loss(value) for value in grid}
    while (step := tuning_step(losses, grid, widen)).next is not None:
        losses[step.next] = loss(step.next)
    return step, sorted(losses)


# ----------------------------------------------------------------------------------- widening


def test_an_optimum_inside_the_grid_is_chosen_without_widening():
    step, tried = tune(bowl(0.007))
    assert (step.best, step.next, step.edge, step.at_edge) == (0.006, None, None, False)
    assert tried == GRID
    assert step.edge_note("optimizer.lr", 2) == ""


@pytest.mark.parametrize(("optimum", "best", "tried"), [
    (0.0025, 0.003, [0.0015, *GRID]),            # one step down is worse: the grid turned at once
    (0.0015, 0.0015, [0.00075, 0.0015, *GRID]),  # better at / 2, worse at / 4
])
def test_a_best_at_the_low_edge_widens_down_until_it_turns(optimum, best, tried):
    step, seen = tune(bowl(optimum))
    assert (step.best, step.at_edge) == (best, False)
    assert seen == tried


def test_a_best_at_the_high_edge_widens_up_until_it_turns():
    losses = {value: bowl(0.03)(value) for value in GRID}
    first = tuning_step(losses, GRID)
    assert (first.best, first.edge, first.widened, first.next) == (0.012, "highest", 0, 0.024)
    step, seen = tune(bowl(0.03))
    assert (step.best, step.at_edge) == (0.024, False)
    assert seen == [*GRID, 0.024, 0.048]


@pytest.mark.parametrize(("loss", "edge", "best", "tried"), [
    (lambda lr: 3.0 + lr, "lowest", 0.00075, [0.00075, 0.0015, *GRID]),
    (lambda lr: 3.0 - lr, "highest", 0.048, [*GRID, 0.024, 0.048]),
])
def test_a_best_still_at_the_edge_after_the_limit_is_reported(loss, edge, best, tried):
    step, seen = tune(loss)
    assert seen == tried  # two widenings on that side, no more
    assert (step.best, step.next, step.edge, step.widened, step.at_edge) == (best, None, edge, 2, True)
    note = step.edge_note("optimizer.lr", 2)
    assert note.startswith(f"still at the edge after 2 widenings: lr={best:.3g}, the {edge} tried")
    assert note.endswith("below" if edge == "lowest" else "above")
    one, _ = tune(loss, widen=1)
    assert one.edge_note("optimizer.lr", 1).startswith("still at the edge after 1 widening: lr=")


def test_widen_0_is_the_old_behaviour_the_grid_and_its_lowest_loss():
    for loss in (lambda lr: 3.0 + lr, bowl(0.007), bowl(0.03)):
        step, seen = tune(loss, widen=0)
        losses = {value: loss(value) for value in GRID}
        assert seen == GRID and step.next is None
        assert step.best == min(losses, key=losses.get)
    step, _ = tune(lambda lr: 3.0 + lr, widen=0)
    assert step.at_edge and step.edge_note("optimizer.lr", 0).startswith(
        "at the edge of the grid, not widened (tune.widen: 0): lr=0.003")


# --------------------------------------------------------------------------- diverged runs


@pytest.mark.parametrize("diverged", [math.nan, math.inf, None])
def test_a_diverged_run_is_never_chosen_wherever_it_stands(diverged):
    losses = {0.003: diverged, 0.006: 3.0, 0.012: 3.1}
    if diverged is not None and math.isnan(diverged):
        assert min(losses, key=losses.get) == 0.003  # what a plain min did: nan compares false
    assert best_value(losses) == 0.006
    assert best_value({0.012: 3.1, 0.006: 3.0, 0.003: diverged}) == 0.006


def test_a_tie_chooses_the_smaller_value_whatever_the_order():
    assert best_value({0.012: 3.0, 0.006: 3.0, 0.003: 3.2}) == 0.006


def test_every_run_of_a_job_diverged_is_an_error_naming_the_job():
    with pytest.raises(TuningDiverged, match=r"job 3 \(DeMo k=1\): every tuning run diverged \(0.003: nan"):
        tuning_step({0.003: math.nan, 0.006: math.inf, 0.012: math.nan}, GRID, job="job 3 (DeMo k=1)")


def test_the_grid_never_widens_toward_a_diverged_side():
    # The low edge diverged and the best is the highest: widen up, not down.
    step = tuning_step({0.003: math.nan, 0.006: 3.0, 0.012: 2.9}, GRID)
    assert (step.best, step.edge, step.next) == (0.012, "highest", 0.024)
    # Everything but the lowest diverged: widen away from them, down.
    assert tuning_step({0.003: 3.0, 0.006: math.nan, 0.012: math.inf}, GRID).next == 0.0015
    # A widened value that diverged bounds its side: the best is bracketed, the choice final.
    step = tuning_step({0.003: 3.1, 0.006: 3.0, 0.012: 2.9, 0.024: math.inf}, GRID)
    assert (step.best, step.next, step.at_edge) == (0.012, None, False)


def test_the_grid_table_bolds_the_choice_and_never_a_diverged_run():
    table = grid_table({"DeMo k=1": {0.003: math.nan, 0.006: 3.0, 0.0015: 3.2}})
    assert table.splitlines()[-1] == "| DeMo k=1 | 0.0015: 3.2000, 0.003: nan, **0.006: 3.0000** |"
    assert "**0.0015: 3.2000**" in grid_table({"x": {0.0015: 3.2, 0.006: 3.0}}, {"x": 0.0015})


# ----------------------------------------------------------------------------- the sweep file


def _sweep_file(tmp_path, tune: str, name: str = "s.yaml"):
    path = tmp_path / name
    path.write_text("base: [experiment=quickstart, train.max_steps=4, train.warmup_steps=null, train.eval_every=2,\n"
                    "       train.log_every=2, train.checkpoint_every=0]\n"
                    "points:\n"
                    "  - [optimizer=adamw_ddp, optimizer.lr=6e-3, \"label='AdamW-DDP'\"]\n"
                    "  - [optimizer=demo, optimizer.lr=6e-3, optimizer.compression_topk=4, \"label='DeMo k=4'\"]\n"
                    f"tune: {tune}\nseeds: [0, 1]\n")
    return path


@pytest.mark.parametrize("widen", ["-1", "1.5", "true", "two", "null"])
def test_a_bad_widen_is_named(tmp_path, widen):
    path = _sweep_file(tmp_path, f"{{key: optimizer.lr, factors: [0.5, 1], widen: {widen}}}")
    with pytest.raises(ValueError, match=r"tune.widen: give how many factors of 2 .* got"):
        load_sweep(str(path))


def test_widen_defaults_to_2_and_a_widened_run_is_named_like_the_grids(tmp_path):
    sweep = load_sweep(str(_sweep_file(tmp_path, "{key: optimizer.lr, factors: [0.5, 1], overrides: [train.max_steps=2]}")))
    assert sweep.tune.widen == 2
    assert load_sweep(str(_sweep_file(tmp_path, "{key: optimizer.lr, factors: [0.5, 1], widen: 0}"))).tune.widen == 0
    first = tuning_jobs(sweep)
    # the same overrides in the same order, so a widened run's directory sits beside the grid's
    assert tuning_job(sweep, 1, 0.003) == first[2]
    assert tuning_job(sweep, 0, 0.0015).overrides == [*first[0].overrides[:-2], "optimizer.lr=0.0015", "seed=0"]


# ------------------------------------------------------------- lowcomm-sweep run, no training

LANDSCAPES = {"AdamW-DDP": bowl(0.003),  # better one step down, worse two steps down
              "DeMo k=4": lambda lr: 3.0 - lr}  # keeps improving upward: still at the edge


@pytest.fixture
def stand_in(monkeypatch):
    """``launch_local`` replaced by writing the run's config and a summary whose final val loss
    is its label's landscape at its lr (a finished run is skipped, as the real one does)."""
    launched = []

    def launch(run, **_kwargs):
        if RunDir(run.run_dir).summary.is_file():
            return run.run_dir
        launched.append((run.label, run.optimizer.lr, run.train.max_steps, run.raw["seed"]))
        local.write_run_config(run)
        RunDir(run.run_dir).summary.write_text(json.dumps({
            "final_val_loss": LANDSCAPES[run.label](run.optimizer.lr), "bayes_floor": 2.0, "steps": run.train.max_steps,
            "payload_MB_per_step": 0.3 if run.label == "AdamW-DDP" else 0.01, "parameters": 155_648, "tokens": 1024}))
        return run.run_dir

    monkeypatch.setattr(local, "launch_local", launch)
    return launched


@pytest.mark.slow
def test_sweep_run_widens_reports_the_edge_and_reuses_the_runs(tmp_path, capsys, stand_in):
    sweep = _sweep_file(tmp_path, "{key: optimizer.lr, factors: [1, 2], overrides: [train.max_steps=2]}")
    out = tmp_path / "out"
    argv = ["run", str(sweep), "--out", str(out), *micro_sweep_overrides(tmp_path / "runs")]

    assert sweep_cli.main(argv) == 0

    printed = capsys.readouterr().out
    tuning = [(label, lr) for label, lr, steps, _seed in stand_in if steps == 2]
    assert tuning == [("AdamW-DDP", 0.006), ("AdamW-DDP", 0.012), ("DeMo k=4", 0.006), ("DeMo k=4", 0.012),
                      ("AdamW-DDP", 0.003), ("DeMo k=4", 0.024), ("AdamW-DDP", 0.0015), ("DeMo k=4", 0.048)]
    assert all(seed == 0 for _label, _lr, steps, seed in stand_in if steps == 2)
    assert ("[widen] AdamW-DDP: the best lr, 0.006 (final val loss 4.0000), is the lowest tried: "
            "trying lr=0.003 (widening 1 of at most 2 down)") in printed
    assert "[widen] DeMo k=4: the best lr, 0.024" in printed and "trying lr=0.048 (widening 2 of at most 2 up)" in printed
    assert "[tune] DeMo k=4: still at the edge after 2 widenings: lr=0.048, the highest tried" in printed
    assert "AdamW-DDP: still" not in printed
    final = sorted((label, lr, seed) for label, lr, steps, seed in stand_in if steps == 4)
    assert final == [("AdamW-DDP", 0.003, 0), ("AdamW-DDP", 0.003, 1), ("DeMo k=4", 0.048, 0), ("DeMo k=4", 0.048, 1)]
    summary = (out / "summary.md").read_text()
    assert "Tuning (optimizer.lr over 1x, 2x, widened one factor of 2 at a time, at most 2 per side" in summary
    assert "| AdamW-DDP | 0.0015: 4.0000, **0.003: 3.0000**, 0.006: 4.0000, 0.012: 7.0000 |" in summary
    assert "| DeMo k=4 | 0.006: 2.9940, 0.012: 2.9880, 0.024: 2.9760, **0.048: 2.9520** |" in summary
    assert ("DeMo k=4: still at the edge after 2 widenings: lr=0.048, the highest tried; the optimum may lie "
            "above.") in summary

    launched = len(stand_in)
    assert sweep_cli.main(argv) == 0  # a rerun finds every run, widened ones included
    assert len(stand_in) == launched
    assert "[widen] 2 runs, 2 finished before" in capsys.readouterr().out


def test_sweep_run_stops_naming_the_job_whose_every_run_diverged(tmp_path, capsys, stand_in, monkeypatch):
    monkeypatch.setitem(LANDSCAPES, "DeMo k=4", lambda _lr: math.nan)
    sweep = _sweep_file(tmp_path, "{key: optimizer.lr, factors: [1, 2], overrides: [train.max_steps=2]}")

    code = sweep_cli.main(["run", str(sweep), "--out", str(tmp_path / "out"), *micro_sweep_overrides(tmp_path / "runs")])

    captured = capsys.readouterr()
    assert code == 1
    assert "job 2 (DeMo k=4): every tuning run diverged (0.006: nan, 0.012: nan)" in captured.err
    assert "[tune] DeMo k=4: lr=0.006 diverged" in captured.out
    assert all(steps == 2 for _label, _lr, steps, _seed in stand_in)  # no final run started
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sweep_run_only_trains_the_named_jobs_and_the_baseline(tmp_path, stand_in, monkeypatch):
    monkeypatch.setitem(LANDSCAPES, "DeMo k=1", bowl(0.006))
    sweep = tmp_path / "three.yaml"
    sweep.write_text(_sweep_file(tmp_path, "{key: optimizer.lr, factors: [1, 2], overrides: [train.max_steps=2], "
                                 "widen: 0}").read_text()
                     .replace("points:\n", "points:\n  - [optimizer=demo, optimizer.lr=6e-3, "
                                           "optimizer.compression_topk=1, \"label='DeMo k=1'\"]\n"))
    out = tmp_path / "out"

    assert sweep_cli.main(["run", str(sweep), "--only", "DeMo k=1", "--out", str(out),
                           *micro_sweep_overrides(tmp_path / "runs")]) == 0

    # DeMo k=4 is not trained; AdamW-DDP is, because the verdicts compare with it
    assert {label for label, *_ in stand_in} == {"DeMo k=1", "AdamW-DDP"}
    summary = (out / "summary.md").read_text()
    assert "| DeMo k=1 |" in summary and "| AdamW-DDP |" in summary and "DeMo k=4" not in summary
    assert summary.startswith("Some of three's jobs (--only): DeMo k=1, AdamW-DDP; the runs of the others are not")


@pytest.mark.parametrize(("argv", "message"), [
    (["--only", "DeMo k=4"], "--only writes a table of some of s's jobs: give --out DIR"),
    (["--only", "DeMo k=5", "--out", "x"], "--only: 'DeMo k=5' labels no job (did you mean DeMo k=4?); "
                                            "the jobs of s: 'AdamW-DDP', 'DeMo k=4'"),
])
def test_sweep_run_only_refuses_a_label_of_no_job_and_a_missing_out(tmp_path, capsys, stand_in, argv, message):
    sweep = _sweep_file(tmp_path, "{key: optimizer.lr, factors: [1, 2], overrides: [train.max_steps=2]}")

    with pytest.raises(SystemExit) as exit_info:
        sweep_cli.main(["run", str(sweep), *argv, *micro_sweep_overrides(tmp_path / "runs")])

    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert stand_in == []
