"""The schemas of a composed config: one dataclass per section, the :class:`RunConfig` that
:func:`lowcomm.config.validate` returns, the keys a config may hold, and :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lowcomm.config.naming import ADDED_LATER
from lowcomm.hardware import RANK_WRITE_MBPS
from lowcomm.models.olmo import ModelSpec
from lowcomm.strategies import STRATEGIES


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
    # The weights' (and so the gradients' and optimizer state's) dtype: fp32 | bf16.
    param_dtype: str = "fp32"
    # torch.compile the model (nn.Module.compile: in place, the checkpoint keys unchanged):
    # true | false | auto, the default: on a GPU only (OLMo-300M's AdamW-DDP at W=1 on an H200 ran
    # at 1.41x the eager tokens/s, and every method trained compiled as it trains eager there,
    # tests/test_cuda_kernels.py); on a 2-core CPU the tiny model's first step compiles for 23 s
    # and each later one saves 4 ms, so a laptop runs eager.
    compile: Any = "auto"
    eval_every: int = 50
    eval_instances: int = 256
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    # A rank's training loss above divergence_factor x ln(vocabulary size), the loss of a uniform
    # guess, or not finite, stops the run as diverged (null: only a non-finite loss does).
    divergence_factor: float | None = 2.0


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

    The one schema of a cluster profile; :func:`lowcomm.config.cluster.cluster_errors` holds its
    checks. For SLURM, ``tasks_per_node`` is the number of ranks per node (one per GPU when
    there are GPUs).
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
    collective_timeout_s: int = 900  # a collective's wait for its peers (every launcher)
    # MB/s one rank writes its checkpoint files at (all ranks at once): the dry run's checkpoint time
    rank_write_MBps: float = RANK_WRITE_MBPS
    # unequal workers: these ranks compute ``slowdown`` times slower than they would (on the CPU:
    # lowcomm.train.slowdown); none, every rank at its own speed
    slow_ranks: list[int] = field(default_factory=list)
    slowdown: float = 1.0
    # unequal links, on network-namespace nodes (benchmarks/netns.py shapes each node's veth with
    # tc): every node's link rate (e.g. "100M"; None: unshaped), and a rate of its own for the
    # nodes in slow_link_nodes (e.g. "10M")
    link_rate: str | None = None
    slow_link_nodes: list[int] = field(default_factory=list)
    slow_link_rate: str | None = None
    # workers that leave and rejoin (lowcomm.comm.ft): none, or torchft (each worker a replica
    # group; a lost one stops no other, and is relaunched up to max_rejoins times to heal from a
    # live peer); an exchange commits with min_replicas groups or more; a quorum waits
    # join_timeout_s for groups beyond them
    fault_tolerance: str = "none"
    ranks_per_group: int = 1  # the ranks in groups of this many (a node's; under SLURM tasks_per_node)
    min_replicas: int = 1
    join_timeout_s: float = 10.0
    max_rejoins: int = 3  # the local launcher's relaunches of lost groups (SLURM's: max_requeues per group)

    @property
    def world_size(self) -> int:
        return self.workers if self.launcher == "local" else self.nodes * self.tasks_per_node

    @property
    def local_world_size(self) -> int:
        """Ranks per node: every local worker is on this machine; one task per GPU under SLURM."""
        return self.workers if self.launcher == "local" else self.tasks_per_node

    @property
    def replica_groups(self) -> int:
        """Under ``fault_tolerance=torchft``: the ranks in groups of ``ranks_per_group`` (under
        SLURM a node each, each its own job)."""
        return self.world_size // self.ranks_per_group

    def describe_replica_groups(self) -> str:
        """Where the replica groups come from, in the config's words."""
        if self.launcher == "slurm":
            return f"cluster.nodes={self.nodes}, a group each"
        return f"cluster.workers={self.workers} in groups of {self.ranks_per_group}"


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


# The keys of a composed config: its sections (the config groups, plus train and wandb) and a
# few scalars. Anything else (a typo such as `+optimzer=demo`) is an error, never silently kept.
# What a run had before lowcomm set a collective timeout: torch's default for gloo groups.
TORCH_DEFAULT_TIMEOUT_S = 1800
# optimizer keys added after runs were saved, with what every run before them did; each is set in
# an older config.yaml of a strategy whose config has it (load_run_config)
OPTIMIZER_KEYS_ADDED = {"bucket_cap_mb": ADDED_LATER["optimizer"]["bucket_cap_mb"], "bucket_numel": None,
                        "cuda_graph": False}

SECTIONS = ("model", "optimizer", "compression", "data", "train", "cluster", "wandb")
TOP_LEVEL_KEYS = (*SECTIONS, "experiment", "experiment_name", "run_root", "run_name", "label", "seed")


def load_run_config(path: str | Path) -> DictConfig:
    """A run directory's ``config.yaml``, upgraded to the current keys where an earlier lowcomm
    wrote it: a key added since is set to what such a run did, a renamed value gets its new name,
    so reports read old runs and an old run resumes as it trained. (Only saved run configs go
    through this; a config composed now always has every key.)

    - ``optimizer.exchange`` (DiLoCo, MuLoCo, Streaming DiLoCo; added with the quantized
      all-reduce): ``all_gather``, the only exchange before it.
    - SparseLoCo's ``wire: paper`` is now ``reference``; its ``binning: reference`` was the only
      quantizer kept and the key is gone (``symmetric`` has no equivalent now and is reported).
    - ``cluster.collective_timeout_s``: 1800, torch's default process-group timeout on gloo, which
      every group of such a run had (lowcomm set none).
    - ``optimizer.bucket_cap_mb`` (every DDP method: AdamW-DDP, Muon-DDP, PowerSGD): 25, the DDP
      bucket size lowcomm passed before it was a setting.
    - DeMo's, FlexDeMo's and DisTrO's ``optimizer.bucket_numel`` (null, the size before it was a
      setting) and ``optimizer.cuda_graph`` (false).
    """
    cfg = OmegaConf.load(path)
    cluster = cfg.get("cluster")
    if isinstance(cluster, DictConfig) and "collective_timeout_s" not in cluster:
        cluster["collective_timeout_s"] = TORCH_DEFAULT_TIMEOUT_S
    optimizer = cfg.get("optimizer")
    if optimizer is None:
        return cfg
    name = optimizer.get("name")
    if name in ("diloco", "muloco", "streaming_diloco") and "exchange" not in optimizer:
        optimizer["exchange"] = "all_gather"
    strategy = STRATEGIES.get(name)
    if strategy is not None:
        fields = {field.name for field in dataclasses.fields(strategy.Config)}
        for key, value in OPTIMIZER_KEYS_ADDED.items():
            if key in fields and key not in optimizer:
                optimizer[key] = value
    if name == "sparseloco":
        if optimizer.get("wire") == "paper":
            optimizer["wire"] = "reference"
        if optimizer.get("binning") == "reference":
            del optimizer["binning"]
    return cfg
