"""Run names: a run's directory name, derived from what it trains."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from lowcomm.units import parse_bandwidth

# Keys that do not change what is trained, so they do not change the run name.
_NOT_IN_RUN_NAME = ("run_root", "run_name", "wandb", "cluster", "experiment_name", "label")
_LOGISTICS = ("log_every", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_instances",
              "divergence_factor", "compile")
# and the optimizer's: how its step runs (DeMo's CUDA graphs: the eager step's updates to rounding)
_OPTIMIZER_LOGISTICS = ("cuda_graph",)
# keys added after runs were named, per config group, with what every run before them did: at
# these values they leave the name as it was, so a run started before they existed still finds its
# checkpoints (and load_run_config fills them in for a config saved before them)
ADDED_LATER = {"train": {"param_dtype": "fp32"}, "optimizer": {"bucket_cap_mb": 25}}


def what_is_trained(raw: dict[str, Any]) -> dict[str, Any]:
    """The part of a run config that decides what is trained: everything but where it runs and
    logs (cluster, wandb, run_root, label, ...) and the training loop's logistics (how often it
    logs, evaluates and checkpoints). A resume may change the rest, never this."""
    semantic = {k: v for k, v in raw.items() if k not in _NOT_IN_RUN_NAME}
    if isinstance(raw.get("train"), dict):  # (a hand-made config a report reads may have none)
        semantic["train"] = {k: v for k, v in raw["train"].items() if k not in _LOGISTICS}
    if isinstance(raw.get("optimizer"), dict):
        semantic["optimizer"] = {k: v for k, v in raw["optimizer"].items() if k not in _OPTIMIZER_LOGISTICS}
    return semantic


def changed_keys(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that both configs set and that differs (a key the
    older config lacks predates it: not a change)."""
    lines = []
    for key in sorted(set(before) & set(after)):
        old, new = before[key], after[key]
        if isinstance(old, dict) and isinstance(new, dict):
            lines += changed_keys(old, new, f"{prefix}{key}.")
        elif old != new:
            lines.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return lines


def derive_run_name(raw: dict[str, Any], world_size: int) -> str:
    """``<model>-<optimizer>[-<compression>]-w<W>-<hash>``: deterministic, so a requeued job
    finds its own checkpoints, and a different config never shares a directory."""
    semantic = what_is_trained(raw)
    for group, added in ADDED_LATER.items():  # (comparisons see these keys; only the name leaves them out)
        if isinstance(semantic.get(group), dict):
            semantic[group] = {k: v for k, v in semantic[group].items() if k not in added or v != added[k]}
    semantic["world_size"] = world_size
    cluster = raw.get("cluster") or {}
    if cluster.get("slow_ranks") and cluster.get("slowdown", 1) != 1:
        # the same training on unequal workers is another measurement: its own directory (named
        # as before where every worker is equal)
        semantic["slowdown"] = [sorted(cluster["slow_ranks"]), cluster["slowdown"]]
    if cluster.get("link_rate") is not None or cluster.get("slow_link_nodes"):  # so are shaped links
        semantic["links"] = [_bits_per_s(cluster.get("link_rate")), sorted(cluster.get("slow_link_nodes") or []),
                             _bits_per_s(cluster.get("slow_link_rate"))]
    digest = hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()[:8]
    parts = [raw["model"]["name"], raw["optimizer"]["name"]]
    if raw["compression"].get("name", "none") != "none":
        parts.append(raw["compression"]["name"])
    return "-".join(parts + [f"w{world_size}", digest])


def _bits_per_s(rate: Any) -> Any:
    """A link rate as the number it is (``100M``, ``100Mbit`` and ``1e8`` name one directory)."""
    try:
        return None if rate is None else parse_bandwidth(rate)
    except ValueError:  # refused by validation; named as written meanwhile
        return rate
