"""What ``lowcomm-eval`` shows and keeps: each run's label beside its directory, each task's
chance level (counted over the documents scored), results reused per checkpoint and task by a
rerun (``--force`` recomputes), and one progress line for the whole evaluation. Real lm-eval on
real tiny checkpoints, a few documents each."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import datasets
import pytest

from lowcomm.cli.eval import main
from lowcomm.eval import (
    EvalProgress,
    chance_level,
    evaluate_checkpoint,
    load_tasks,
    resolve_tasks,
    select_checkpoints,
)
from lowcomm.report.evals import Chance, task_chance
from test_eval import SHIPPED, make_run

DEMO = {"name": "demo", "compression_chunk": 16, "compression_topk": 8}


def cache_files(run: Path, step: int) -> dict[str, int]:
    """Each cache file of the checkpoint by name, with its modification time (ns)."""
    directory = run / "eval" / "cache" / f"step_{step:09d}"
    return {path.name: path.stat().st_mtime_ns for path in sorted(directory.glob("*.json"))}


# ---------------------------------------------------------------------------- chance level
@pytest.mark.slow
def test_chance_level_is_the_mean_of_one_over_the_choices_of_the_documents_scored():
    tasks = load_tasks(resolve_tasks(None))
    # Counted by hand in the shipped ARC-Easy validation set: the first 17 questions have 4
    # choices and the 18th has 5; over all 570 questions, 567 have 4, 2 have 5 and 1 has 3.
    shipped = datasets.load_from_disk(str(SHIPPED / "ai2_arc/ARC-Easy/validation"))
    assert [len(choices["text"]) for choices in shipped.select(range(18))["choices"]] == [4] * 17 + [5]
    assert chance_level(tasks["arc_easy"], 18) == {
        "value": pytest.approx((17 * 1 / 4 + 1 / 5) / 18), "documents": 18, "choices": {"4": 17, "5": 1}}
    assert chance_level(tasks["arc_easy"], None) == {
        "value": pytest.approx((567 / 4 + 2 / 5 + 1 / 3) / 570), "documents": 570,
        "choices": {"3": 1, "4": 567, "5": 2}}
    assert chance_level(tasks["arc_easy"], 4) == {"value": 0.25, "documents": 4, "choices": {"4": 4}}
    assert chance_level(tasks["hellaswag"], 3) == {"value": 0.25, "documents": 3, "choices": {"4": 3}}
    assert chance_level(tasks["piqa"], 5) == {"value": 0.5, "documents": 5, "choices": {"2": 5}}


def test_the_stored_chance_level_reads_back_and_says_how_it_was_counted():
    result = {"tasks": {"arc_easy": {"chance": {"value": 0.24997, "documents": 570,
                                                "choices": {"3": 1, "4": 567, "5": 2}}},
                        "piqa": {"chance": {"value": 0.5, "documents": 20, "choices": {"2": 20}}},
                        "hellaswag": {"value": 0.3}}}
    assert task_chance(result, "arc_easy") == Chance(0.24997, 570, {"3": 1, "4": 567, "5": 2})
    assert task_chance(result, "arc_easy").describe() == "0.2500 (mean of 1/choices over n=570: 1 with 3, 567 with 4, 2 with 5)"
    assert task_chance(result, "piqa").describe() == "0.5000 (2 choices each, n=20)"
    assert task_chance(result, "hellaswag") is None  # a file written before chance levels were stored
    assert task_chance({}, "piqa") is None


# ---------------------------------------------------------------------------- progress line
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_is_plain_lines_with_elapsed_and_eta():
    clock, log = Clock(), io.StringIO()
    progress = EvalProgress(total=6, to_compute=4, stream=log, interval_s=30, clock=clock)
    progress.reused(2)
    progress.start("runs/a step 5 (DeMo s=16 k=8)", 2)
    clock.now += 10
    progress.scoring(50, 100)  # within the interval: no line
    assert log.getvalue() == ""
    # half of the first checkpoint's 2 tasks in 10 s: 3 task-units left at 10 s each
    assert progress.eta_s() == pytest.approx(30)
    clock.now += 25
    progress.scoring(90, 100)  # 35 s since the last line: one line while scoring
    clock.now += 5
    progress.finish()
    progress.start("runs/b step 5 (AdamW-DDP)", 2)
    clock.now += 40
    progress.finish()
    progress.close()
    assert log.getvalue().splitlines() == [
        "[2/6 checkpoint-tasks] 00:35 elapsed, ETA 00:43 | runs/a step 5 (DeMo s=16 k=8): 90% scored",
        "[4/6 checkpoint-tasks] 00:40 elapsed, ETA 00:40 | runs/a step 5 (DeMo s=16 k=8): done",
        "[6/6 checkpoint-tasks] 01:20 elapsed, ETA 00:00 | runs/b step 5 (AdamW-DDP): done",
    ]
    assert "\r" not in log.getvalue()


def test_progress_on_a_terminal_is_one_line_redrawn_with_notes_above_it():
    clock, terminal = Clock(), Terminal()
    progress = EvalProgress(total=2, to_compute=2, stream=terminal, clock=clock)
    progress.start("runs/a step 5", 2)
    clock.now += 4
    progress.scoring(1, 4)
    progress.note("wrote runs/a/eval/step_000000005.json")
    progress.finish()
    progress.close()
    text = terminal.getvalue()
    assert text.count("\n") == 2  # the note, and the end of the progress line
    assert text.endswith("\r\033[K[2/2 checkpoint-tasks] 00:04 elapsed, ETA 00:00 | runs/a step 5: done\n")
    assert "\r\033[K[0/2 checkpoint-tasks] 00:04 elapsed, ETA 00:12 | runs/a step 5: 25% scored" in text
    assert "\r\033[Kwrote runs/a/eval/step_000000005.json\n" in text


def test_a_checkpoint_that_fails_leaves_the_eta_to_the_others():
    clock = Clock()
    progress = EvalProgress(total=4, to_compute=4, stream=io.StringIO(), clock=clock)
    progress.start("broken", 2)
    progress.finish(ok=False)
    progress.start("good", 2)
    clock.now += 10
    progress.finish()
    assert progress.eta_s() == 0 and progress.done == 2


# ------------------------------------------------------------------- labels, chance, caching
def test_the_table_labels_each_run_and_gives_each_task_its_chance_level(tmp_path, capfd, monkeypatch):
    runs = tmp_path / "runs"
    make_run(runs / "demo", step=4, optimizer=DEMO, content_hash=True)
    make_run(runs / "adamw", step=4, seed=1)
    monkeypatch.chdir(tmp_path)  # outside a git repository, where lm-eval's simple_evaluate has git print
    assert main([str(runs / "*"), "--tasks", "arc_easy", "piqa", "--limit", "18", "--device", "cpu"]) == 0
    captured = capfd.readouterr()  # the file descriptors: what a subprocess writes too
    assert "fatal: not a git repository" not in captured.err and "\r" not in captured.err
    out = captured.out.splitlines()
    assert out[0].split() == ["label", "run", "step", "ARC-Easy", "acc", "PIQA", "acc_norm", "computed"]
    assert out[2].split() == ["chance", f"{(17 / 4 + 1 / 5) / 18:.4f}", "0.5000"]
    rows = [re.split(r"\s{2,}", line) for line in out[3:5]]
    assert sorted(row[:3] for row in rows) == [["AdamW-DDP", str(runs / "adamw"), "4"],
                                               ["DeMo s=16 k=8", str(runs / "demo"), "4"]]
    assert out[-1] == ("chance: the accuracy of a uniform guess, the mean over the documents scored of "
                       "1/(number of choices): ARC-Easy 0.2472 (mean of 1/choices over n=18: 17 with 4, 1 with 5); "
                       "PIQA 0.5000 (2 choices each, n=18)")
    stored = json.loads((runs / "demo" / "eval" / "step_000000004.json").read_text())
    assert stored["tasks"]["arc_easy"]["chance"]["choices"] == {"4": 17, "5": 1}


def test_a_rerun_reuses_each_checkpoint_and_task_and_force_recomputes(tmp_path, capsys):
    runs = tmp_path / "runs"
    demo, adamw = runs / "demo", runs / "adamw"
    make_run(demo, step=4, optimizer=DEMO, content_hash=True)
    make_run(adamw, step=4, seed=1)
    argv = [str(runs / "*"), "--tasks", "piqa", "arc_easy", "--limit", "2", "--device", "cpu"]

    assert main(argv) == 0
    first = capsys.readouterr()
    assert "4 to compute, 0 reused" in first.err
    stored = {run: json.loads((run / "eval" / "step_000000004.json").read_text()) for run in (demo, adamw)}
    written = {run: cache_files(run, 4) for run in (demo, adamw)}
    assert all(len(files) == 2 for files in written.values())

    assert main(argv) == 0
    second = capsys.readouterr()
    assert "0 to compute, 4 reused" in second.err
    assert (f"reused piqa, arc_easy of {demo} step 4 (DeMo s=16 k=8) from {demo / 'eval' / 'cache' / 'step_000000004'}/ "
            "(--force recomputes)") in second.err
    assert "checkpoint-tasks]" not in second.err  # nothing was computed
    assert {run: cache_files(run, 4) for run in (demo, adamw)} == written  # not rewritten
    for run in (demo, adamw):
        assert json.loads((run / "eval" / "step_000000004.json").read_text()) == stored[run]
    assert [line.rsplit("  ", 1)[0] for line in second.out.splitlines()] == [
        line.rsplit("  ", 1)[0] for line in first.out.splitlines()]  # the same table, "cached" at the end
    assert second.out.splitlines()[3].endswith("cached")

    assert main([*argv, "--force"]) == 0
    forced = capsys.readouterr()
    assert "4 to compute, 0 reused (--force: nothing reused)" in forced.err
    for run in (demo, adamw):
        recomputed = cache_files(run, 4)
        assert recomputed.keys() == written[run].keys()
        assert all(recomputed[name] != written[run][name] for name in recomputed)


def test_what_changes_a_score_is_recomputed_and_a_corrupt_file_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    make_run(run, step=4)  # a manifest with sizes only: the key holds model.pt's size and mtime
    argv = [str(run), "--tasks", "piqa", "--limit", "2", "--device", "cpu"]
    assert main(argv) == 0
    (piqa_file,) = cache_files(run, 4)
    capsys.readouterr()

    # another number of documents is another result; the first is kept and reused again
    assert main([*argv[:-4], "--limit", "3", "--device", "cpu"]) == 0
    assert "1 to compute, 0 reused" in capsys.readouterr().err
    assert len(cache_files(run, 4)) == 2
    assert main(argv) == 0
    assert "0 to compute, 1 reused" in capsys.readouterr().err

    # another task: computed, and the stored file keeps piqa beside it
    assert main([str(run), "--tasks", "arc_easy", "--limit", "2", "--device", "cpu"]) == 0
    assert "1 to compute, 0 reused" in capsys.readouterr().err
    stored = json.loads((run / "eval" / "step_000000004.json").read_text())
    assert set(stored["tasks"]) == {"piqa", "arc_easy"}
    assert set(stored["lm_eval"]["results"]) == {"lowcomm_piqa", "lowcomm_arc_easy"}

    # a corrupt cache file is named and recomputed (and written whole again)
    cache_file = run / "eval" / "cache" / "step_000000004" / piqa_file
    cache_file.write_text('{"key": ')
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"lowcomm-eval: note: {cache_file} cannot be read (" in err and "): recomputing it" in err
    assert "1 to compute, 0 reused" in err
    assert json.loads(cache_file.read_text())["summary"]["documents_scored"] == 2
    # ... and so is a corrupt result file, rewritten rather than merged
    result_file = run / "eval" / "step_000000004.json"
    result_file.write_text("not json")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"lowcomm-eval: note: {result_file} cannot be read (" in err
    assert "rewriting it with this evaluation's tasks" in err
    assert set(json.loads(result_file.read_text())["tasks"]) == {"piqa"}

    # the checkpoint written again at the same step (other weights, same size): recomputed
    make_run(run, step=4, seed=5)
    os.utime(run / "checkpoints" / "step_000000004" / "model.pt", ns=(1, 1))  # a distinct mtime, whatever the clock
    assert main(argv) == 0
    assert "1 to compute, 0 reused" in capsys.readouterr().err


def test_a_checkpoint_with_a_content_hash_is_recognised_by_it(tmp_path, capsys):
    """A manifest with model.pt's sha256 (what training writes): a copy of the run elsewhere, with
    new modification times, reuses its results; other weights at the same step do not."""
    run = tmp_path / "run"
    make_run(run, step=4, content_hash=True)
    argv = ["--tasks", "piqa", "--limit", "2", "--device", "cpu"]
    assert main([str(run), *argv]) == 0
    copy = tmp_path / "copied" / "run"
    shutil.copytree(run, copy, copy_function=shutil.copy)  # as cp -r: new modification times
    capsys.readouterr()
    assert main([str(copy), *argv]) == 0
    assert "0 to compute, 1 reused" in capsys.readouterr().err
    make_run(copy, step=4, seed=3, content_hash=True)
    assert main([str(copy), *argv]) == 0
    assert "1 to compute, 0 reused" in capsys.readouterr().err


def test_the_batch_size_does_not_change_a_score(tmp_path):
    """Why the batch size is not part of a result's cache key: batching changes which windows
    share a forward pass, not what each window reads."""
    make_run(tmp_path / "run", step=4)
    (checkpoint,) = select_checkpoints(tmp_path / "run")
    tasks = resolve_tasks(["arc_easy"])
    lm_eval_tasks = load_tasks(tasks)
    one, many = (evaluate_checkpoint(checkpoint, tasks, limit=6, batch_size=size, lm_eval_tasks=lm_eval_tasks)
                 for size in (1, 7))
    for metric in ("acc", "acc_norm"):
        assert one["arc_easy"]["summary"][metric] == many["arc_easy"]["summary"][metric]
    assert (one["arc_easy"]["summary"]["batch_size"], many["arc_easy"]["summary"]["batch_size"]) == (1, 7)


def test_runs_that_would_share_a_label_are_told_apart_and_a_foreign_run_is_named_by_its_directory(tmp_path):
    from lowcomm.cli.eval import run_labels

    for name, lr in (("fast", 0.01), ("slow", 0.001)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(json.dumps({"optimizer": {**DEMO, "lr": lr}}))
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.yaml").write_text("model: {}\n")  # no optimizer: not lowcomm-train's
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.yaml").write_text("model: [\n")
    runs = [tmp_path / name for name in ("fast", "slow", "foreign", "broken")]
    assert run_labels(runs) == {runs[0]: "DeMo s=16 k=8 lr=0.01", runs[1]: "DeMo s=16 k=8 lr=0.001",
                                runs[2]: "foreign", runs[3]: "broken"}
