"""The strategy seam: how a named optimizer config becomes (wrapped model, optimizer), and
everything else the harness needs to know about a method, declared in one place.

A method is four files: its algorithm (``optim/<name>.py``: the optimizer and its ``Args``
dataclass with the argument rules), its strategy (``strategies/<name>.py``: one class
registered under the config's ``name``, whose ``Config`` inherits the algorithm's ``Args`` and
is handed whole to it), its config (``configs/optimizer/<name>.yaml``: the only place its
defaults live) and its tests. Modules of this package are found and imported by
``lowcomm.strategies`` itself: there is no list to edit. The tables, the figure palette, the
comm table, the quickstart, the laptop Table 1 and the contract tests (resume, bytes, defaults)
read the registry; the training loop only ever calls the methods below and never branches on a
name.

What a strategy declares, besides ``name`` and ``Config``:
- ``display``: its name in tables and figures, its marker and its colour;
- ``quickstart`` / ``table1_tiny``: its runs in ``make quickstart`` and the laptop Table 1
  (sweep files name them with ``methods:``);
- ``comm_table``: its rows in ``lowcomm-comm-table``;
- ``mid_period``: overrides under which a 6-step run's step-3 checkpoint falls between two
  synchronisations (the resume contract tests it there);
- ``cycle``: overrides and a step count that cover its whole synchronisation cycle (the byte
  contract compares the meter with the comm table over it);
- ``accepts_codec``: which codecs of the ``compression`` group it can send with, by the codec's
  properties.

Contract with the loop:
- ``build(model)`` returns the module to run forward/backward on and the optimizer whose
  ``step()`` does all communication (directly or through DDP comm hooks) via ``self.comm``;
- ``no_sync(model)`` wraps every micro-batch but the last of a step (gradient accumulation);
- the LR schedule multiplies each param group's ``initial_lr``; an optimizer that wraps
  another (DiLoCo) exposes in ``param_groups`` the groups the schedule should drive;
- ``replicated_optimizer_state``: True when every rank holds the same optimizer state, so
  checkpoints keep one copy; False means one file per rank, except the ``replicated_state_keys``
  of the optimizer's state dict (the same on every rank: DiLoCo's global parameters and outer
  momentum), which rank 0 writes once;
- ``checkpoint_bytes(model, local_world_size)``: (replicated, per-rank) bytes of a checkpoint,
  from shapes (the dry run checks them against the preemption lead time); ``outer_boundary`` /
  ``boundary_saved_bytes``: where a checkpoint leaves the workers' own parameters out (the
  DiLoCo family's outer boundaries) and how much that saves;
- ``extra_state()`` / ``load_extra_state()``: anything else to resume exactly (comm-hook state);
- ``model_state_dict`` / ``clip_grad_norm``: overridden by strategies that shard the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.comm.meter import TRAFFIC, WireBytes
from lowcomm.compress import Codec
from lowcomm.optim.args import Args, as_config_errors
from lowcomm.optim.diloco import DiLoCo, reduces_quantized, sync_traffic
from lowcomm.optim.grouping import adamw

STRATEGIES: dict[str, type[Strategy]] = {}
# The sweeps whose runs each strategy declares (a sweep file says ``methods: <one of these>``).
METHOD_SWEEPS = ("quickstart", "table1_tiny")


def register(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy under its ``name`` (a class decorator), checking its declarations."""
    if cls.name in STRATEGIES:
        raise ValueError(f"strategy {cls.name!r} registered twice")
    if cls.Config.config_name != cls.name:
        raise TypeError(f"{cls.__name__}.Config.config_name is {cls.Config.config_name!r}; it must be the "
                        f"strategy's name {cls.name!r} (configs/optimizer/{cls.name}.yaml holds its defaults)")
    if not cls.quickstart:
        raise TypeError(f"{cls.__name__} declares no quickstart run: every method is in make quickstart")
    for other in STRATEGIES.values():
        if other.display.marker == cls.display.marker:
            raise TypeError(f"{cls.__name__}.display: marker {cls.display.marker!r} is {other.name}'s; every method "
                            f"has its own (taken: {', '.join(repr(s.display.marker) for s in STRATEGIES.values())})")
        if _colour_key(other.display.color) == _colour_key(cls.display.color):
            raise TypeError(f"{cls.__name__}.display: colour {cls.display.color!r} is {other.name}'s (drawn as its "
                            f"{other.display.color!r}); every method has its own (taken: "
                            f"{', '.join(repr(s.display.color) for s in STRATEGIES.values())})")
    STRATEGIES[cls.name] = cls
    return cls


def _colour_key(color: str) -> str:
    """A colour as matplotlib draws it, for telling two apart without importing matplotlib here:
    ``"C<n>"`` is the n-th colour of the default cycle of ten, so ``C10`` is ``C0``; names are
    case-insensitive."""
    color = color.strip().lower()
    if color[:1] == "c" and color[1:].isdigit():
        return f"c{int(color[1:]) % 10}"
    return color


@dataclass(frozen=True)
class Display:
    """How tables and figures show a method: its name (the papers'), marker and colour (fixed,
    so that a method has the same colour in every figure)."""

    name: str
    marker: str
    color: str


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its label in tables and figures and its overrides beyond
    ``optimizer=<name>``."""

    label: str
    overrides: tuple[str, ...] = ()

    def __init__(self, label: str, *overrides: str):
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "overrides", overrides)


@dataclass(frozen=True)
class Row:
    """One row of the comm table: its label, its overrides beyond ``optimizer=<name>``, and
    whether it counts the bytes before the method's compression starts (``warmup``)."""

    label: str
    overrides: tuple[str, ...] = ()
    warmup: bool = False

    def __init__(self, label: str, *overrides: str, warmup: bool = False):
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "overrides", overrides)
        object.__setattr__(self, "warmup", warmup)


@dataclass(frozen=True)
class Cycle:
    """``steps`` steps under ``overrides`` cover a method's whole synchronisation cycle."""

    steps: int = 1
    overrides: tuple[str, ...] = ()

    def __init__(self, steps: int = 1, *overrides: str):
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "overrides", overrides)


@dataclass(kw_only=True)
class StrategyConfig(Args):
    """The fields every optimizer config has; a strategy's ``Config`` inherits this and its
    algorithm's ``Args``, and its yaml sets every field.

    ``lr``: the scheduled learning rate (the inner one, for a method with an outer loop).
    ``clip_global_norm``: whether the loop clips the gradient's global norm to
    ``train.max_grad_norm`` before the step. A per-strategy choice because not every method
    clips that way: DES-LOC's equations clip per coordinate instead (its default is false).
    ``decay_embeddings``: whether weight decay reaches the embedding (tied: also the output
    head). OLMo's default, which the DeMo paper follows, excludes it: false for every optimizer.
    """

    lr: float
    clip_global_norm: bool
    decay_embeddings: bool

    def errors(self) -> list[str]:
        errors = super().errors()
        if not self.lr > 0:
            errors.append(f"lr must be > 0, got {self.lr}")
        return errors

    def validate(self) -> list[str]:
        """The config's errors, each naming its ``optimizer.`` key (once)."""
        return list(dict.fromkeys(as_config_errors(self.errors())))


def parameter_bytes(model: torch.nn.Module, *, trainable: bool = True, names: set[str] | None = None) -> float:
    """Bytes of the model's (trainable, or all) parameters, optionally only those in ``names``."""
    return float(sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if (p.requires_grad or not trainable) and (names is None or name in names)
    ))


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class Strategy:
    name: ClassVar[str]
    Config: ClassVar[type[StrategyConfig]]
    display: ClassVar[Display]
    quickstart: ClassVar[tuple[Point, ...]] = ()
    table1_tiny: ClassVar[tuple[Point, ...]] = ()
    comm_table: ClassVar[tuple[Row, ...]] = ()
    mid_period: ClassVar[tuple[str, ...]] = ()
    cycle: ClassVar[Cycle] = Cycle()
    replicated_optimizer_state: ClassVar[bool] = True
    replicated_state_keys: ClassVar[tuple[str, ...]] = ()
    # Why the method does not run as replica groups that leave and rejoin
    # (cluster.fault_tolerance=torchft, lowcomm.comm.ft); None where it does. docs/faults.md
    # lists every method's.
    replica_groups_refusal: ClassVar[str | None] = "its exchange is not offered between replica groups"
    # True where its exchange between replica groups is an all-gather, built for groups of one rank
    replica_groups_of_one_rank: ClassVar[bool] = False
    # True where its workers are learners around a synchronizer process, joined by no collective
    # (lowcomm.strategies.learners)
    learners: ClassVar[bool] = False

    def __init__(self, cfg: StrategyConfig, compression: dict[str, Any], comm: Communicator):
        self.cfg = cfg
        self.compression = compression
        self.comm = comm

    @classmethod
    def accepts_codec(cls, codec: type[Codec]) -> bool:  # noqa: ARG003
        """Can this strategy send through ``codec`` (a class of the ``compression`` group)?
        By default no: the strategy sends what it sends (``compression=none``)."""
        return False

    @classmethod
    def check_compression(cls, cfg: StrategyConfig, compression: dict[str, Any]) -> list[str]:  # noqa: ARG003
        """Errors in how this optimizer's fields combine with the compression config."""
        return []

    @classmethod
    def replica_groups_overrides(cls) -> tuple[str, ...]:
        """Overrides under which this method's default config runs as replica groups (the
        exchange between groups is dense: ``compression=none``, and no error feedback, which
        accumulates what a codec drops)."""
        fields = cls.Config.__dataclass_fields__
        return ("compression=none", *(("optimizer.error_feedback=null",) if "error_feedback" in fields else ()))

    @classmethod
    def check_replica_groups(cls, cfg: StrategyConfig, compression: dict[str, Any]) -> list[str]:  # noqa: ARG003
        """Under ``cluster.fault_tolerance=torchft``: why this configuration cannot run as replica
        groups that leave and rejoin (checked before anything starts), or nothing."""
        if cls.replica_groups_refusal is None:
            return []
        return [f"optimizer={cls.name} cannot run under cluster.fault_tolerance=torchft: {cls.replica_groups_refusal}"]

    @classmethod
    def check_layout(cls, cfg: StrategyConfig, world_size: int, local_world_size: int) -> list[str]:  # noqa: ARG003
        """Errors in how this optimizer's fields fit the ranks it will run on (``world_size`` in
        all, ``local_world_size`` per node): checked before any process starts, so that nothing
        a worker would refuse at construction reaches a launch."""
        return []

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def no_sync(self, model: torch.nn.Module):  # noqa: ARG002 - the DDP strategies use it
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The bare model inside whatever ``build`` wrapped it in."""
        return getattr(model, "module", model)

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded model state (what a checkpoint's ``model.pt`` holds)."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)

    @property
    def clips_global_norm(self) -> bool:
        """Does the loop clip this strategy's gradient norm (``optimizer.clip_global_norm``)?"""
        return self.cfg.clip_global_norm

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the gradients the optimizer will see (averaged under DDP, local otherwise)."""
        return float(torch.nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm))

    def extra_state(self) -> dict[str, Any]:
        return {}

    def finish(self, optimizer: torch.optim.Optimizer) -> None:
        """The loop has ended (finished, stopped or diverged): anything the method still owes
        or is owed (a learner leaves its synchronizer). Nothing by default."""

    @classmethod
    def layout(cls, cfg: StrategyConfig, local_world_size: int) -> dict[str, Any]:  # noqa: ARG003
        """How this method's per-rank state is laid out over the ranks, beyond their number, as
        the config keys that set it (``{"optimizer.shard_group_size": 8}``: FlexDeMo's momentum
        is of each rank's shard): recorded in every checkpoint, and a resume whose layout differs
        is refused before anything starts. Empty: rank r's state is rank r's, whatever the node
        it is on."""
        return {}

    @classmethod
    def elastic_rule(cls, written_by: int) -> str:
        """What a resume from a checkpoint of ``written_by`` ranks does on another
        world size W (the run prints it first and records it in ``metrics.jsonl``):
        state every rank holds alike is loaded as it is; rank r takes rank (r mod written_by)'s
        own files. Growing by a whole factor, every old worker's state is then held by the same
        number of ranks, so a mean over workers (an outer average, the momenta DeMo sends) is
        what it was; shrinking, the own state of ranks W ... written_by - 1 is dropped."""
        shared = ["the model", *cls.replicated_state_keys]
        own = "RNG, byte meter and method state"
        if cls.replicated_optimizer_state:
            shared.append("the optimizer state")
        else:
            own = "optimizer state, " + own
        return (f"{', '.join(shared)} as written (held alike by every rank); rank r takes rank (r mod {written_by})'s "
                f"own {own}")

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """(replicated, per-rank) bytes of the optimizer's checkpointed state, from shapes
        (``model`` may be on the meta device). Default: AdamW's two moments, the same on every
        rank."""
        return 2 * parameter_bytes(model), 0.0

    def checkpoint_bytes(self, model: torch.nn.Module, local_world_size: int, *, at_boundary: bool = False,
                         ) -> tuple[float, float]:
        """(written once, written by every rank) bytes of one checkpoint: the model and the
        optimizer state that every rank holds alike, and each rank's own state; ``at_boundary``:
        of a checkpoint written at an outer boundary (:meth:`outer_boundary`), which leaves out
        :meth:`boundary_saved_bytes` per rank. Tensor data only: the files' framing adds a few
        hundred bytes per tensor."""
        replicated, per_rank = self.optimizer_state_bytes(model, local_world_size)
        if at_boundary:
            per_rank -= self.boundary_saved_bytes(model)
        return parameter_bytes(model, trainable=False) + replicated, per_rank

    def outer_boundary(self, step: int) -> bool:  # noqa: ARG002
        """Is the end of step ``step`` an outer boundary, where every worker's parameters are a
        copy it holds anyway (its global or outer parameters), so that a checkpoint written
        there leaves them out? False for methods without one."""
        return False

    def heal_sends_model(self, step: int) -> bool:
        """Does a heal (a replica group taking a live peer's state at the end of step ``step``:
        :mod:`lowcomm.train.replicas`) send the model's parameters beside the optimizer's state?
        Not at an outer boundary, where the optimizer restores them from its own copy; a method
        whose optimizer state holds the worker's parameters says no everywhere."""
        return not self.outer_boundary(step)

    # Keys of the optimizer's state dict a heal does not send (the healed worker keeps its own,
    # then after_heal decides): SparseLoCo's error feedback, the peer's residual to send
    heal_leaves_out: ClassVar[tuple[str, ...]] = ()

    def after_heal(self, optimizer: torch.optim.Optimizer) -> None:
        """After a heal has loaded a live peer's optimizer state: what of this worker's own it
        does not keep (nothing by default; SparseLoCo empties its error feedback)."""

    def boundary_saved_bytes(self, model: torch.nn.Module) -> float:  # noqa: ARG002
        """Per-rank bytes a checkpoint at an outer boundary leaves out (:meth:`outer_boundary`)."""
        return 0.0

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        """Payload bytes per step and worker (amortised over sync periods), from shapes alone
        (``model`` may be on the meta device). Used by ``lowcomm-comm-table``."""
        raise NotImplementedError(f"strategy {self.name!r} has no analytic byte count")

    def warmup_payload_bytes(self, model: torch.nn.Module) -> float:
        """Payload bytes per step before the strategy's compression starts (PowerSGD's warm-up);
        the same as :meth:`analytic_payload_bytes` for strategies without a warm-up."""
        return self.analytic_payload_bytes(model)

    def wire_collective(self) -> str:
        """The collective that carries the payload (it sets tx/rx per worker for a given W in
        :meth:`analytic_traffic`'s default)."""
        return "all_reduce"

    def analytic_traffic(self, model: torch.nn.Module, world_size: int, *, warmup: bool = False,
                         ) -> WireBytes:
        """Payload, tx and rx bytes per worker and step at world size W, averaged over workers,
        from shapes alone (``warmup``: before the compression starts). Default: the payload of
        :meth:`analytic_payload_bytes` through the ring formula of :meth:`wire_collective`; a
        strategy whose payload depends on W (the quantized all-reduce's per-chunk side data)
        overrides it."""
        payload = self.warmup_payload_bytes(model) if warmup else self.analytic_payload_bytes(model)
        # the formulas work on integers; scale up and down to keep amortised fractions exact enough
        tx, rx = TRAFFIC[self.wire_collective()](int(round(payload * 1000)), world_size)[:2]
        return WireBytes(payload, tx / 1000, rx / 1000)

    @classmethod
    def comm_overlap(cls, cfg: StrategyConfig, parameters: int,  # noqa: ARG003
                     compression: dict[str, Any] | None = None) -> float:  # noqa: ARG003
        """The share of a step's compute that this strategy's traffic can run behind, for a model
        of ``parameters`` parameters sending through ``compression`` (the run's compression
        group; None: none), in the wall-clock model (:mod:`lowcomm.report.wallclock`).
        0: every step waits for its bytes (DeMo's all-gathers follow the backward pass; DiLoCo's
        outer step waits for its sync)."""
        return 0.0

    @classmethod
    def waits_for_slowest(cls, cfg: StrategyConfig) -> bool:  # noqa: ARG003
        """Does a worker wait for the slowest worker (at every step, or at its exchanges for the
        steps of lateness gathered since), so that a slow worker sets everyone's pace in the
        wall-clock model? True for every collective; a learner on its own clock says no."""
        return True

    @classmethod
    def report_lag(cls, cfg: StrategyConfig) -> int:  # noqa: ARG003
        """How many step boundaries the loop may wait before it reads a boundary's agreement
        (stop, divergence, logged losses: :mod:`lowcomm.train.boundary`): the steps this
        strategy's exchange stays in flight after it starts. On a link shared with the
        exchange, the agreement queues behind its bytes; read at once, it would make the step
        wait for what the strategy hides. 0: the exchange is waited for in the step that
        starts it, and the agreement is read at once."""
        return 0

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"strategy {self.name!r} got extra state it does not know: {sorted(state)}")


class OuterLoopStrategy(Strategy):
    """The DiLoCo family (DiLoCo, MuLoCo, SparseLoCo): no DDP wrapper, so the backward pass
    sends nothing; workers train alone with an inner optimizer (AdamW here; override
    :meth:`make_inner_optimizer`) and meet at the outer step, sending their pseudo-gradient
    through :meth:`codec` (None: a dense all-reduce).

    As with DDP (``init_sync=False``), every rank builds the model from the same seed or loads
    the same checkpoint, so the workers start from identical parameters without a broadcast.
    """

    replicated_optimizer_state = False  # inner states and error-feedback accumulators are per worker
    # identical on every worker after each synchronisation: written once, not W times
    replicated_state_keys = ("global_params", "outer_momentum")

    def codec(self) -> Codec | None:
        raise NotImplementedError

    def make_inner_optimizer(
        self, model: torch.nn.Module, params: list[torch.nn.Parameter]
    ) -> torch.optim.Optimizer:
        """The inner optimizer over ``params`` (the trainable parameters of ``model``)."""
        return adamw(model, self.cfg, params)

    def inner_state_bytes(self, model: torch.nn.Module) -> float:
        """The inner optimizer's state: AdamW's two moments."""
        return 2 * parameter_bytes(model)

    def exchange(self) -> str:
        """How a compressed pseudo-gradient travels (``optimizer.exchange``, see
        :class:`lowcomm.optim.DiLoCo`)."""
        return self.cfg.exchange

    def wire_collective(self) -> str:
        codec = self.codec()
        if codec is None:
            return "all_reduce"
        return "all_reduce_quantized" if reduces_quantized(self.exchange(), codec) else "all_gather"

    def analytic_traffic(self, model: torch.nn.Module, world_size: int, *, warmup: bool = False,  # noqa: ARG002
                         ) -> WireBytes:
        """One synchronisation's traffic at W (:func:`lowcomm.optim.diloco.sync_traffic`: dense
        all-reduce, quantized all-reduce or all-gather), amortised over H steps."""
        params = trainable_parameters(model)
        per_sync = sync_traffic([p.shape for p in params], self.codec(), self.exchange(), world_size, params[0].dtype)
        return WireBytes(*(value / self.cfg.sync_every for value in per_sync))

    def outer_boundary(self, step: int) -> bool:
        """Every ``sync_every`` steps the workers restart from their global (outer) parameters."""
        return step % self.cfg.sync_every == 0

    def boundary_saved_bytes(self, model: torch.nn.Module) -> float:
        """The worker's own parameters (its global copy there)."""
        return parameter_bytes(model)

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """Replicated: the global parameters and the outer momentum. Per rank: the worker's own
        parameters (between two outer boundaries), the inner optimizer's state and the
        error-feedback accumulator."""
        params = parameter_bytes(model)
        replicated = params * (2 if self.cfg.outer_momentum > 0 else 1)
        per_rank = (params + self.inner_state_bytes(model)
                    + (params if self.cfg.error_feedback is not None else 0.0))
        return replicated, per_rank

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        """Per worker and step, amortised over the H steps between synchronisations."""
        params = trainable_parameters(model)
        return DiLoCo.amortized_payload_bytes([p.shape for p in params], self.cfg.sync_every, self.codec(),
                                              params[0].dtype)
