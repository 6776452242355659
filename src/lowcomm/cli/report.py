"""Command lines of the paper's artifacts (the scripts in ``analysis/`` call these).

Each selects runs by glob (``--runs 'runs/table1_1b/*'``) or by the sweep that made them
(``--sweep table1_1b``: every job's run directory; those not run yet are listed as missing),
reads only run directories and ``results/``, writes its outputs and prints their paths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lowcomm.paths import repo_root

if TYPE_CHECKING:
    from lowcomm.report.select import Selection

# The library is imported inside each command, after its arguments are parsed, so that --help
# answers without loading torch and matplotlib.


def _selection_parser(prog: str, description: str, *, figures: bool = True) -> argparse.ArgumentParser:
    """The options every analysis command shares: which runs, where to write; ``figures``: and
    in which formats (a command that writes only tables does not offer it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--runs", nargs="+", metavar="GLOB", help="run directories; quote globs")
    which.add_argument("--sweep", metavar="NAME", help="the runs of sweeps/NAME.yaml (or a sweep file)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="with --sweep: a Hydra override added to every job, as at launch (repeatable)")
    parser.add_argument("--run-root", help="with --sweep: where the runs are (same as --override run_root=DIR)")
    parser.add_argument("--out", type=Path, help="output directory (default: results/<sweep> or results/report)")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="with --sweep: list each job whose run was found by its recorded config")
    if figures:
        parser.add_argument("--formats", nargs="+", choices=["png", "pdf", "svg"],
                            help="figure formats (default: png and pdf)")
        parser.add_argument("--title", default="", help="the figure's title (default: says what is plotted)")
    return parser


def _select(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Selection, Path]:
    """The runs asked for (or a parser error if there are none) and the output directory."""
    from lowcomm.config import ConfigError
    from lowcomm.report.figures import FORMATS
    from lowcomm.report.select import select_by_globs, select_by_sweep

    if hasattr(args, "formats"):
        args.formats = tuple(args.formats or FORMATS)
    if args.sweep is None and (args.override or args.run_root):
        parser.error("--override and --run-root apply to --sweep only")
    if args.sweep is not None:
        overrides = [*args.override, *([f"run_root={args.run_root}"] if args.run_root else [])]
        try:
            selection = select_by_sweep(args.sweep, overrides)
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            parser.error(str(exc))
        default_out = repo_root() / "results" / Path(args.sweep).stem
    else:
        selection = select_by_globs(args.runs)
        default_out = repo_root() / "results" / "report"
    for line in selection.found_lines(verbose=args.verbose):
        print(line, file=sys.stderr)
    for missing in selection.missing:
        print(f"missing: {missing}", file=sys.stderr)
    if not selection.runs:
        parser.error("no run directory found")
    return selection, args.out or default_out


def table1_main(argv: list[str] | None = None) -> int:
    """``analysis/table1.py``: the paper's Table 1 as Markdown (printed), LaTeX and CSV."""
    parser = _selection_parser("lowcomm-table1", "The DeMo paper's Table 1 from runs, beside the paper's numbers: "
                               "Markdown (printed), LaTeX and CSV; the figures are lowcomm-loss-vs-mb's and "
                               "lowcomm-curves'.", figures=False)
    parser.add_argument("--paper", type=Path, help="the paper's numbers (default: results/paper/table1.csv)")
    parser.add_argument("--no-paper", action="store_true", help="ours only")
    parser.add_argument("--eval-step", type=int, help="benchmarks of this step's evaluation (default: latest)")
    parser.add_argument("--loss", choices=["val", "train"], default="val",
                        help="our final loss: the final validation loss (default) or the last training loss")
    parser.add_argument("--all-paper-rows", action="store_true",
                        help="also list the paper's rows (for the runs' models) that no run reproduces")
    parser.add_argument("--stem", default="table1", help="output file names: STEM.md, STEM.tex, STEM.csv")
    args, unknown = parser.parse_known_args(argv)
    if any(arg.split("=")[0] in ("--formats", "--title") for arg in unknown):
        # the figure commands' options: say where they belong instead of "unrecognized arguments"
        parser.error("lowcomm-table1 writes tables only (STEM.md, STEM.tex, STEM.csv); --formats and --title are "
                     "for the figures: lowcomm-loss-vs-mb and lowcomm-curves")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from lowcomm.report.paper import load_paper_table1, paper_table1_path
    from lowcomm.report.table1 import build_table1

    selection, out_dir = _select(parser, args)
    paper_rows = []
    if not args.no_paper:
        paper_file = args.paper or paper_table1_path()
        if paper_file.is_file():
            paper_rows = load_paper_table1(paper_file)
        elif args.paper:
            parser.error(f"{paper_file} does not exist")
        else:
            print(f"note: {paper_file} not found; the paper's numbers are left out", file=sys.stderr)
    table = build_table1(selection.runs, paper_rows, eval_step=args.eval_step,
                         include_unmatched_paper=args.all_paper_rows, loss=args.loss)
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = table.to_markdown()
    (out_dir / f"{args.stem}.md").write_text(markdown + "\n")
    (out_dir / f"{args.stem}.tex").write_text(table.to_latex() + "\n")
    table.write_csv(out_dir / f"{args.stem}.csv")
    print(markdown)
    print()
    for suffix in ("md", "tex", "csv"):
        print(f"table: {out_dir / f'{args.stem}.{suffix}'}")
    return 0


def loss_vs_mb_main(argv: list[str] | None = None) -> int:
    """``analysis/loss_vs_mb.py``: final loss against MB/step with the Pareto front (Figure 4)."""
    parser = _selection_parser("lowcomm-loss-vs-mb", "Final validation loss against MB/step, with the Pareto front.")
    parser.add_argument("--perplexity", action="store_true", help="plot exp(loss)")
    parser.add_argument("--mb", choices=["payload", "tx"], default="payload",
                        help="payload: the papers' Tx MB/step (default); tx: bytes sent under the ring algorithm")
    parser.add_argument("--no-annotate", action="store_true", help="do not label each point")
    parser.add_argument("--stem", default="loss_vs_mb", help="output file name without extension")
    args = parser.parse_args(argv)
    from lowcomm.report.figures import plot_loss_vs_mb

    selection, out_dir = _select(parser, args)
    paths, skipped = plot_loss_vs_mb(selection.runs, out_dir, stem=args.stem, mb=args.mb,
                                     perplexity=args.perplexity, annotate=not args.no_annotate,
                                     formats=tuple(args.formats), title=args.title)
    for run, reason in skipped:
        print(f"left out: {run.path}: {reason}", file=sys.stderr)
    for path in paths:
        print(f"figure: {path}")
    return 0


def curves_main(argv: list[str] | None = None) -> int:
    """``analysis/curves.py``: loss against steps and against cumulative MB (Figure 2)."""
    parser = _selection_parser("lowcomm-curves", "Loss curves against optimizer steps and cumulative MB sent.")
    parser.add_argument("--key", nargs="+", default=["train/loss"], metavar="METRIC",
                        help="metrics.jsonl key(s) to plot, e.g. train/loss val/loss (default: train/loss)")
    parser.add_argument("--perplexity", action="store_true", help="plot exp(loss)")
    parser.add_argument("--smoothing", type=float, default=0.0, help="EMA weight in [0, 1) (default 0: raw)")
    parser.add_argument("--linear-mb", action="store_true", help="linear cumulative-MB axis (default: log)")
    args = parser.parse_args(argv)
    if not 0 <= args.smoothing < 1:
        parser.error(f"--smoothing must be in [0, 1), got {args.smoothing}")
    from lowcomm.report.figures import plot_loss_curves

    selection, out_dir = _select(parser, args)
    for key in args.key:
        for run in selection.runs:
            if not run.series(key)[0]:
                print(f"left out of {key}: {run.path}: none logged", file=sys.stderr)
        for path in plot_loss_curves(selection.runs, out_dir, key=key, formats=tuple(args.formats),
                                     title=args.title, perplexity=args.perplexity,
                                     smoothing=args.smoothing, log_mb=not args.linear_mb):
            print(f"figure: {path}")
    return 0


def wallclock_main(argv: list[str] | None = None) -> int:
    """``lowcomm-wallclock``: loss against estimated wall-clock time on network links."""
    parser = _selection_parser(
        "lowcomm-wallclock",
        "Validation loss against estimated wall-clock time over network links: each run's measured compute "
        "per step plus its metered traffic (tx and messages per rank) on each link, "
        "step time = compute + max(0, tx/bandwidth + messages x latency - overlap x compute). Prints, per "
        "link, the time each run needs to reach an excess loss over the Bayes floor, and draws loss against "
        "time, one panel per link. Example: lowcomm-wallclock --runs 'runs/quickstart/*' --link wan:1G:10ms")
    parser.add_argument("--link", action="append", default=[], metavar="NAME:BANDWIDTH:LATENCY",
                        help="a link, e.g. wan:1G:10ms or ib:100Gbit:5us, or 'recorded': each run on the links "
                             "it recorded (cluster.link_rate / slow_link_nodes on network-namespace nodes: its "
                             "slowest node's rate) (repeatable; default: 1 Gbit/s WAN 10 ms, 10 Gbit/s Ethernet "
                             "50 us, 100 Gbit/s InfiniBand 5 us)")
    parser.add_argument("--intra-link", metavar="NAME:BANDWIDTH:LATENCY",
                        help="the link inside a node, for FlexDeMo's intra traffic (default: NVLink 3.6T, 3 us)")
    parser.add_argument("--ranks-per-link", type=int, default=1, metavar="N",
                        help="ranks of a node that share one inter-node link (default 1: a link per rank, as a "
                             "NIC per GPU; the ranks per node when each node has one uplink, e.g. over a WAN)")
    parser.add_argument("--target-excess", type=float, metavar="LOSS",
                        help="excess validation loss over the Bayes floor to time (default: the largest of "
                             "the runs' best excess losses, which every run reaches)")
    parser.add_argument("--slowdown", type=float, default=1.0, metavar="F",
                        help="place the runs as if their slowest worker computed F times slower than measured "
                             "(unequal workers; cluster.slowdown measures it for real; default 1)")
    parser.add_argument("--stem", default="wallclock", help="output names: STEM.md, STEM.csv, loss_vs_STEM.png")
    args = parser.parse_args(argv)
    from lowcomm.report.figures import plot_loss_vs_wallclock
    from lowcomm.report.runs import distinct_labels
    from lowcomm.report.tables import write_csv
    from lowcomm.report.wallclock import (
        DEFAULT_LINKS,
        INTRA_NODE,
        RECORDED,
        default_target,
        parse_link,
        recorded_link,
        timeline,
        wallclock_table,
    )

    try:
        links = [RECORDED if text == RECORDED else parse_link(text) for text in args.link] or list(DEFAULT_LINKS)
        intra = parse_link(args.intra_link) if args.intra_link else INTRA_NODE
    except ValueError as exc:
        parser.error(str(exc))
    if args.ranks_per_link < 1:
        parser.error(f"--ranks-per-link must be >= 1, got {args.ranks_per_link}")
    if not args.slowdown >= 1:
        parser.error(f"--slowdown must be a factor >= 1, got {args.slowdown}")
    selection, out_dir = _select(parser, args)
    runs, labels = selection.runs, distinct_labels(selection.runs)
    try:
        links = [recorded_link(runs) if link == RECORDED else link for link in links]
        per_link = [[timeline(run, link, intra=intra, ranks_per_link=args.ranks_per_link, slowdown=args.slowdown)
                     for run in runs] for link in links]
        target = args.target_excess if args.target_excess is not None else default_target(per_link[0])
        markdown, rows = wallclock_table(per_link, labels, target, args.ranks_per_link)
    except ValueError as exc:
        print(f"lowcomm-wallclock: {exc}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.stem}.md").write_text(markdown + "\n")
    write_csv(rows, out_dir / f"{args.stem}.csv")
    print(markdown)
    print(f"table: {out_dir / f'{args.stem}.md'}\ntable: {out_dir / f'{args.stem}.csv'}")
    panels = [(timelines[0].link.describe(), timelines) for timelines in per_link]
    for path in plot_loss_vs_wallclock(panels, labels, out_dir, target=target, stem=f"loss_vs_{args.stem}",
                                       formats=tuple(args.formats), title=args.title):
        print(f"figure: {path}")
    return 0
