"""lowcomm.report and analysis/: Table 1, the loss-vs-MB figure with its Pareto front and the loss
curves, built from run directories made by real tiny runs, checked against those runs' own files.

Two runs are trained once for the module (2 gloo workers, 4 steps each): AdamW-DDP, and DiLoCo
syncing every 2 steps with a DCT top-k pseudo-gradient (so its chunk and k come from the
compression group). Evaluation files are written by hand in lm-eval's formats.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
from pathlib import Path

import matplotlib.colors as mcolors
import pytest
import yaml

from lowcomm.cli.report import curves_main, loss_vs_mb_main, table1_main, wallclock_main
from lowcomm.report.evals import Score, task_score
from lowcomm.report.figures import plot_loss_curves, plot_loss_vs_mb
from lowcomm.report.paper import load_paper_table1, match_paper_row, paper_table1_path
from lowcomm.report.pareto import loss_mb_points, pareto_front, pareto_runs
from lowcomm.report.runs import RunRecord, distinct_labels, load_run
from lowcomm.report.select import select_by_globs, select_by_sweep
from lowcomm.report.table1 import build_table1
from runs import SMALL_SYNTHETIC, TINY, tiny_run, train_in_workers

WORKERS, STEPS = 2, 4
ADAMW = ["optimizer=adamw_ddp", "label=AdamW-DDP"]
DILOCO = ["optimizer=diloco", "optimizer.sync_every=2", "compression=dct_topk", "compression.chunk=32",
          "compression.topk=8"]
RUN_SETTINGS = ["train.eval_every=2", "train.checkpoint_every=0"]

# lowcomm-eval's format (src/lowcomm/eval/evaluate.py): a per-task summary and lm-eval's raw results.
ADAMW_SCORES = {"hellaswag": (0.2631, 0.0044), "arc_easy": (0.3117, 0.0095), "piqa": (0.5372, 0.0116)}
ARC_NOTE = "ARC-Easy is scored on its validation split: lm-eval's built-in task scores test"
# An lm-eval CLI results file (only ``results``), for the DiLoCo run, at a step before its last.
DILOCO_SCORES = {"hellaswag": (0.25, 0.0043), "arc_easy": (0.28, None), "piqa": (0.51, 0.0117)}
PAPER_METRIC = {"hellaswag": "acc_norm", "arc_easy": "acc", "piqa": "acc_norm"}


def lowcomm_eval_file(step: int) -> dict:
    tasks, raw = {}, {}
    for task, (value, stderr) in ADAMW_SCORES.items():
        metric = PAPER_METRIC[task]
        other = "acc" if metric == "acc_norm" else "acc_norm"
        tasks[task] = {"metric": metric, "value": value, "stderr": stderr, metric: value,
                       f"{metric}_stderr": stderr, other: value - 0.01, f"{other}_stderr": stderr,
                       "lm_eval_task": f"lowcomm_{task}", "documents_scored": 40}
        raw[f"lowcomm_{task}"] = {"alias": f"lowcomm_{task}", f"{metric},none": value,
                                  f"{metric}_stderr,none": stderr, f"{other},none": value - 0.01,
                                  f"{other}_stderr,none": stderr}
    return {"step": step, "tasks": tasks, "notes": [ARC_NOTE], "num_fewshot": 0,
            "lm_eval": {"version": "0.4.13", "results": raw}}


def lm_eval_cli_file() -> dict:
    results = {}
    for task, (value, stderr) in DILOCO_SCORES.items():
        metric = PAPER_METRIC[task]
        results[task] = {"alias": task, f"{metric},none": value,
                         f"{metric}_stderr,none": "N/A" if stderr is None else stderr}
    return {"results": results, "versions": {task: 1.0 for task in results}}


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report_runs")
    for overrides in (ADAMW, DILOCO):
        run = tiny_run(root, *overrides, *RUN_SETTINGS, workers=WORKERS, max_steps=STEPS)
        train_in_workers(run)
    return root


@pytest.fixture(scope="module")
def run_dirs(run_root) -> dict[str, Path]:
    """The two run directories by optimizer, with their hand-written evaluations."""
    dirs = {load_run(p).optimizer: p for p in sorted((run_root / "default").iterdir())}
    assert set(dirs) == {"adamw_ddp", "diloco"}
    write_json(dirs["adamw_ddp"] / "eval" / f"step_{STEPS:09d}.json", lowcomm_eval_file(STEPS))
    write_json(dirs["diloco"] / "eval" / "step_000000002.json", lm_eval_cli_file())
    return dirs


@pytest.fixture
def paper_csv(tmp_path) -> Path:
    """Reference numbers in results/paper/table1.csv's layout, named as a paper would name them."""
    path = tmp_path / "paper.csv"
    path.write_text(
        "model,optimizer,chunk,topk,final_loss,hellaswag_acc_norm,arc_easy_acc,piqa_acc_norm,tx_MB_per_step\n"
        "Tiny,AdamW-DDP,,,6.01,0.27,0.33,0.55,0.62\n"
        "tiny,DiLoCo,32,8,6.2,0.26,0.30,0.52,0.0073\n"
        "tiny,DeMo,64,32,5.9,0.28,0.34,0.56,0.15\n"
        "1B,DeMo,64,32,2.63,0.48,0.55,0.70,110.32\n"
    )
    return path


def last_logged(run_dir: Path, key: str) -> float:
    """The last value of ``key`` in metrics.jsonl, read directly."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r[key] for r in records if key in r][-1]


def markdown_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def record(name: str, optimizer: str, mb: float | None, loss: float | None) -> RunRecord:
    """An in-memory run with only the numbers the loss-vs-MB plane needs."""
    config = {"model": {"name": "tiny"}, "optimizer": {"name": optimizer}, "compression": {"name": "none"},
              "label": name}
    return RunRecord(Path(name), config, [], {"payload_MB_per_step": mb, "final_val_loss": loss})


def dominated(point, others) -> bool:
    """Independent definition: some other point is no worse on both and better on one."""
    return any(o[0] <= point[0] and o[1] <= point[1] and (o[0] < point[0] or o[1] < point[1])
               for o in others)


# ----------------------------------------------------------------------------- Pareto front
def test_pareto_front_of_hand_made_points():
    points = [(1.0, 3.0), (2.0, 2.0), (2.0, 2.5), (4.0, 2.0), (8.0, 1.0), (0.5, 5.0), (8.0, 1.0),
              (3.0, float("nan"))]
    # (2, 2.5) loses to (2, 2); (4, 2) ties (2, 2) on loss with more bytes; the NaN is excluded;
    # the two (8, 1) tie each other and both stay.
    assert pareto_front(points) == [5, 0, 1, 4, 6]
    assert pareto_front([]) == []


def test_pareto_front_equals_brute_force_on_random_points():
    rng = random.Random(0)
    for _ in range(200):
        # Few distinct values, so ties on one or both coordinates are common.
        points = [(rng.choice([0.1, 1, 2, 3, 10]), rng.choice([2.5, 2.7, 3.0, 3.3])) for _ in range(rng.randint(1, 9))]
        expected = {i for i, p in enumerate(points) if not dominated(p, points[:i] + points[i + 1:])}
        front = pareto_front(points)
        assert set(front) == expected
        assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)


def test_pareto_runs_of_hand_made_runs_leave_out_what_cannot_be_placed():
    runs = [record("ddp", "adamw_ddp", 600.0, 2.70), record("demo k=32", "demo", 30.0, 2.68),
            record("demo k=4", "demo", 3.7, 2.80), record("demo k=1", "demo", 0.9, 2.79),
            record("diloco", "diloco", 60.0, 2.75), record("diverged", "demo", 1.0, float("nan")),
            record("silent", "diloco", 0.0, 3.5), record("unfinished", "demo", None, None)]
    points, skipped = loss_mb_points(runs)
    assert [p.run.name for p in pareto_runs(points)] == ["demo k=1", "demo k=32"]
    assert sorted(run.name for run, _ in skipped) == ["diverged", "silent", "unfinished"]
    perplexity_points, _ = loss_mb_points(runs, perplexity=True)
    assert perplexity_points[0].loss == pytest.approx(math.exp(2.70))
    with pytest.raises(ValueError, match="payload or tx"):
        loss_mb_points(runs, mb="rx")


def _flexdemo_and_ddp() -> tuple[RunRecord, RunRecord]:
    # FlexDeMo's summary: 1.2056 MB/step in all (FSDP's intra-node gathers), 0.0096 between nodes
    config = {"model": {"name": "tiny"}, "optimizer": {"name": "flexdemo"}, "compression": {"name": "none"},
              "label": "flexdemo"}
    metrics = [{"step": 1, "comm/intra_payload_bytes": 1_196_000, "comm/inter_payload_bytes": 9_600}]
    flex = RunRecord(Path("flexdemo"), config, metrics, {
        "payload_MB_per_step": 1.2056, "inter_node_payload_MB_per_step": 0.0096, "final_val_loss": 2.9})
    return flex, record("ddp", "adamw_ddp", 0.25, 2.95)


def drawn(monkeypatch, plot, *args, **kwargs):
    """The figure a plot function drew (captured as it is closed), and what it returned."""
    import matplotlib.pyplot as plt

    figures = []
    original = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), None)[1])
    result = plot(*args, **kwargs)
    monkeypatch.setattr(plt, "close", original)
    return figures[-1], result


def test_a_run_with_two_links_is_placed_at_all_its_bytes_and_marks_its_inter_node_part(tmp_path, monkeypatch):
    """Issue 26: FlexDeMo sat at its inter-node bytes (0.0096) in loss_vs_mb.png and on the front
    because of it, at its total (1.206) in Table 1 and the cumulative-MB curves."""
    flex, ddp = _flexdemo_and_ddp()
    points, _ = loss_mb_points([flex, ddp])
    placed = {p.run.name: (p.mb_per_step, p.inter_node_mb) for p in points}
    assert placed == {"flexdemo": (1.2056, 0.0096), "ddp": (0.25, None)}
    # the front is over all bytes: FlexDeMo (2.9 at 1.2 MB) and AdamW-DDP (2.95 at 0.25 MB) both on it
    assert [p.run.name for p in pareto_runs(points)] == ["ddp", "flexdemo"]
    assert all(p.inter_node_mb is None for p in loss_mb_points([flex], mb="tx")[0])  # tx has no per-link split

    fig, _ = drawn(monkeypatch, plot_loss_vs_mb, [flex, ddp], tmp_path, formats=("png",))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == ["flexdemo: all bytes (filled)", "flexdemo: inter-node part (hollow, dotted)"]
    assert "ddp" in labels  # each group by its label (the fixture labels AdamW-DDP so)
    assert ax.get_xlabel() == "Tx MB/step per worker (payload; 1 MB = 1e6 bytes)"
    hollow = [c for c in ax.collections if c.get_offsets().shape[0] == 1 and not c.get_facecolor().size]
    assert [tuple(c.get_offsets()[0]) for c in hollow] == [(0.0096, 2.9)]
    # the dotted link between the two points of the one run
    assert [tuple(line.get_xdata()) for line in ax.get_lines() if line.get_linestyle() == ":"] == [(0.0096, 1.2056)]

    table = build_table1([flex, ddp])
    row = next(row for row in table.rows if row.optimizer == "flexdemo")
    assert row.values["tx_MB_per_step"] == 1.2056 and row.inter_node_mb_per_step == 0.0096
    assert any("1.206); 0.0096 of them cross between nodes" in note for note in table.notes)
    # the Markdown and LaTeX tables carry both of its numbers, as the figures do; a one-link run
    # sends all of its bytes on its one link
    header, *rows = markdown_rows(table.to_markdown())
    assert header[-2:] == ["Tx MB/step", "inter-node Tx MB/step"]
    assert {cells[1]: cells[-2:] for cells in rows} == {"flexdemo": ["1.206", "0.0096"], "ddp": ["0.25", "0.25"]}
    assert "inter-node Tx MB/step \\\\" in table.to_latex()
    # without a two-link run the table is the paper's shape
    assert markdown_rows(build_table1([ddp]).to_markdown())[0][-1] == "Tx MB/step"


def test_a_run_with_two_links_has_two_linked_curves_against_cumulative_bytes(tmp_path, monkeypatch):
    """The cumulative-MB curves mark both of FlexDeMo's numbers too: its curve at all of its bytes
    and a hollow, dotted one at the inter-node part, joined at the end; against steps, one curve."""
    flex, ddp = _flexdemo_and_ddp()
    flex.metrics = [{"step": step, "train/loss": 4.0 - 0.1 * step, "comm/cum_payload_MB": 1.2056 * step,
                     "comm/cum_inter_payload_MB": 0.0096 * step, "comm/inter_payload_bytes": 9_600}
                    for step in range(1, 7)]
    ddp.metrics = [{"step": step, "train/loss": 4.1 - 0.1 * step, "comm/cum_payload_MB": 0.25 * step}
                   for step in range(1, 7)]
    closed = []
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "close", closed.append)
    plot_loss_curves([flex, ddp], tmp_path, formats=("png",))
    by_steps, by_bytes = (fig.axes[0] for fig in closed)
    assert [line.get_label() for line in by_steps.get_lines()] == ["flexdemo", "ddp"]
    curves = {line.get_label(): line for line in by_bytes.get_lines()}
    assert list(curves)[:2] == ["flexdemo: all bytes (filled)", "flexdemo: inter-node part (hollow, dotted)"]
    total, inter = curves["flexdemo: all bytes (filled)"], curves["flexdemo: inter-node part (hollow, dotted)"]
    assert list(total.get_xdata()) == pytest.approx([1.2056 * step for step in range(1, 7)])
    assert list(inter.get_xdata()) == pytest.approx([0.0096 * step for step in range(1, 7)])
    assert list(inter.get_ydata()) == list(total.get_ydata())  # the same losses, at the other bytes
    assert inter.get_linestyle() == ":" and inter.get_markerfacecolor() == "none"
    assert inter.get_color() == total.get_color()
    link = [line for line in by_bytes.get_lines() if line.get_label().startswith("_")]  # not in the legend
    assert [list(line.get_xdata()) for line in link] == [pytest.approx([0.0096 * 6, 1.2056 * 6])]
    assert by_bytes.get_xlabel() == "cumulative Tx MB per worker (payload; 1 MB = 1e6 bytes)"
    assert by_bytes.get_ylabel() == "train loss (absolute)"  # no floor is known for training batches


@pytest.mark.parametrize("crowd", [2, 6, 9])
def test_point_labels_never_overlap_a_label_or_a_marker_and_stay_in_the_axes(tmp_path, monkeypatch, crowd):
    """Issue 26: the labels of MuLoCo 2-bit EF and Streaming DiLoCo, two near points, overlapped."""
    runs = [record("MuLoCo 2-bit EF", "muloco", 0.0039, 3.10), record("Streaming DiLoCo", "streaming_diloco",
                                                                        0.0040, 3.101)]
    runs += [record(f"DeMo k={2 ** i}", "demo", 0.01 * (1 + i * 0.02), 3.0 + i * 0.001) for i in range(crowd - 2)]
    fig, _ = drawn(monkeypatch, plot_loss_vs_mb, runs, tmp_path, formats=("png",))
    ax = fig.axes[0]
    fig.canvas.draw()  # the Agg renderer: boxes as saved
    renderer = fig.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in ax.texts]
    assert len(boxes) == crowd
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    inside = ax.get_window_extent(renderer)
    assert all(inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
               for box in boxes)
    # no label covers the centre of any point
    centres = [ax.transData.transform(xy) for c in ax.collections for xy in c.get_offsets()]
    assert not any(box.contains(*centre) for box in boxes for centre in centres)


def test_losses_are_drawn_over_a_shared_bayes_floor(tmp_path, monkeypatch):
    runs = [record("AdamW-DDP", "adamw_ddp", 0.3, 2.5), record("DeMo", "demo", 0.004, 2.9)]
    for run in runs:
        run.summary["bayes_floor"] = 2.1
    fig, _ = drawn(monkeypatch, plot_loss_vs_mb, runs, tmp_path, formats=("png",))
    ax = fig.axes[0]
    assert ax.get_ylabel() == "final validation loss \u2212 Bayes floor (2.100)" and ax.get_yscale() == "log"
    ys = sorted(float(c.get_offsets()[0][1]) for c in ax.collections if c.get_offsets().shape[0] == 1)
    assert ys[0] == pytest.approx(0.4) and ys[-1] == pytest.approx(0.8)
    # the excess spans less than a decade: ticks enough to read it (a log locator labels 1 alone)
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    ticks = [tick for tick in ax.get_yticks() if low <= tick <= high]
    assert len(ticks) >= 3 and all(label.get_text() for label in ax.get_yticklabels() if low <= label.get_position()[1] <= high)
    runs[1].summary["bayes_floor"] = None  # no floor shared: the loss itself
    fig, _ = drawn(monkeypatch, plot_loss_vs_mb, runs, tmp_path, formats=("png",))
    assert fig.axes[0].get_ylabel() == "final validation loss (absolute)" and fig.axes[0].get_yscale() == "linear"


# ----------------------------------------------------------------------------- readers
def test_task_score_reads_lowcomm_eval_and_lm_eval_files():
    ours = lowcomm_eval_file(4)
    # lowcomm-eval's summary carries the documents scored: every printed accuracy shows its n
    assert task_score(ours, "hellaswag", "acc_norm") == Score(0.2631, 0.0044, 40)
    assert task_score(ours, "hellaswag", "acc") == Score(0.2631 - 0.01, 0.0044, 40)
    assert Score(0.45, 0.11413288653790232, 20).describe() == "0.450 ± 0.114, n=20"
    assert Score(0.45, None, None).describe() == "0.450"
    # Without lowcomm-eval's summary, lm-eval's raw results under the lowcomm_ task name.
    del ours["tasks"]
    assert task_score(ours, "arc_easy", "acc") == Score(0.3117, 0.0095)
    cli = lm_eval_cli_file()
    assert task_score(cli, "piqa", "acc_norm") == Score(0.51, 0.0117)
    assert task_score(cli, "arc_easy", "acc") == Score(0.28, None)  # "N/A" stderr
    assert task_score(cli, "arc_easy", "acc_norm") is None
    legacy = {"results": {"piqa": {"acc_norm": 0.6, "acc_norm_stderr": 0.01}}}  # lm-eval < 0.4
    assert task_score(legacy, "piqa", "acc_norm") == Score(0.6, 0.01)
    assert task_score({}, "piqa", "acc_norm") is None


def test_paper_csv_matches_loosely_named_rows(paper_csv, tmp_path):
    rows = load_paper_table1(paper_csv)
    assert len(rows) == 4
    adamw = match_paper_row(rows, "tiny", "adamw_ddp", None, None)
    assert adamw is not None and adamw.values["tx_MB_per_step"] == 0.62
    assert match_paper_row(rows, "olmo_1b", "demo", 64, 32).values["final_loss"] == 2.63
    assert match_paper_row(rows, "olmo_1b", "demo", 128, 32) is None
    assert match_paper_row(rows, "olmo_300m", "demo", 64, 32) is None
    bad = tmp_path / "bad.csv"
    bad.write_text("model,optimizer,chunk\n1B,DeMo,64\n")
    with pytest.raises(ValueError, match="missing column.*topk"):
        load_paper_table1(bad)


def test_repository_paper_table_has_the_papers_numbers():
    path = paper_table1_path()
    if not path.is_file():
        pytest.skip(f"{path} not written yet")
    rows = load_paper_table1(path)
    assert len(rows) == 24
    # The DeMo paper's Table 1 and appendix table (results/paper/README.md).
    demo_1b = match_paper_row(rows, "olmo_1b", "demo", 64, 32)
    assert demo_1b is not None and demo_1b.values["tx_MB_per_step"] == pytest.approx(110.32)
    assert demo_1b.values["hellaswag_acc_norm"] == pytest.approx(0.48)
    adamw_300m = match_paper_row(rows, "olmo_300m", "adamw_ddp", None, None)
    assert adamw_300m is not None and adamw_300m.values["tx_MB_per_step"] == pytest.approx(636.9)


def test_series_keeps_the_last_value_of_a_relogged_step_and_interpolates_cumulative_mb():
    metrics = [{"step": 2, "train/loss": 5.0, "comm/cum_payload_MB": 2.0},
               {"step": 4, "train/loss": 4.0, "comm/cum_payload_MB": 4.0},
               {"step": 4, "train/loss": 3.9, "comm/cum_payload_MB": 4.0},  # re-logged after a resume
               {"step": 3, "val/loss": 4.5}]  # an evaluation on its own line
    run = RunRecord(Path("r"), {"optimizer": {"name": "demo"}}, metrics, None)
    assert run.series("train/loss") == ([2, 4], [5.0, 3.9])
    assert run.cumulative_mb_at([2, 3, 4]) == [2.0, 3.0, 4.0]
    assert run.final_val_loss == 4.5  # no summary: the last val/loss logged
    assert run.payload_mb_per_step == 1.0  # no summary: 4 MB over 4 steps


# ----------------------------------------------------------------------------- from real runs
@pytest.mark.slow
def test_table1_numbers_are_the_runs_own(run_dirs, paper_csv, tmp_path):
    runs = [load_run(run_dirs["adamw_ddp"]), load_run(run_dirs["diloco"])]
    table = build_table1(runs, load_paper_table1(paper_csv))
    header, *body = markdown_rows(table.to_markdown())
    column = {title: index for index, title in enumerate(header)}
    by_optimizer = {row[column["Optimizer"]].split()[0]: row for row in body}
    assert set(by_optimizer) == {"AdamW-DDP", "DiLoCo"}

    adamw, diloco = by_optimizer["AdamW-DDP"], by_optimizer["DiLoCo"]
    adamw_summary = json.loads((run_dirs["adamw_ddp"] / "summary.json").read_text())
    assert adamw[column["Final loss"]] == f"{last_logged(run_dirs['adamw_ddp'], 'val/loss'):.3f} (6.01)"
    # every accuracy with its standard error and the documents scored, then the paper's
    assert adamw[column["HellaSwag acc_norm"]] == "0.263 ± 0.004, n=40 (0.27)"
    assert adamw[column["ARC-Easy acc"]] == "0.312 ± 0.009, n=40 (0.33)"
    assert adamw[column["PIQA acc_norm"]] == "0.537 ± 0.012, n=40 (0.55)"
    ours_mb, paper_mb = adamw[column["Tx MB/step"]].split()
    assert float(ours_mb) == pytest.approx(adamw_summary["payload_MB_per_step"], rel=1e-3)
    assert paper_mb == "(0.62)"
    # DiLoCo: chunk and k from the compression group; benchmarks from an lm-eval CLI file.
    assert diloco[column["chunk"]] == "32" and diloco[column["k"]] == "8"
    # an lm-eval CLI file has no document count; its "N/A" stderr is left out
    assert diloco[column["PIQA acc_norm"]] == "0.510 ± 0.012 (0.52)"
    assert diloco[column["ARC-Easy acc"]] == "0.280 (0.30)"  # the paper's cell as written

    rows = {row["optimizer"]: row for row in csv.DictReader((table.write_csv(tmp_path / "t.csv")).open())}
    for optimizer, run_dir in run_dirs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert float(rows[optimizer]["final_loss"]) == last_logged(run_dir, "val/loss")
        assert float(rows[optimizer]["tx_MB_per_step"]) == summary["payload_MB_per_step"]
        assert float(rows[optimizer]["ring_tx_MB_per_step"]) == summary["tx_MB_per_step"]
        assert int(rows[optimizer]["final_step"]) == STEPS
    assert float(rows["adamw_ddp"]["hellaswag_acc_norm_stderr"]) == 0.0044
    assert rows["adamw_ddp"]["hellaswag_acc_norm_n"] == "40" and rows["diloco"]["piqa_acc_norm_n"] == ""
    assert "$\\pm$ 0.004, n=40" in table.to_latex()
    assert float(rows["adamw_ddp"]["hellaswag_acc_norm"]) == 0.2631
    assert rows["diloco"]["arc_easy_acc_stderr"] == ""  # "N/A" in the file
    assert rows["diloco"]["eval_step"] == "2"
    assert float(rows["diloco"]["tx_MB_per_step_paper"]) == 0.0073

    assert f"{run_dirs['diloco']}: benchmarks at step 2 of {STEPS}" in table.notes
    assert ARC_NOTE in table.notes


@pytest.mark.slow
def test_table1_orders_like_the_paper_and_lists_unreproduced_rows(run_dirs, paper_csv):
    runs = [load_run(run_dirs["adamw_ddp"]), load_run(run_dirs["diloco"])]
    table = build_table1(runs, load_paper_table1(paper_csv), include_unmatched_paper=True)
    # Chunked rows by chunk then k descending, then the uncompressed baseline; the 1B row is
    # another model and stays out.
    assert [(row.optimizer, row.chunk, row.topk, row.run_dir is None) for row in table.rows] == [
        ("diloco", 32, 8, False), ("DeMo", 64, 32, True), ("adamw_ddp", None, None, False)]
    unreproduced = markdown_rows(table.to_markdown())[2]
    assert unreproduced[:4] == ["tiny", "DeMo", "64", "32"]
    assert unreproduced[4] == "- (5.9)"

    latex = table.to_latex()
    body = [line for line in latex.splitlines() if line.endswith("\\\\")]
    assert len(body) == 1 + len(table.rows)
    assert all(line.count(" & ") == 8 for line in body)
    assert "HellaSwag acc\\_norm" in latex and latex.startswith("\\begin{tabular}")


@pytest.mark.slow
def test_table1_of_training_loss_without_evaluations_says_so(run_dirs):
    table = build_table1([load_run(run_dirs["adamw_ddp"])], eval_step=3, loss="train")
    assert table.rows[0].values["final_loss"] == last_logged(run_dirs["adamw_ddp"], "train/loss")
    assert markdown_rows(table.to_markdown())[1][5:8] == ["-", "-", "-"]
    assert any("not evaluated at step 3" in note for note in table.notes)
    assert "our final last logged training loss" in table.to_markdown()


@pytest.mark.slow
def test_loss_vs_mb_figure_and_its_front_from_runs(run_dirs, tmp_path):
    runs = [load_run(path) for path in run_dirs.values()]
    paths, skipped = plot_loss_vs_mb(runs, tmp_path)
    assert [p.name for p in paths] == ["loss_vs_mb.png", "loss_vs_mb.pdf"]
    assert all(p.stat().st_size > 1000 for p in paths) and skipped == []
    summaries = {name: json.loads((path / "summary.json").read_text()) for name, path in run_dirs.items()}
    planes = {name: (s["payload_MB_per_step"], s["final_val_loss"]) for name, s in summaries.items()}
    expected = {name for name, p in planes.items() if not dominated(p, [q for n, q in planes.items() if n != name])}
    points, _ = loss_mb_points(runs)
    assert {p.run.optimizer for p in pareto_runs(points)} == expected


@pytest.mark.slow
def test_loss_curves_from_runs(run_dirs, tmp_path):
    runs = [load_run(path) for path in run_dirs.values()]
    paths = plot_loss_curves(runs, tmp_path, key="val/loss", formats=("png", "pdf"))
    assert sorted(p.name for p in paths) == sorted(
        f"val_{stem}.{fmt}" for stem, fmt in itertools.product(["loss_vs_step", "loss_vs_cum_MB"], ["png", "pdf"]))
    assert [p.name for p in plot_loss_curves(runs, tmp_path, formats=("png",))] == [
        "loss_vs_step.png", "loss_vs_cum_MB.png"]  # the quickstart's names
    diloco = load_run(run_dirs["diloco"])
    steps, _ = diloco.series("val/loss")
    assert steps == [2, 4]
    # The x of the cumulative-MB curve is what the run logged at those steps.
    assert diloco.cumulative_mb_at(steps) == pytest.approx(
        [last_logged_at(run_dirs["diloco"], step, "comm/cum_payload_MB") for step in steps])


def last_logged_at(run_dir: Path, step: int, key: str) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r[key] for r in records if r["step"] == step and key in r][-1]


def test_distinct_labels_name_what_differs():
    a, b, c = record("x", "demo", 1, 1), record("y", "demo", 1, 1), record("z", "adamw_ddp", 1, 1)
    for run, lr in ((a, 0.1), (b, 0.2), (c, 0.3)):
        run.config["label"] = None
        run.config["optimizer"]["lr"] = lr
    assert distinct_labels([a, b, c]) == ["DeMo lr=0.1", "DeMo lr=0.2", "AdamW-DDP"]


# ----------------------------------------------------------------------------- selection and CLIs
@pytest.mark.slow
def test_sweep_selection_finds_the_runs_and_lists_the_missing(run_root, run_dirs, tmp_path):
    base = [*TINY, *SMALL_SYNTHETIC, f"cluster.workers={WORKERS}", f"train.max_steps={STEPS}", *RUN_SETTINGS]
    sweep = tmp_path / "mini.yaml"
    sweep.write_text(yaml.safe_dump({"description": "two runs made, one not",
                                     "base": base, "points": [ADAMW, DILOCO, ["optimizer=desloc"]]}))
    selection = select_by_sweep(str(sweep), [f"run_root={run_root}"])
    assert [run.path for run in selection.runs] == [run_dirs["adamw_ddp"], run_dirs["diloco"]]
    assert len(selection.missing) == 1 and "desloc" in selection.missing[0]

    globbed = select_by_globs([str(run_root / "default" / "*"), str(tmp_path / "none*")])
    assert {run.path for run in globbed.runs} == set(run_dirs.values())
    assert globbed.missing == [f"{tmp_path / 'none*'} (matches no run directory)"]


@pytest.mark.slow
@pytest.mark.usefixtures("run_dirs")  # the runs with their evaluation files
def test_command_lines_write_and_print_their_outputs(run_root, paper_csv, tmp_path, capsys):
    runs = str(run_root / "default" / "*")
    out = tmp_path / "out"
    assert table1_main(["--runs", runs, "--paper", str(paper_csv), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for suffix in ("md", "tex", "csv"):
        assert f"table: {out / f'table1.{suffix}'}" in printed
        assert (out / f"table1.{suffix}").is_file()
    assert "| tiny | AdamW-DDP | - | - |" in printed

    assert loss_vs_mb_main(["--runs", runs, "--out", str(out), "--perplexity"]) == 0
    assert curves_main(["--runs", runs, "--out", str(out), "--key", "train/loss", "val/loss",
                        "--formats", "png"]) == 0
    printed = capsys.readouterr().out
    figures = [line.removeprefix("figure: ") for line in printed.splitlines() if line.startswith("figure: ")]
    assert sorted(Path(f).name for f in figures) == sorted(
        ["loss_vs_mb.png", "loss_vs_mb.pdf", "loss_vs_step.png", "loss_vs_cum_MB.png", "val_loss_vs_step.png",
         "val_loss_vs_cum_MB.png"])
    assert all(Path(f).is_file() for f in figures)

    with pytest.raises(SystemExit):
        table1_main(["--runs", str(tmp_path / "nothing*")])
    assert "no run directory found" in capsys.readouterr().err


def test_a_metrics_line_being_written_is_skipped_and_a_corrupt_one_is_named(tmp_path):
    from lowcomm.train.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 3.0}\n{"step": 2, "train/lo')
    assert read_metrics(path) == [{"step": 1, "train/loss": 3.0}]
    path.write_text('{"step": 1, "train/lo\n{"step": 2, "train/loss": 2.5}\n')
    with pytest.raises(ValueError, match=f"{path}:1 is not valid JSON"):
        read_metrics(path)


@pytest.mark.parametrize("name", sorted(__import__("lowcomm.strategies", fromlist=["STRATEGIES"]).STRATEGIES))
def test_every_optimizer_has_a_name_a_marker_and_its_own_colour_in_the_figures(name):
    from lowcomm.report.figures import FAMILY_COLORS, FAMILY_MARKERS
    from lowcomm.report.runs import OPTIMIZER_NAMES

    assert name in OPTIMIZER_NAMES and name in FAMILY_MARKERS
    others = {FAMILY_COLORS[other] for other in FAMILY_COLORS if other != name}
    assert FAMILY_COLORS[name] not in others


# ----------------------------------------------------------------------------- options
ANALYSIS_COMMANDS = {"lowcomm-table1": table1_main, "lowcomm-loss-vs-mb": loss_vs_mb_main, "lowcomm-curves": curves_main,
                     "lowcomm-wallclock": wallclock_main}


def _parser_of(main, monkeypatch):
    """The parser a command builds, caught as it starts to parse."""
    import argparse

    class Caught(Exception):
        pass

    caught = []

    def catch(self, *_args, **_kwargs):
        caught.append(self)
        raise Caught

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    with pytest.raises(Caught):
        main([])
    return caught[0]


@pytest.mark.parametrize("command", sorted(ANALYSIS_COMMANDS))
def test_every_option_of_the_analysis_commands_says_what_it_does(command, monkeypatch):
    """Issue 26: --title had no help; table1's --formats offered figure formats and wrote none."""
    parser = _parser_of(ANALYSIS_COMMANDS[command], monkeypatch)
    options = {action.option_strings[-1]: action for action in parser._actions if action.option_strings}
    assert not [name for name, action in options.items() if not action.help], command
    draws = command != "lowcomm-table1"
    assert ("--formats" in options) == draws and ("--title" in options) == draws


def test_table1_given_figure_options_says_where_they_belong(capsys):
    for option in (["--formats", "png", "svg"], ["--title=mine"]):
        with pytest.raises(SystemExit):
            table1_main(["--runs", "nothing*", *option])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error == ("lowcomm-table1: error: lowcomm-table1 writes tables only (STEM.md, STEM.tex, STEM.csv); "
                         "--formats and --title are for the figures: lowcomm-loss-vs-mb and lowcomm-curves")
    with pytest.raises(SystemExit):
        table1_main(["--runs", "nothing*", "--bogus"])
    assert capsys.readouterr().err.strip().endswith("unrecognized arguments: --bogus")


# ----------------------------------------------------------------------------- groups over seeds
def _seeded(label: str, optimizer: str, mb: float, losses: list[float], **optimizer_keys) -> list[RunRecord]:
    """One group's runs: the same config and label, one run per seed."""
    runs = []
    for seed, loss in enumerate(losses):
        config = {"model": {"name": "tiny"}, "optimizer": {"name": optimizer, **optimizer_keys},
                  "compression": {"name": "none"}, "label": label, "seed": seed}
        runs.append(RunRecord(Path(f"{label}-{seed}"), config,
                              [{"step": 1, "val/loss": loss, "comm/cum_payload_MB": mb}],
                              {"payload_MB_per_step": mb, "final_val_loss": loss}))
    return runs


def test_loss_vs_mb_plots_each_group_at_its_seed_mean_and_takes_the_front_over_groups(tmp_path, monkeypatch):
    """Issue 45: the front was over single seeds, so one lucky seed put a group on it. Each group
    is one point at its seeds' mean with a bar from the lowest to the highest; the front is over
    the groups' means."""
    adamw = _seeded("AdamW-DDP", "adamw_ddp", 0.3, [2.98, 3.02])
    demo = _seeded("DeMo s=64 k=8", "demo", 0.004, [3.2, 3.4])
    cheap = _seeded("SparseLoCo", "sparseloco", 0.001, [3.5, 3.5])
    fig, _ = drawn(monkeypatch, plot_loss_vs_mb, adamw + demo + cheap, tmp_path, formats=("png",))
    ax = fig.axes[0]
    filled = sorted(tuple(c.get_offsets()[0]) for c in ax.collections if hasattr(c, "get_sizes")
                    and c.get_offsets().shape[0] == 1 and c.get_facecolor().size and c.get_sizes()[0] == 60)
    assert filled == [(0.001, pytest.approx(3.5)), (0.004, pytest.approx(3.3)), (0.3, pytest.approx(3.0))]
    # a bar from the lowest seed to the highest
    bars = [segment for c in ax.collections if c.__class__.__name__ == "LineCollection" for segment in c.get_segments()]
    assert sorted((seg[0][1], seg[1][1]) for seg in bars) == [pytest.approx((2.98, 3.02)), pytest.approx((3.2, 3.4)),
                                                              pytest.approx((3.5, 3.5))]
    (front,) = [line for line in ax.get_lines() if line.get_label() == "Pareto front (all bytes)"]
    assert list(front.get_xdata()) == [0.001, 0.004, 0.3]  # every group is on this front: each is cheaper
    assert [t.get_text() for t in ax.texts][:1] == ["AdamW-DDP (2 seeds)"]
    assert "mean over seeds; bar: min to max" in ax.get_ylabel()

    # DeMo's seeds (2.9, 3.3; mean 3.1) at more bytes than AdamW-DDP (mean 3.0): its seed 2.9
    # alone would be on the front, the group's mean is not
    lucky = _seeded("DeMo s=64 k=8", "demo", 0.4, [2.9, 3.3])
    fig, _ = drawn(monkeypatch, plot_loss_vs_mb, adamw + lucky, tmp_path, formats=("png",))
    ax = fig.axes[0]
    assert not [line for line in ax.get_lines() if line.get_label() == "Pareto front (all bytes)"]
    rings = [c for c in ax.collections if hasattr(c, "get_sizes") and c.get_sizes().size and c.get_sizes()[0] == 150]
    assert [tuple(c.get_offsets()[0]) for c in rings] == [(0.3, pytest.approx(3.0))]
    # a front of one point draws no line, and no legend entry says there is one
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "Pareto front (all bytes)" not in legend and "the Pareto front (one point)" in legend


def test_groups_of_one_method_differ_in_marker_and_legend_and_keep_their_colour_everywhere(tmp_path, monkeypatch):
    """Issue 45: DiLoCo H=5 and H=10 shared one marker and one legend entry and differed by a
    shade; AdamW-DDP was another blue in the seed-band figure than in the others."""
    from lowcomm.report.figures import plot_seed_bands, run_colors, run_fills

    adamw = _seeded("AdamW-DDP", "adamw_ddp", 0.3, [3.0, 3.02])
    h5 = _seeded("DiLoCo H=5", "diloco", 0.06, [3.1, 3.12], sync_every=5)
    h10 = _seeded("DiLoCo H=10", "diloco", 0.03, [3.2, 3.21], sync_every=10)
    muloco = _seeded("MuLoCo 2-bit H=10", "muloco", 0.004, [3.3, 3.31], sync_every=10)
    runs = adamw + h5 + h10
    fills = run_fills(runs)
    assert [fills[id(run)] for run in runs] == ["full"] * 4 + ["left"] * 2
    fig, _ = drawn(monkeypatch, plot_loss_vs_mb, runs + muloco, tmp_path, formats=("png",))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert {"AdamW-DDP", "DiLoCo H=5", "DiLoCo H=10"} <= set(legend) and "DiLoCo" not in legend
    # a method's only group keeps its defining constants in the legend as beside its point
    assert "MuLoCo 2-bit H=10" in legend and "MuLoCo" not in legend
    half = [c for c in fig.axes[0].collections if c.get_offsets().shape[0] == 1
            and tuple(c.get_offsets()[0]) == (0.03, pytest.approx(3.205))]
    assert len(half) == 2  # the outline, then the half-filled marker

    colors = run_colors(runs)
    assert colors[id(adamw[0])] == colors[id(adamw[1])] and colors[id(h5[0])] != colors[id(h10[0])]
    drawn_colors = {}
    fig, _ = drawn(monkeypatch, plot_seed_bands, [("AdamW-DDP", adamw), ("DiLoCo H=5", h5), ("DiLoCo H=10", h10)],
                   tmp_path, formats=("png",))
    for line in fig.axes[0].get_lines():
        drawn_colors.setdefault(line.get_label().split(" (")[0], line.get_color())
    assert mcolors.to_rgb(drawn_colors["AdamW-DDP"]) == pytest.approx(colors[id(adamw[0])])
    assert mcolors.to_rgb(drawn_colors["DiLoCo H=10"]) == pytest.approx(colors[id(h10[0])])


def test_a_group_missing_a_seed_says_so_and_is_not_on_the_front(tmp_path, monkeypatch):
    """A seed that diverged is not silently dropped from its group's mean (a survivor's mean of
    the rest would flatter it): the point says how many seeds it has, and stays off the front."""
    adamw = _seeded("AdamW-DDP", "adamw_ddp", 0.3, [3.0, 3.02])
    demo = _seeded("DeMo s=64 k=8", "demo", 0.004, [2.5, 2.6, 2.7])
    demo[2].summary["diverged"] = {"step": 7, "reason": "the loss is nan"}
    fig, (_paths, skipped) = drawn(monkeypatch, plot_loss_vs_mb, adamw + demo, tmp_path, formats=("png",))
    ax = fig.axes[0]
    assert [run for run, _why in skipped] == [demo[2]]
    assert "DeMo s=64 k=8 (2 of 3 seeds)" in [t.get_text() for t in ax.texts]
    rings = [c for c in ax.collections if hasattr(c, "get_sizes") and c.get_sizes().size and c.get_sizes()[0] == 150]
    assert [tuple(c.get_offsets()[0]) for c in rings] == [(0.3, pytest.approx(3.01))]  # AdamW-DDP alone

    # the group's first seed is the one that diverged: its label still comes from the group
    first_gone = _seeded("DeMo s=64 k=8", "demo", 0.004, [2.5, 2.6, 2.7])
    first_gone[0].summary["diverged"] = {"step": 7, "reason": "the loss is nan"}
    for annotate in (True, False):
        fig, _ = drawn(monkeypatch, plot_loss_vs_mb, adamw + first_gone, tmp_path, formats=("png",),
                       annotate=annotate)
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "DeMo s=64 k=8" in legend
