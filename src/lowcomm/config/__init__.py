"""Config schemas and validation: everything is checked here, before any process is spawned
or any job submitted, and every error names the key and what is allowed.

The Hydra tree under ``configs/`` composes a DictConfig (:mod:`.compose`); :func:`validate`
turns it into a :class:`RunConfig` of typed dataclasses or raises :class:`ConfigError` listing
every problem. One module per concern:

- :mod:`.schema`: the sections' dataclasses, :class:`RunConfig`, :class:`ConfigError`, the keys
  a config may hold;
- :mod:`.validation`: :func:`validate` and its checks of each section;
- :mod:`.cluster`: the checks of a SLURM profile, :func:`slurm_profile`;
- :mod:`.naming`: a run's name, derived from what it trains;
- :mod:`.suggest`: did-you-mean messages for unknown keys and options;
- :mod:`.compose`: Hydra composition with those messages; :mod:`.sweep`: sweep files as jobs.

The names below are the package's interface; import them from ``lowcomm.config``.
"""

from __future__ import annotations

from lowcomm.config.cluster import slurm_profile
from lowcomm.config.schema import (
    ClusterSpec,
    ConfigError,
    DataSpec,
    RunConfig,
    TrainSpec,
    WandbSpec,
    load_run_config,
)
from lowcomm.config.validation import validate, validate_optimizer
from lowcomm.paths import config_dir, repo_root

__all__ = [
    "ClusterSpec",
    "ConfigError",
    "DataSpec",
    "RunConfig",
    "TrainSpec",
    "WandbSpec",
    "config_dir",
    "load_run_config",
    "repo_root",
    "slurm_profile",
    "validate",
    "validate_optimizer",
]
