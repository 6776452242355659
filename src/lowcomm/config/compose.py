"""Hydra composition of the ``configs/`` tree, the same tree ``lowcomm-train`` reads, with
errors that name the key and what is allowed.

Hydra refuses an unknown key or group option with a message that names neither what is valid
nor what was probably meant, and suggests ``+key=value``, which would add the typo to the
config. :func:`compose` turns every such failure into a :class:`~lowcomm.config.ConfigError`;
a ``+typo`` that Hydra accepts is refused later by :func:`lowcomm.config.validate`.

A composition costs ~0.2 s (Hydra re-reads and re-merges the tree's YAML files each time), and
a sweep's jobs differ mostly in values (``seed=1``, ``optimizer.compression_topk=8``), not in
the groups they select. So :func:`compose` does what Hydra does in two steps and keeps the
first: the group selections (``optimizer=demo``, ``experiment=...``) are composed by Hydra
once per process, and the value overrides are applied to a copy of that result by Hydra's own
routine, in Hydra's order (every group first, then the values as given). The cache's key holds
the config directory and every YAML file's modification time and size, so an edited tree is
composed afresh; an override of another kind (a sweep, ``hydra.*``, a package) takes Hydra's
whole path. ``tests/test_config.py`` checks the two paths agree on every shipped sweep's jobs.
"""

from __future__ import annotations

import copy
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from lowcomm.config.schema import SECTIONS, TOP_LEVEL_KEYS, ConfigError
from lowcomm.config.suggest import did_you_mean, unknown_key_message
from lowcomm.config.validation import section_keys, sections_with_key
from lowcomm.paths import config_dir, group_options

_CACHE_SIZE = 1024
_composed: OrderedDict[tuple, DictConfig] = OrderedDict()


def _tree_stamp(root: str) -> tuple:
    """Every YAML file under ``root`` with its modification time and size."""
    stamp = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith((".yaml", ".yml")):
                info = os.stat(os.path.join(folder, name))
                stamp.append((folder, name, info.st_mtime_ns, info.st_size))
    return tuple(sorted(stamp))


def _whole(root: str, overrides: tuple[str, ...]) -> DictConfig:
    """Hydra's composition of ``overrides`` from ``root``, once per process for each tree and
    list; the caller gets a copy, which it may change."""
    key = (root, _tree_stamp(root), overrides)
    if key not in _composed:
        with initialize_config_dir(root, version_base="1.3"):
            _composed[key] = hydra_compose("train", overrides=list(overrides))
        while len(_composed) > _CACHE_SIZE:
            _composed.popitem(last=False)
    _composed.move_to_end(key)
    return copy.deepcopy(_composed[key])


def _split(overrides: Sequence[str], groups: set[str]) -> tuple[list[str], list[Override]] | None:
    """The group selections and the value overrides of ``overrides``, or None where one is of a
    kind the two-step path does not take (a sweep, ``hydra.*``, a package, one that does not
    parse: Hydra's whole path handles and reports those)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return None
    selections, values = [], []
    for override in parsed:
        if (override.is_sweep_override() or override.is_hydra_override() or override.package is not None
                or "/" in override.key_or_group):  # a nested group: Hydra's whole path
            return None
        # a group's key given a mapping (optimizer={lr: 0.2}) is a value to Hydra, in its order
        selection = override.key_or_group in groups and not isinstance(override.value(), dict)
        (selections if selection else values).append(override)
    return [override.input_line for override in selections], values


def _hydra_compose(overrides: Sequence[str], *, whole: bool = False) -> DictConfig:
    """The composed config for ``overrides`` (``whole``: by Hydra's single call, no split)."""
    root = str(config_dir())
    split = None if whole else _split(overrides, set(group_options(Path(root))))
    if split is None:
        return _whole(root, tuple(overrides))
    selections, values = split
    config = _whole(root, tuple(selections))
    ConfigLoaderImpl._apply_overrides_to_config(values, config)
    return config


def compose(overrides: Sequence[str]) -> DictConfig:
    """The composed config for ``overrides``; raises ConfigError naming every bad override."""
    try:
        return _hydra_compose(overrides)
    except HydraException as exc:
        problems = diagnose(overrides)
        raise ConfigError(problems or [" ".join(str(exc).split())]) from exc


def _unknown_top_level(key: str) -> str:
    """An unknown top-level key; where a section has a key of that name (``compression_topk``
    given without ``optimizer.``), that key, else the closest top-level key."""
    note = " (a leading + would only add the typo to the config.)"
    homes = sections_with_key(key) if "." not in key else []
    if not homes:
        return unknown_key_message(key, TOP_LEVEL_KEYS, "the config", note=note)
    where = " or ".join(f"{dotted} (a key of {owners})" for dotted, owners in homes)
    return f"{key} is not a key of the config; did you mean {where}?{note}"


def value_lists(overrides: Sequence[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Hydra's multirun lists among ``overrides`` (``optimizer=demo,adamw_ddp``: key -> values)
    and the other overrides, in order."""
    parser = OverridesParser.create()
    grid, base = {}, []
    for line in overrides:
        try:
            override = parser.parse_overrides([line])[0]
        except HydraException:
            base.append(line)
            continue
        if override.is_sweep_override():
            grid[override.key_or_group] = [str(value) for value in override.sweep_iterator()]
        else:
            base.append(line)
    return grid, base


def sweep_hint(overrides: Sequence[str]) -> str:
    """One line for Hydra's multirun habits (``optimizer=demo,adamw_ddp``, ``-m``): lowcomm-train
    runs one config; the same grid as a sweep file for ``lowcomm-sweep``, written out."""
    grid, base = value_lists(overrides)
    if not grid:
        return ("there is no -m / --multirun: lowcomm-train runs one config; for several, write a sweep file "
                "(base: [...], points: or grid: {key: [values]}) and run lowcomm-sweep run FILE "
                "(lowcomm-sweep submit FILE --dry-run for SLURM)")
    runs = math.prod(len(values) for values in grid.values())
    # the sweep file itself, as one line of YAML (a flow mapping)
    grid_text = "{" + ", ".join(f"{key}: [{', '.join(values)}]" for key, values in grid.items()) + "}"
    sweep = "{" + (f"base: [{', '.join(base)}], " if base else "") + f"grid: {grid_text}" + "}"
    return (f"{' '.join(k + '=' + ','.join(v) for k, v in grid.items())} is a sweep of {runs} runs and lowcomm-train "
            f"runs one: write a sweep file holding {sweep} and run lowcomm-sweep run FILE "
            "(lowcomm-sweep submit FILE --dry-run for SLURM)")


def diagnose(overrides: Sequence[str]) -> list[str]:
    """What is wrong with ``overrides``, each problem naming its key: an unknown top-level key,
    an unknown option of a group, an unknown key inside a section."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        return [f"cannot parse the overrides: {' '.join(str(exc).split())}"]
    groups = group_options()
    errors: list[str] = []
    selections: list[str] = []
    refused: set[str] = set()  # groups whose option does not exist: their keys are not checked
    dotted = []
    for override in parsed:
        key = override.key_or_group
        head, _, rest = key.partition(".")
        if override.is_sweep_override():
            hint = sweep_hint([o.input_line for o in parsed])
            if hint not in errors:
                errors.append(hint)
        elif head not in TOP_LEVEL_KEYS:
            errors.append(_unknown_top_level(key))
        elif not rest and head in groups and not override.is_delete():
            value = override.value()
            if value is not None and value not in groups[head]:
                errors.append(f"{head}={value}: configs/{head}/{value}.yaml does not exist"
                              f"{did_you_mean(str(value), groups[head])}; choose one of: {', '.join(groups[head])}")
                refused.add(head)
            else:
                selections.append(override.input_line)
        elif rest and head in SECTIONS:
            dotted.append((head, rest))
    if dotted:
        try:
            base = OmegaConf.to_container(_hydra_compose(selections), resolve=False)
        except HydraException:
            return errors
        for head, rest in dotted:
            if head in refused:  # against the default option's keys, a second, spurious error
                continue
            known = section_keys(head, base.get(head) or {})
            field = rest.split(".")[0]
            if known is not None and field not in known[0]:
                errors.append(unknown_key_message(f"{head}.{field}", known[0], known[1]))
    return errors
