"""Token data: OLMo memmap files, the synthetic corpus, local text prepared into memmap."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lowcomm.data.memmap import BatchOrder, DataError, MemmapDataset, expand_paths, validation_indices
from lowcomm.data.prepare import prepare
from lowcomm.data.synthetic import META, SyntheticSpec, ensure_synthetic, read_meta

__all__ = ["BatchOrder", "DataError", "DataSource", "MemmapDataset", "open_data", "validation_indices"]


@dataclass
class DataSource:
    train: MemmapDataset
    val: MemmapDataset
    bayes_floor: float | None  # exact validation loss floor (synthetic only), nats/token
    description: str


def materialize(data, seq_len: int, run_root: str, tokenizer: str) -> dict:
    """Make sure the files exist (generating or tokenizing once); return paths and dtype."""
    if data.name == "synthetic":
        directory = ensure_synthetic(run_root, SyntheticSpec.from_data_config(data, seq_len))
        meta = read_meta(directory)
        return {"train": [directory / "train.bin"], "val": [directory / "val.bin"], "dtype": "uint16",
                "bayes_floor": meta["val_bayes_floor"], "description": f"synthetic ({directory})"}
    if data.name == "text":
        key = json.dumps({"paths": list(data.paths), "tok": tokenizer, "val": data.val_fraction}, sort_keys=True)
        directory = Path(run_root) / "data" / f"text-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
        if not (directory / META).is_file():
            prepare(list(data.paths), directory, tokenizer, data.val_fraction)
        meta = read_meta(directory)
        return {"train": [directory / "train.bin"], "val": [directory / "val.bin"], "dtype": meta["dtype"],
                "bayes_floor": None, "description": f"text ({directory})"}
    return {"train": expand_paths(data.paths, "data.paths"), "val": expand_paths(data.val_paths, "data.val_paths"),
            "dtype": data.dtype, "bayes_floor": None, "description": f"memmap ({len(data.paths)} path patterns)"}


def open_data(data, seq_len: int, run_root: str, tokenizer: str) -> DataSource:
    files = materialize(data, seq_len, run_root, tokenizer)
    return DataSource(
        train=MemmapDataset(files["train"], seq_len, files["dtype"]),
        val=MemmapDataset(files["val"], seq_len, files["dtype"]),
        bayes_floor=files["bayes_floor"],
        description=files["description"],
    )
