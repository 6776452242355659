"""A run's label in tables, legends and progress lines: the method's name as the papers write it
and the settings that tell it apart from the runs beside it (``DeMo s=32 k=16``, ``DiLoCo H=50``).

One rule for every reader: a sweep labels its jobs with it before anything runs
(:func:`lowcomm.config.sweep.load_sweep`, which writes the label into each run's config), and
the reports label run directories with it (:mod:`lowcomm.report.runs`), so a table built from
``runs/`` names a run as the sweep that trained it did.

- :func:`method_label`: the strategy's display name, plus the DCT block side and top-k of a run
  that sends DCT top-k coefficients (the DeMo paper's ``s`` and ``k``);
- :func:`distinct_labels`: runs that would share a label are told apart by the config values in
  which they differ, named by their last key (``lr=0.001``; the full key where two would read
  alike);
- :func:`template_label`: a sweep file's ``label:`` template, ``{name}`` and any dotted config
  key in braces (``"{name} lr={optimizer.lr}"``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lowcomm.config.naming import what_is_trained
from lowcomm.config.suggest import SHORT_NAMES
from lowcomm.strategies import STRATEGIES

# How the papers name each optimizer config (each strategy's ``display``).
OPTIMIZER_NAMES = {name: strategy.display.name for name, strategy in STRATEGIES.items()}

# More differing values than this make a label unreadable (reports then name the run directory).
MAX_DETAILS = 3


def dct_setting(config: Mapping[str, Any], field: str) -> Any:
    """``chunk`` or ``topk`` of a run that sends DCT top-k: the ``dct_topk`` compression group's,
    else the optimizer's own ``compression_<field>`` (DeMo's fields); None for any other run."""
    compression = config.get("compression") or {}
    if compression.get("name") == "dct_topk":
        return compression.get(field)
    return (config.get("optimizer") or {}).get(f"compression_{field}")


def method_label(config: Mapping[str, Any]) -> str:
    """The optimizer's display name and the constants that define the method as configured,
    as the papers write them: the bits of a quantized exchange (``2-bit``), the inner steps
    between synchronisations (``H=10``), and ``s=`` and ``k=`` for a run that sends DCT top-k
    (``MuLoCo 2-bit H=10``, ``DeMo s=64 k=8``)."""
    optimizer = config.get("optimizer") or {}
    name = OPTIMIZER_NAMES.get(optimizer.get("name", "?"), optimizer.get("name", "?"))
    compression = config.get("compression") or {}
    parts = [name]
    if compression.get("name") == "quantize" and compression.get("bits") is not None:
        parts.append(f"{compression['bits']}-bit")
    if optimizer.get("sync_every") is not None:
        parts.append(f"{SHORT_NAMES['sync_every']}={optimizer['sync_every']}")
    topk = dct_setting(config, "topk")
    if topk is not None:
        parts.append(f"s={dct_setting(config, 'chunk')} k={topk}")
    return " ".join(parts)


def run_label(config: Mapping[str, Any]) -> str:
    """The config's ``label`` if it has one, else :func:`method_label`."""
    return config.get("label") or method_label(config)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optimizer.lr": 0.001, ...}`` from a nested config."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, dotted))
        else:
            flat[dotted] = value
    return flat


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(format_value, value)) + "]"
    return str(value)


def _short_names(keys: Sequence[str]) -> dict[str, str]:
    """Each dotted key by its last part (``s``/``k`` for the DCT settings), the whole key where
    two keys would read alike."""
    short = {key: SHORT_NAMES.get(key.rsplit(".", 1)[-1], key.rsplit(".", 1)[-1]) for key in keys}
    clashing = {name for name in short.values() if list(short.values()).count(name) > 1}
    return {key: key if name in clashing else name for key, name in short.items()}


def _distinguishing(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a label may show of a config: what it trains (the run name's rule, so not where it
    is kept or how often it logs) and the cluster it trains on (its world size)."""
    return flatten({**what_is_trained(dict(config)), "cluster": config.get("cluster") or {}})


def differing_keys(configs: Sequence[Mapping[str, Any]], ignore: Collection[str] = ()) -> list[str]:
    """The dotted keys whose values are not the same in all of ``configs``, in sorted order."""
    flat = [_distinguishing(config) for config in configs]
    keys = sorted({key for config in flat for key in config} - set(ignore))
    return [key for key in keys if len({repr(config.get(key)) for config in flat}) > 1]


def distinct_labels(configs: Sequence[Mapping[str, Any]], labels: Sequence[str] | None = None, *,
                    ignore: Collection[str] = (), max_details: int | None = MAX_DETAILS,
                    fallbacks: Sequence[str] | None = None) -> list[str]:
    """``labels`` (default: each config's :func:`run_label`), each one shared by several configs
    extended by the values they differ in (``DeMo s=16 k=8 lr=0.001``). Where they differ in
    none (or, with ``max_details``, in too many to read) the config's entry of ``fallbacks`` is
    added instead, if given. Keys in ``ignore`` are not shown (a sweep's seeds: its runs over
    seeds share one label)."""
    labels = [run_label(config) for config in configs] if labels is None else list(labels)
    result = list(labels)
    for label in dict.fromkeys(labels):
        group = [i for i, other in enumerate(labels) if other == label]
        if len(group) < 2:
            continue
        differing = differing_keys([configs[i] for i in group], ignore)
        short = _short_names(differing)
        for i in group:
            flat = _distinguishing(configs[i])
            # a value the label already shows (a method's H) is not said twice
            shown = [key for key in differing if f"{short[key]}={format_value(flat.get(key))}" not in label.split()]
            if shown and (max_details is None or len(shown) <= max_details):
                detail = " ".join(f"{short[key]}={format_value(flat.get(key))}" for key in shown)
            elif fallbacks is not None:
                detail = fallbacks[i]
            else:
                continue
            result[i] = f"{label} {detail}"
    return result


_FIELD = re.compile(r"\{([A-Za-z_][\w.]*)\}")


def template_label(template: str, config: Mapping[str, Any]) -> str:
    """``template`` with ``{name}`` (the method's display name) and each ``{dotted.key}`` replaced
    by the config's value. Raises KeyError naming a key the config does not have."""
    flat = flatten(config)
    optimizer = (config.get("optimizer") or {}).get("name", "?")

    def value(match: re.Match) -> str:
        key = match.group(1)
        if key == "name":
            return OPTIMIZER_NAMES.get(optimizer, optimizer)
        if key not in flat:
            raise KeyError(key)
        return format_value(flat[key])

    return _FIELD.sub(value, template)
