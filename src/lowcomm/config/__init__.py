"""Config schemas and validation: everything is checked here, before any process is spawned
or any job submitted, and every error names the key and what is allowed.

The Hydra tree under ``configs/`` composes a DictConfig; :func:`validate` turns it into a
:class:`RunConfig` of typed dataclasses or raises :class:`ConfigError` listing every problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lowcomm.compress import CODECS, build_codec
from lowcomm.data.memmap import DTYPES, DataError, check_token_file, expand_paths
from lowcomm.data.synthetic import SyntheticSpec
from lowcomm.models.olmo import ModelSpec
from lowcomm.paths import config_dir, repo_root
from lowcomm.strategies import STRATEGIES

__all__ = ["ConfigError", "RunConfig", "config_dir", "repo_root", "slurm_profile", "validate"]


class ConfigError(ValueError):
    """A config that must not reach a launch. ``errors`` holds one message per problem."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid config:\n  - " + "\n  - ".join(errors))


@dataclass
class TrainSpec:
    global_batch_size: int = 32  # sequences per optimizer step, all ranks together
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    seq_len: int = 128  # tokens per instance (inputs are the first L-1, targets the last L-1)
    max_steps: int = 300
    # The lr warm-up: warmup_steps when given, else warmup_fraction x max_steps (rounded), so the
    # default scales with the run. validate() resolves it: a validated TrainSpec holds the count.
    warmup_steps: int | None = None
    warmup_fraction: float = 0.1
    alpha_f: float = 0.1  # cosine decays the lr to alpha_f x lr
    max_grad_norm: float = 1.0  # 0 disables clipping
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    eval_every: int = 50
    eval_instances: int = 256
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2


@dataclass
class DataSpec:
    name: str = "synthetic"
    # synthetic
    seed: int = 1234
    n_topics: int = 8
    concentration: float = 0.15
    doc_length: list[int] = field(default_factory=lambda: [16, 192])
    train_tokens: int = 4_000_000
    val_tokens: int = 131_072
    # memmap / text
    paths: list[str] = field(default_factory=list)
    val_paths: list[str] = field(default_factory=list)
    dtype: str = "uint16"
    val_fraction: float = 0.01  # text: share of documents held out for validation


@dataclass
class ClusterSpec:
    """Where a run executes: the local launcher or a SLURM profile (``configs/cluster/*.yaml``).

    The one schema of a cluster profile; :func:`cluster_errors` holds its checks. For SLURM,
    ``tasks_per_node`` is the number of ranks per node (one per GPU when there are GPUs).
    ``mem_gb`` None asks for the partition's default memory and 0 for all of each node's memory
    (``--mem=0``); ``partition``/``account``/``qos`` None mean "from $LOWCOMM_SLURM_PARTITION /
    _ACCOUNT / _QOS, else the cluster's default". ``signal`` (``USR2``; ``SIG`` prefix optional)
    is sent ``signal_delay_s`` seconds before a preemption or time-out kill. ``setup`` lines run
    in the batch script before ``srun``; ``additional_parameters`` are extra ``#SBATCH`` options.
    """

    name: str = "local"
    launcher: str = "local"  # local | slurm
    workers: int = 4  # local launcher: processes on this machine
    device: str = "auto"  # auto | cpu | cuda
    threads_per_worker: int = 0  # 0: cores / workers
    # SLURM (used when launcher == slurm)
    nodes: int = 1
    tasks_per_node: int = 1  # ranks per node: one per GPU
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: int | None = None  # None: the partition's default; 0: all of each node's memory (--mem=0)
    timeout_min: int = 60
    partition: str | None = None  # None: $LOWCOMM_SLURM_PARTITION, else the cluster's default
    account: str | None = None  # None: $LOWCOMM_SLURM_ACCOUNT
    qos: str | None = None  # None: $LOWCOMM_SLURM_QOS
    signal: str = "USR2"  # sent signal_delay_s before a preemption / time-limit kill
    signal_delay_s: int = 120
    max_requeues: int = 3  # time-outs requeued at most this often (preemptions always are)
    setup: list[str] = field(default_factory=list)  # shell lines before srun (module load ...)
    additional_parameters: dict[str, Any] = field(default_factory=dict)  # extra #SBATCH options

    @property
    def world_size(self) -> int:
        return self.workers if self.launcher == "local" else self.nodes * self.tasks_per_node

    @property
    def local_world_size(self) -> int:
        """Ranks per node: every local worker is on this machine; one task per GPU under SLURM."""
        return self.workers if self.launcher == "local" else self.tasks_per_node


@dataclass
class WandbSpec:
    mode: str = "offline"  # offline | online | disabled
    project: str = "lowcomm"
    entity: str | None = None


@dataclass
class RunConfig:
    model: ModelSpec
    optimizer: Any  # the strategy's Config dataclass
    optimizer_name: str
    compression: dict[str, Any]
    data: DataSpec
    train: TrainSpec
    cluster: ClusterSpec
    wandb: WandbSpec
    experiment: str
    run_root: str
    run_name: str
    seed: int
    raw: dict[str, Any]  # the resolved config as plain containers, written to config.yaml

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def run_dir(self) -> Path:
        return Path(self.run_root) / self.experiment / self.run_name

    @property
    def strategy_class(self):
        return STRATEGIES[self.optimizer_name]

    @property
    def label(self) -> str:
        """The config's ``label`` (a name for tables and plots), else the optimizer's name."""
        return self.raw.get("label") or self.optimizer_name


# Keys that do not change what is trained, so they do not change the run name.
_NOT_IN_RUN_NAME = ("run_root", "run_name", "wandb", "cluster", "experiment_name", "label")
_LOGISTICS = ("log_every", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_instances")


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


# The keys of a composed config: its sections (the config groups, plus train and wandb) and a
# few scalars. Anything else (a typo such as `+optimzer=demo`) is an error, never silently kept.
SECTIONS = ("model", "optimizer", "compression", "data", "train", "cluster", "wandb")
TOP_LEVEL_KEYS = (*SECTIONS, "experiment", "experiment_name", "run_root", "run_name", "label", "seed")


def closest(key: str, candidates: Sequence[str]) -> str | None:
    """The candidate ``key`` most likely stands for: a close spelling, else the one candidate
    that contains it (``topk`` for ``compression_topk``)."""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if close:
        return close[0]
    containing = [c for c in candidates if len(key) >= 3 and key in c]
    return containing[0] if len(containing) == 1 else None


def did_you_mean(key: str, candidates: Sequence[str]) -> str:
    """`` (did you mean X?)`` when a candidate is close to ``key``, else nothing."""
    match = closest(key, candidates)
    return f" (did you mean {match}?)" if match else ""


def unknown_key_message(full_key: str, allowed: Sequence[str], where: str, note: str = "") -> str:
    leaf = full_key.rsplit(".", 1)[-1]
    match = closest(leaf, allowed)
    hint = f"; did you mean {full_key[: -len(leaf)]}{match}?" if match else "."
    return f"{full_key} is not a key of {where}{hint}{note} Valid keys: {', '.join(allowed)}"


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


def validate(cfg: DictConfig | dict, *, check_data_files: bool = True) -> RunConfig:
    """Check a composed config completely; raise ConfigError with every problem found.

    ``check_data_files=False`` leaves out what needs the data files (they exist, their size
    and dtype agree): a dry run on a laptop plans a cluster run before its data is staged."""
    if isinstance(cfg, DictConfig):
        raw = OmegaConf.to_container(cfg, resolve=True)
    else:
        raw = dict(cfg)
    errors: list[str] = []
    for group in ("model", "optimizer", "compression", "data", "train", "cluster"):
        if not isinstance(raw.get(group), dict):
            errors.append(f"{group}: missing; the config must set the {group} group")
    if errors:
        raise ConfigError(errors)
    errors += unknown_keys(raw)

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
        if cluster.launcher == "slurm":
            slurm_errors = cluster_errors(cluster)
            errors += slurm_errors
            if not slurm_errors:
                cluster = _normalised(cluster)
    if wandb is not None:
        _one_of(wandb.mode, ("offline", "online", "disabled"), "wandb.mode", errors)
    if train is not None:
        _validate_train(train, model, cluster, errors)
    if optimizer is not None and cluster is not None and cluster.world_size >= 1:
        errors += STRATEGIES[opt_name].check_layout(optimizer, cluster.world_size, cluster.local_world_size)
    if data is not None and train is not None:
        _validate_data(data, model, train, errors, check_files=check_data_files)

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
        elif compression_name not in strategy.accepts_compression:
            errors.append(
                f"compression={compression_name} cannot be used with optimizer={opt_name}; "
                f"it accepts: {', '.join(strategy.accepts_compression)}"
            )
        else:
            try:  # a codec checks its own fields (bits, fraction, wire...) when built
                build_codec(raw["compression"])
            except (TypeError, ValueError) as exc:
                errors.append(f"compression: {exc}")
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
    if train.checkpoint_every < 0 or train.eval_every < 0:
        errors.append("train.checkpoint_every and train.eval_every must be >= 0 (0 disables)")
    if train.keep_checkpoints < 1:
        errors.append(f"train.keep_checkpoints must be >= 1, got {train.keep_checkpoints}")


def _validate_data(data: DataSpec, model: ModelSpec | None, train: TrainSpec, errors: list[str],
                   check_files: bool = True):
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
                errors.append(f"data.{key} is empty: give at least one file path or glob")
                continue
            if not check_files:
                continue
            try:
                for path in expand_paths(getattr(data, key), f"data.{key}"):
                    check_token_file(path, data.dtype, vocab_size=model.vocab_size if model else None,
                                     key=f"data.{key}")
            except DataError as exc:
                errors.append(str(exc))
        return
    if data.name == "text":
        if not data.paths:
            errors.append("data.paths is empty: give at least one file path or glob")
        elif check_files:
            try:
                expand_paths(data.paths, "data.paths")
            except DataError as exc:
                errors.append(str(exc))
        if not 0 < data.val_fraction < 1:
            errors.append(f"data.val_fraction must be in (0, 1), got {data.val_fraction}")


# ------------------------------------------------------------------------------------------------
# SLURM profiles: the checks of a cluster profile's SLURM fields

# submitit handles SIGTERM and SIGCONT itself (it ignores the TERM that precedes a preemption
# kill); KILL and STOP cannot be caught at all.
_UNUSABLE_SIGNALS = {"TERM", "CONT", "KILL", "STOP"}


def _int_error(key: str, value: Any, minimum: int) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return [f"cluster.{key} must be an integer >= {minimum}, got {value!r}"]
    return []


def cluster_errors(cluster: ClusterSpec) -> list[str]:
    """Every problem of a SLURM profile's fields, each naming its key."""
    errors: list[str] = []
    for key in ("nodes", "tasks_per_node", "cpus_per_task", "timeout_min"):
        errors += _int_error(key, getattr(cluster, key), minimum=1)
    for key in ("gpus_per_node", "signal_delay_s", "max_requeues"):
        errors += _int_error(key, getattr(cluster, key), minimum=0)
    if errors:
        return errors  # the checks below compare these numbers
    mem_gb = cluster.mem_gb
    if mem_gb is not None and (isinstance(mem_gb, bool) or not isinstance(mem_gb, int | float) or mem_gb < 0):
        errors.append(f"cluster.mem_gb must be a number >= 0 or null, got {mem_gb!r}")
    for key in ("partition", "account", "qos"):
        value = getattr(cluster, key)
        if value is not None and (not isinstance(value, str) or not value):
            errors.append(f"cluster.{key} must be a non-empty string or null, got {value!r}")
    if cluster.gpus_per_node and cluster.tasks_per_node != cluster.gpus_per_node:
        # every rank gets exactly one GPU (lowcomm.distenv.setup_distributed_from_slurm)
        errors.append(
            f"cluster.tasks_per_node ({cluster.tasks_per_node}) must equal cluster.gpus_per_node "
            f"({cluster.gpus_per_node}): lowcomm runs one rank per GPU"
        )
    if cluster.signal_delay_s >= cluster.timeout_min * 60:
        errors.append(
            f"cluster.signal_delay_s ({cluster.signal_delay_s}) must be shorter than the time limit "
            f"(cluster.timeout_min = {cluster.timeout_min} min)"
        )
    signal_name = cluster.signal.removeprefix("SIG") if isinstance(cluster.signal, str) else ""
    if not hasattr(signal, f"SIG{signal_name}") or signal_name in _UNUSABLE_SIGNALS:
        errors.append(f"cluster.signal must name a catchable signal such as USR2, got {cluster.signal!r}")
    setup = cluster.setup
    if not isinstance(setup, Sequence) or isinstance(setup, str) or not all(isinstance(x, str) for x in setup):
        errors.append(f"cluster.setup must be a list of shell lines, got {setup!r}")
    if not isinstance(cluster.additional_parameters, Mapping):
        errors.append(
            f"cluster.additional_parameters must map sbatch options to values, got {cluster.additional_parameters!r}"
        )
    elif "signal" in cluster.additional_parameters:
        errors.append("set cluster.signal and cluster.signal_delay_s, not additional_parameters.signal")
    return errors


def _normalised(cluster: ClusterSpec) -> ClusterSpec:
    """A checked profile in canonical form: signal without ``SIG``, plain containers."""
    return dataclasses.replace(
        cluster, signal=cluster.signal.removeprefix("SIG"), setup=tuple(cluster.setup),
        additional_parameters=dict(cluster.additional_parameters),
    )


def slurm_profile(cluster: ClusterSpec | Mapping[str, Any] | Any) -> ClusterSpec:
    """The checked SLURM profile (a :class:`ClusterSpec` with ``launcher="slurm"``) of a cluster
    section: a ClusterSpec, a mapping (dict, Hydra DictConfig) or an object with its attributes.
    Missing fields take their defaults; raises :class:`ConfigError` naming every bad key."""
    names = [f.name for f in dataclasses.fields(ClusterSpec)]
    if isinstance(cluster, DictConfig):
        cluster = OmegaConf.to_container(cluster, resolve=True)
    if isinstance(cluster, Mapping):
        unknown = sorted(set(cluster) - set(names))
        if unknown:
            raise ConfigError([f"cluster.{key} is not a cluster setting; allowed keys: {', '.join(names)}"
                               for key in unknown])
        values = dict(cluster)
    else:
        values = {name: getattr(cluster, name) for name in names if hasattr(cluster, name)}
    values["launcher"] = "slurm"
    spec = ClusterSpec(**values)
    errors = cluster_errors(spec)
    if errors:
        raise ConfigError(errors)
    return _normalised(spec)
