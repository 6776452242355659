"""``lowcomm-comm-table``: bytes per step of any optimizer config on the paper's models, from
parameter shapes alone (what the columns mean: :mod:`lowcomm.report.comm_table`).

    lowcomm-comm-table                                   # paper rows + every peer, both models
    lowcomm-comm-table --model olmo_1b --world-size 64
    lowcomm-comm-table --row "optimizer=flexdemo" --gpus-per-node 8      # intra / inter node rows
    lowcomm-comm-table --row "optimizer=diloco optimizer.sync_every=30" --row "optimizer=demo optimizer.wire=sign"
    lowcomm-comm-table --warmup --row "optimizer=powersgd"          # PowerSGD before compression starts

MB = 1e6 bytes, per worker and optimizer step (amortised over sync periods), as in the paper.
A strategy whose traffic crosses two links (FlexDeMo: inside a node, across nodes) gets one row
per link under its total.
"""

from __future__ import annotations

import argparse
import csv
import shlex
import sys
from pathlib import Path

from lowcomm.cli.helptext import plain
from lowcomm.hardware import PAPER_GPUS_PER_NODE as GPUS_PER_NODE

# The paper's two models (lowcomm.report.comm_table.MODELS), repeated so that --help needs no
# torch; a test keeps the two equal.
MODELS = ("olmo_300m", "olmo_1b")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowcomm-comm-table", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=list(MODELS), help="model config names")
    parser.add_argument("--world-size", type=int, default=64, help="W for tx/rx (default: the paper's 64)")
    parser.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE,
                        help="ranks per node, for strategies grouped by node (default: the paper's 8)")
    parser.add_argument("--row", action="append", metavar="OVERRIDES",
                        help="an optimizer config as Hydra overrides (repeatable); replaces the default rows")
    parser.add_argument("--warmup", action="store_true",
                        help="--row bytes before compression starts (PowerSGD's warm-up steps)")
    parser.add_argument("--csv", type=Path, help="also write the table as CSV")
    args = parser.parse_args(argv)
    from lowcomm.config import ConfigError
    from lowcomm.report.comm_table import build_table, crossover_text, format_table

    rows = [(spec, shlex.split(spec), args.warmup) for spec in args.row] if args.row else None
    try:
        table = build_table(args.model, args.world_size, rows, args.gpus_per_node)
    except ConfigError as exc:
        print(f"lowcomm-comm-table: {exc}", file=sys.stderr)
        return 2
    print(format_table(table, args.world_size))
    if rows is None:
        print("\nMB = 1e6 bytes per worker and step. payload: what one worker contributes (the paper's Tx MB/step); "
              "tx / rx: what it sends / receives\nunder the algorithm that runs (all-reduce 2(W-1)/W x payload; the "
              "quantized all-reduce about the same, an all-to-all then an all-gather; all-gather (W-1) x payload);\n"
              f"inter-node tx: the part of tx that crosses between nodes ({args.gpus_per_node} ranks per node; a world "
              "ring leaves each node once: nodes / W of ring tx;\nan all-to-all sends (W - ranks per node) / (W-1) of "
              "its bytes to other nodes). crossover W: the smallest world size at which\nthe row's tx per worker "
              "exceeds AdamW-DDP's (bf16); 'none': not up to 2^20 (an all-reduce against an all-reduce).\n"
              "'truncated': lowcomm's value cut to the paper's printed decimals equals the paper's (the paper "
              "truncates).\nThe paper's DeMo column is 12 bytes per kept coefficient (int64 index + fp32 value). "
              "Its AdamW-DDP rows are close to 2 bytes per parameter\n(bf16 gradients: 639.9 and 2353.5 MB) but not "
              "equal to it (636.9 and 2416.6); lowcomm's AdamW-DDP sends bf16 gradients by default\n"
              "(optimizer.wire_dtype; float32 doubles every ratio). FlexDeMo's intra rows count one micro-batch: its "
              "parameter all-gathers inside a node\nrepeat for every micro-batch of a step; its inter row is what "
              "crosses between nodes, and its crossover is against the inter-node part\nof AdamW-DDP's ring "
              f"(nodes / W of its hops, {args.gpus_per_node} ranks per node).")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["model", "optimizer", "payload_MB_per_step", "tx_MB_per_step", "rx_MB_per_step",
                             "world_size", "inter_node_tx_MB_per_step", "crossover_world_size", "paper_MB_per_step"])
            for row in table:
                writer.writerow([row.model, row.label, row.payload_mb, row.tx_mb, row.rx_mb, args.world_size,
                                 row.inter_tx_mb, crossover_text(row), row.paper_text])
    return 0


if __name__ == "__main__":
    sys.exit(main())
