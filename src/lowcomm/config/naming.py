"""Run names: a run's directory name, derived from what it trains."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Keys that do not change what is trained, so they do not change the run name.
_NOT_IN_RUN_NAME = ("run_root", "run_name", "wandb", "cluster", "experiment_name", "label")
_LOGISTICS = ("log_every", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_instances",
              "divergence_factor")


def derive_run_name(raw: dict[str, Any], world_size: int) -> str:
    """``<model>-<optimizer>[-<compression>]-w<W>-<hash>``: deterministic, so a requeued job
    finds its own checkpoints, and a different config never shares a directory."""
    semantic = {k: v for k, v in raw.items() if k not in _NOT_IN_RUN_NAME}
    semantic["train"] = {k: v for k, v in raw["train"].items() if k not in _LOGISTICS}
    semantic["world_size"] = world_size
    digest = hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()[:8]
    parts = [raw["model"]["name"], raw["optimizer"]["name"]]
    if raw["compression"].get("name", "none") != "none":
        parts.append(raw["compression"]["name"])
    return "-".join(parts + [f"w{world_size}", digest])
