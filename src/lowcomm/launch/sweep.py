"""Sweeps as files: ``sweeps/<name>.yaml`` lists only what varies.

    description: what the sweep reproduces
    base: [experiment=table1, model=olmo_1b]      # overrides for every job
    points:                                       # explicit jobs (optional; default: one empty point)
      - [optimizer=adamw_ddp]
      - [optimizer=demo, optimizer.compression_topk=4]
    grid:                                         # cartesian product applied to every point (optional)
      optimizer.compression_chunk: [64, 128]

Jobs = points x grid, each a list of Hydra overrides, in file order (grid varies fastest).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from lowcomm.config import repo_root


@dataclass
class Sweep:
    name: str
    description: str
    jobs: list[list[str]]


def sweep_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = repo_root() / "sweeps" / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    available = sorted(p.stem for p in (repo_root() / "sweeps").glob("*.yaml"))
    raise FileNotFoundError(f"no sweep {name_or_path!r}; available: {', '.join(available)}")


def _format(key: str, value) -> str:
    if isinstance(value, list | tuple):
        value = "[" + ",".join(map(str, value)) + "]"
    return f"{key}={value}"


def load_sweep(name_or_path: str) -> Sweep:
    path = sweep_path(name_or_path)
    spec = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    unknown = set(spec) - {"description", "base", "points", "grid"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: description, base, points, grid")
    base = [str(o) for o in spec.get("base") or []]
    points = spec.get("points") or [[]]
    grid = spec.get("grid") or {}
    axes = [[_format(key, value) for value in values] for key, values in grid.items()]
    jobs = [base + [str(o) for o in point] + list(combo) for point in points for combo in itertools.product(*axes)]
    return Sweep(name=path.stem, description=str(spec.get("description", "")), jobs=jobs)
