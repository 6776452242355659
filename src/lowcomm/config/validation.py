"""Validation of a composed config: every key and value checked, every problem reported at
once as a :class:`~lowcomm.config.schema.ConfigError`, before any process is spawned or any
job submitted. :func:`validate` turns a config into a :class:`~lowcomm.config.schema.RunConfig`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError, OmegaConfBaseException

from lowcomm.compress import CODECS, build_codec, codec_config_errors, cpu_kernels
from lowcomm.config.cluster import (
    cluster_errors,
    every_launcher_errors,
    normalised,
)
from lowcomm.config.naming import derive_run_name
from lowcomm.config.schema import (
    SECTIONS,
    TOP_LEVEL_KEYS,
    ClusterSpec,
    ConfigError,
    DataSpec,
    RunConfig,
    TrainSpec,
    WandbSpec,
)
from lowcomm.config.suggest import unknown_key_message
from lowcomm.data.memmap import DTYPES, DataError, check_token_file, expand_paths
from lowcomm.data.synthetic import SyntheticSpec
from lowcomm.models.olmo import ModelSpec
from lowcomm.strategies import STRATEGIES


def sections_with_key(leaf: str) -> list[tuple[str, str]]:
    """Where a key named ``leaf`` lives: ``(dotted key, the option that has it)`` for every
    section and option that has it (``("optimizer.compression_topk", "optimizer=demo")``), for
    a key given without its section."""
    found = [(f"{section}.{leaf}", section) for section in ("model", "train", "data", "cluster", "wandb")
             if leaf in section_keys(section, {})[0]]
    owners = [name for name, strategy in STRATEGIES.items()
              if leaf in {"name", *(f.name for f in dataclasses.fields(strategy.Config))}]
    if owners:
        found.append((f"optimizer.{leaf}", _options("optimizer", owners, len(STRATEGIES))))
    codecs = [name for name, codec in CODECS.items() if leaf in {"name", *inspect.signature(codec).parameters}]
    if codecs:
        found.append((f"compression.{leaf}", _options("compression", codecs, len(CODECS))))
    return found


def _options(group: str, names: list[str], of: int) -> str:
    """``optimizer=demo or flexdemo``; ``every optimizer`` when all have it."""
    return f"every {group}" if len(names) == of else f"{group}={' or '.join(names)}"


def section_keys(section: str, node: Mapping[str, Any]) -> tuple[list[str], str] | None:
    """The keys a config section may hold (given its chosen option) and how to call it in a
    message; None when the section's option is itself unknown (reported elsewhere)."""
    schemas = {"model": ModelSpec, "train": TrainSpec, "data": DataSpec, "cluster": ClusterSpec,
               "wandb": WandbSpec}
    if section in schemas:
        return [f.name for f in dataclasses.fields(schemas[section])], section
    name = node.get("name", "none") if isinstance(node, Mapping) else None
    if section == "optimizer":
        if name not in STRATEGIES:
            return None
        return ["name", *(f.name for f in dataclasses.fields(STRATEGIES[name].Config))], f"optimizer={name}"
    if section == "compression":
        if name == "none":
            return ["name"], "compression=none"
        if name not in CODECS:
            return None
        parameters = inspect.signature(CODECS[name]).parameters
        return ["name", *parameters], f"compression={name}"
    return None


def unknown_keys(raw: Mapping[str, Any]) -> list[str]:
    """One message per key of a composed config that lowcomm does not know."""
    errors = [unknown_key_message(key, TOP_LEVEL_KEYS, "the config") for key in raw if key not in TOP_LEVEL_KEYS]
    for section in SECTIONS:
        node = raw.get(section)
        known = section_keys(section, node) if isinstance(node, Mapping) else None
        if known is None:
            continue
        allowed, where = known
        errors += [unknown_key_message(f"{section}.{key}", allowed, where) for key in node if key not in allowed]
    return errors


def _typed(schema: type, node: Any, key: str, errors: list[str]):
    """Merge a config node into its dataclass schema; report bad types by their full key
    (unknown keys are reported by :func:`unknown_keys` first)."""
    allowed = {f.name for f in dataclasses.fields(schema)}
    node = {k: v for k, v in node.items() if k in allowed} if isinstance(node, Mapping) else node
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        detail = str(exc).splitlines()[0]
        full_key = f"{key}.{exc.full_key}" if getattr(exc, "full_key", None) else key
        errors.append(f"{full_key}: {detail}")
        return None


def _one_of(value: Any, allowed: tuple, key: str, errors: list[str]) -> None:
    if value not in allowed:
        errors.append(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


# Keys that hold paths. An unset environment variable must not move a run elsewhere: the shell
# turns run_root=/scratch/$USER/lowcomm with USER unset into /scratch//lowcomm, which is
# /scratch/lowcomm to every reader.
PATH_KEYS = ("run_root", "data.paths", "data.val_paths")
_SHELL_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def interpolation_error(exc: InterpolationResolutionError) -> str:
    """One line for an interpolation that cannot be resolved, naming the key and the variable."""
    detail = str(exc).splitlines()[0]
    key = exc.full_key or "the config"
    variable = re.search(r"Environment variable '([^']+)' not found", detail)
    if variable:
        return (f"{key}: the environment variable {variable.group(1)} is not set (${{oc.env:{variable.group(1)}}}); "
                "set it, or write the value out")
    missing = re.search(r"Interpolation key '([^']+)' not found", detail)
    if isinstance(exc, InterpolationKeyError) and missing:
        return (f"{key}: ${{{missing.group(1)}}} names no config key; for the environment variable write "
                f"${{oc.env:{missing.group(1)}}}, or let the shell expand ${missing.group(1)}")
    return f"{key}: {detail}"


def path_errors(raw: Mapping[str, Any]) -> list[str]:
    """Paths that an unset or unexpanded environment variable has left wrong, each naming its key."""
    errors = []
    for key in PATH_KEYS:
        section, _, leaf = key.rpartition(".")
        node = raw.get(section) if section else raw
        value = node.get(leaf) if isinstance(node, Mapping) else None
        for path in ([value] if isinstance(value, str) else value if isinstance(value, list) else []):
            if not isinstance(path, str):
                continue
            if "//" in path:
                errors.append(f"{key}={path}: an empty directory name ('//'), as an unset environment variable "
                              "leaves it (/scratch/$USER/lowcomm without USER): set the variable, or write the "
                              "path out")
            elif variable := _SHELL_VARIABLE.search(path):
                errors.append(f"{key}={path}: ${variable.group(1)} was not expanded (quoted in the shell?): write the "
                              f"path out, or ${{oc.env:{variable.group(1)}}}")
    return errors


def validate(cfg: DictConfig | dict, *, check_data_files: bool = True, require_data: bool = True) -> RunConfig:
    """Check a composed config completely; raise ConfigError with every problem found.

    ``check_data_files=False`` leaves out what needs the data files (they exist, their size
    and dtype agree): a dry run on a laptop plans a cluster run before its data is staged.
    ``require_data=False`` (with it) also accepts no data paths at all: analysis names a sweep's
    jobs to find their runs, and never reads their data."""
    if isinstance(cfg, DictConfig):
        try:
            raw = OmegaConf.to_container(cfg, resolve=True)
        except InterpolationResolutionError as exc:
            raise ConfigError([interpolation_error(exc)]) from None
        except OmegaConfBaseException as exc:
            raise ConfigError([f"{getattr(exc, 'full_key', None) or 'the config'}: {str(exc).splitlines()[0]}"]) from None
    else:
        raw = dict(cfg)
    errors: list[str] = path_errors(raw)
    for group in ("model", "optimizer", "compression", "data", "train", "cluster"):
        if not isinstance(raw.get(group), dict):
            errors.append(f"{group}: missing; the config must set the {group} group")
    if errors:
        raise ConfigError(errors)
    errors += unknown_keys(raw)
    try:  # read by every worker's first top-k on a CPU: a bad value is refused here, before spawn
        cpu_kernels.enabled()
    except ValueError as error:
        errors.append(str(error))

    model = _typed(ModelSpec, raw["model"], "model", errors)
    train = _typed(TrainSpec, raw["train"], "train", errors)
    data = _typed(DataSpec, raw["data"], "data", errors)
    cluster = _typed(ClusterSpec, raw["cluster"], "cluster", errors)
    wandb = _typed(WandbSpec, raw.get("wandb") or {}, "wandb", errors)

    opt_name, optimizer = _validate_optimizer(raw, errors)

    if model is not None:
        errors += model.validate()
    if cluster is not None:
        _one_of(cluster.launcher, ("local", "slurm"), "cluster.launcher", errors)
        _one_of(cluster.device, ("auto", "cpu", "cuda"), "cluster.device", errors)
        if cluster.launcher == "local" and cluster.workers < 1:
            errors.append(f"cluster.workers must be >= 1, got {cluster.workers}")
        if cluster.launcher != "slurm":  # a SLURM profile's checks below include them
            errors += every_launcher_errors(cluster)
        if cluster.launcher == "slurm":
            slurm_errors = cluster_errors(cluster)
            errors += slurm_errors
            if not slurm_errors:
                cluster = normalised(cluster)
    if wandb is not None:
        _one_of(wandb.mode, ("offline", "online", "disabled"), "wandb.mode", errors)
    if train is not None:
        _validate_train(train, model, cluster, errors)
        if getattr(optimizer, "cuda_graph", False) and train.param_dtype != "fp32":
            errors.append(f"optimizer.cuda_graph=true needs train.param_dtype=fp32, got {train.param_dtype}: a "
                          "captured step's learning rate is a tensor, which bf16 weights' arithmetic rounds to bf16")
    if optimizer is not None and cluster is not None and cluster.world_size >= 1:
        errors += STRATEGIES[opt_name].check_layout(optimizer, cluster.world_size, cluster.local_world_size)
        if cluster.fault_tolerance == "torchft":
            errors += STRATEGIES[opt_name].check_replica_groups(optimizer, raw["compression"])
            if STRATEGIES[opt_name].replica_groups_of_one_rank and cluster.ranks_per_group != 1:
                errors.append(f"optimizer={opt_name} runs as replica groups of one rank each (its exchange between "
                              f"them is an all-gather, built for one rank per group): set cluster.ranks_per_group=1, "
                              f"got {cluster.ranks_per_group}")
    if data is not None and train is not None:
        _validate_data(data, model, train, errors, check_files=check_data_files,
                       require_paths=require_data or check_data_files)

    experiment = str(raw.get("experiment_name") or "default")
    if errors:
        raise ConfigError(errors)
    # The config as run: the warm-up as a step count (what the loop uses; a run that stated the
    # same count explicitly has the same name).
    raw["train"] = {**{k: v for k, v in raw["train"].items() if k != "warmup_fraction"},
                    "warmup_steps": train.warmup_steps}
    world = cluster.world_size
    run_name = raw.get("run_name") or derive_run_name(raw, world)
    raw["run_name"] = run_name
    return RunConfig(
        model=model, optimizer=optimizer, optimizer_name=opt_name, compression=dict(raw["compression"]),
        data=data, train=train, cluster=cluster, wandb=wandb, experiment=experiment,
        run_root=str(raw.get("run_root") or "runs"), run_name=run_name, seed=int(raw.get("seed", 0)), raw=raw,
    )


def _validate_optimizer(raw: dict[str, Any], errors: list[str]):
    """The optimizer and compression groups: (strategy name, typed optimizer config or None)."""
    opt_fields = dict(raw["optimizer"])
    opt_name = opt_fields.pop("name", None)
    optimizer = None
    if opt_name not in STRATEGIES:
        _one_of(opt_name, tuple(sorted(STRATEGIES)), "optimizer.name", errors)
    else:
        strategy = STRATEGIES[opt_name]
        optimizer = _typed(strategy.Config, opt_fields, "optimizer", errors)
        if optimizer is not None:
            errors += optimizer.validate()
        compression_name = raw["compression"].get("name", "none")
        if compression_name not in ("none", *CODECS):
            _one_of(compression_name, ("none", *sorted(CODECS)), "compression.name", errors)
        elif compression_name != "none" and not strategy.accepts_codec(CODECS[compression_name]):
            accepted = ["none", *sorted(name for name, codec in CODECS.items() if strategy.accepts_codec(codec))]
            errors.append(
                f"compression={compression_name} cannot be used with optimizer={opt_name}; "
                f"it accepts: {', '.join(accepted)}"
            )
        else:
            try:  # a codec checks its own fields (bits, fraction, wire...) when built
                build_codec(raw["compression"])
            except (TypeError, ValueError) as exc:
                errors.append(f"compression: {exc}")
            else:  # and may refuse settings it can run but that a config should not ask for
                errors += codec_config_errors(raw["compression"])
            if optimizer is not None:
                errors += strategy.check_compression(optimizer, raw["compression"])
    return opt_name, optimizer


def validate_optimizer(raw: dict[str, Any]):
    """Just the optimizer and compression groups (for tools that need no data or cluster, such
    as the comm table); raises ConfigError."""
    errors: list[str] = []
    opt_name, optimizer = _validate_optimizer(raw, errors)
    if errors:
        raise ConfigError(errors)
    return STRATEGIES[opt_name], optimizer


def _validate_train(train: TrainSpec, model: ModelSpec | None, cluster: ClusterSpec | None, errors: list[str]):
    for key in ("global_batch_size", "micro_batch_size", "max_steps", "log_every", "eval_instances"):
        if getattr(train, key) < 1:
            errors.append(f"train.{key} must be >= 1, got {getattr(train, key)}")
    if train.seq_len < 2:
        errors.append(f"train.seq_len must be >= 2 (inputs and targets are shifted by one), got {train.seq_len}")
    if model is not None and train.seq_len > model.max_sequence_length:
        errors.append(
            f"train.seq_len={train.seq_len} is above the model's maximum "
            f"(model.max_sequence_length={model.max_sequence_length})"
        )
    if cluster is not None and train.global_batch_size >= 1 and train.micro_batch_size >= 1:
        world = cluster.world_size
        if world >= 1 and train.global_batch_size % (world * train.micro_batch_size):
            errors.append(
                f"train.global_batch_size={train.global_batch_size} is not divisible by world size x "
                f"micro-batch = {world} x {train.micro_batch_size} = {world * train.micro_batch_size}"
            )
    if not 0 <= train.warmup_fraction <= 1:
        errors.append(f"train.warmup_fraction must be in [0, 1], got {train.warmup_fraction}")
    elif train.warmup_steps is None:
        train.warmup_steps = round(train.warmup_fraction * max(train.max_steps, 0))
    elif train.warmup_steps < 0 or train.warmup_steps > train.max_steps:
        errors.append(
            f"train.warmup_steps={train.warmup_steps} must be in [0, train.max_steps={train.max_steps}] "
            "(or null: train.warmup_fraction of the run)"
        )
    if not 0 <= train.alpha_f <= 1:
        errors.append(f"train.alpha_f must be in [0, 1], got {train.alpha_f}")
    if train.max_grad_norm < 0:
        errors.append(f"train.max_grad_norm must be >= 0 (0 disables clipping), got {train.max_grad_norm}")
    _one_of(train.precision, ("auto", "fp32", "bf16"), "train.precision", errors)
    _one_of(train.param_dtype, ("fp32", "bf16"), "train.param_dtype", errors)
    if not (train.compile == "auto" or isinstance(train.compile, bool)):
        errors.append(f"train.compile={train.compile!r} is not allowed; choose one of: true, false, auto "
                      "(auto: on GPU only)")
    if train.checkpoint_every < 0 or train.eval_every < 0:
        errors.append("train.checkpoint_every and train.eval_every must be >= 0 (0 disables)")
    if train.keep_checkpoints < 1:
        errors.append(f"train.keep_checkpoints must be >= 1, got {train.keep_checkpoints}")
    factor = train.divergence_factor
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 1):
        errors.append(f"train.divergence_factor must be a number > 1 (a multiple of the uniform guess's loss, "
                      f"ln of the vocabulary size) or null (stop on a non-finite loss only), got {factor!r}")


def _validate_data(data: DataSpec, model: ModelSpec | None, train: TrainSpec, errors: list[str],
                   check_files: bool = True, require_paths: bool = True):
    _one_of(data.name, ("synthetic", "memmap", "text"), "data.name", errors)
    if data.name == "synthetic":
        if model is not None and model.tokenizer != "bytes":
            errors.append(f"data=synthetic is written in the byte tokenizer; model.tokenizer is {model.tokenizer!r}")
        errors += SyntheticSpec.from_data_config(data, train.seq_len).validate() if len(data.doc_length) == 2 else [
            f"data.doc_length must be [min, max], got {data.doc_length}"
        ]
        return
    if data.name == "memmap":
        _one_of(data.dtype, tuple(DTYPES), "data.dtype", errors)
        for key in ("paths", "val_paths"):
            if not getattr(data, key):
                if require_paths:
                    errors.append(f"data.{key} is empty: give at least one file path or glob")
                continue
            if not check_files:
                continue
            try:
                for path in expand_paths(getattr(data, key), f"data.{key}"):
                    # from the sizes only; the contents are scanned once, before spawning
                    # (lowcomm.config.data_checks.check_run_data)
                    check_token_file(path, data.dtype, seq_len=train.seq_len, key=f"data.{key}")
            except DataError as exc:
                errors.append(str(exc))
        return
    if data.name == "text":
        if not data.paths:
            if require_paths:
                errors.append("data.paths is empty: give at least one file path or glob")
        elif check_files:
            try:
                expand_paths(data.paths, "data.paths")
            except DataError as exc:
                errors.append(str(exc))
        if not 0 < data.val_fraction < 1:
            errors.append(f"data.val_fraction must be in (0, 1), got {data.val_fraction}")
