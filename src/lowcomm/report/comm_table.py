"""The comm table: payload MB/step of any optimizer config on the paper's models,
computed from parameter shapes on the meta device (nothing is allocated or trained), with
tx/rx per worker for a given world size, the paper's Tx MB/step beside DeMo's and AdamW's, and
the crossover: the smallest world size at which a row's tx per worker exceeds AdamW-DDP's.

Payload is what one worker contributes (the paper's convention; independent of W except for
the quantized all-reduce, whose W chunks per tensor each carry their own side data); tx is what
it actually sends under the algorithm that runs. An all-reduce sends 2(W-1)/W x payload
(bounded by 2x), the quantized all-reduce about the same (an all-to-all, then an all-gather of
the reduced chunks), an all-gather (W-1) x payload (growing with W): so a compressed optimizer
that all-gathers (DeMo, SparseLoCo, top-k DiLoCo, FlexDeMo across nodes) pays more than
AdamW-DDP once W > 2 x AdamW's payload / its own, however small its payload looks.

The command is ``lowcomm-comm-table`` (:mod:`lowcomm.cli.comm_table`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.meter import ring_inter_node_share
from lowcomm.config import repo_root, validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.hardware import PAPER_GPUS_PER_NODE
from lowcomm.models import ModelSpec, build_model
from lowcomm.strategies import STRATEGIES

MODELS = ("olmo_300m", "olmo_1b")
PAPER_MODEL = {"olmo_300m": "300M", "olmo_1b": "1B"}

# Every peer's rows, as each strategy declares them (``comm_table``): (label, overrides, warm-up
# phase: the bytes before a strategy's compression starts). DeMo's and AdamW-DDP's rows are the
# paper's Table 1 (:func:`paper_rows`).
PEER_ROWS: list[tuple[str, list[str], bool]] = [
    (row.label, [f"optimizer={name}", *row.overrides], row.warmup)
    for name, strategy in STRATEGIES.items() for row in strategy.comm_table
]
GPUS_PER_NODE = PAPER_GPUS_PER_NODE
BASELINE_LABEL = "AdamW-DDP"  # the row every crossover is against (bf16 gradients, the paper's)
MAX_CROSSOVER_WORLD = 1 << 20  # beyond this a crossover is reported as none


@dataclass
class Row:
    model: str
    label: str
    payload_mb: float
    tx_mb: float
    rx_mb: float
    paper_text: str | None = None  # the paper's number as printed (it truncates)
    # smallest W at which this row's tx per worker exceeds AdamW-DDP's; None: not up to 2^20
    # (both all-reduce: the ratio does not depend on W); 0: not computed (the baseline itself)
    crossover_w: int | None = 0
    # tx per worker on the link between nodes: a world ring's nodes / W share of tx, or a
    # strategy's own inter-node scope; None on a per-link row
    inter_tx_mb: float | None = None

    @property
    def paper_mb(self) -> float | None:
        return None if self.paper_text is None else float(self.paper_text)

    @property
    def diff_percent(self) -> float | None:
        return None if self.paper_mb is None else 100 * (self.payload_mb - self.paper_mb) / self.paper_mb

    @property
    def matches_truncated(self) -> bool | None:
        """Does our value, truncated to the paper's printed decimals, equal the paper's?"""
        if self.paper_text is None:
            return None
        decimals = len(self.paper_text.partition(".")[2])
        return math.floor(self.payload_mb * 10**decimals) == round(self.paper_mb * 10**decimals)


def paper_rows(model: str) -> list[tuple[str, list[str], str]]:
    """(label, overrides, paper MB) for the DeMo and AdamW-DDP rows of the paper's table."""
    rows = []
    with (repo_root() / "results" / "paper" / "table1.csv").open() as handle:
        for record in csv.DictReader(handle):
            if record["model"] != PAPER_MODEL[model]:
                continue
            mb = record["tx_MB_per_step"]
            if record["optimizer"].lower().startswith("demo"):
                chunk, topk = int(record["chunk"]), int(record["topk"])
                rows.append((f"DeMo s={chunk} k={topk}", ["optimizer=demo", f"optimizer.compression_chunk={chunk}",
                                                        f"optimizer.compression_topk={topk}"], mb))
            else:
                rows.append((BASELINE_LABEL, ["optimizer=adamw_ddp"], mb))
                rows.append(("AdamW-DDP, fp32 gradients", ["optimizer=adamw_ddp", "optimizer.wire_dtype=float32"], mb))
    return rows


def _compose_groups(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose(overrides), resolve=True)


class Traffic(NamedTuple):
    """Bytes per worker and step at a world size: payload, tx, rx, the same per link for a
    strategy laid out by node (``scopes``), and the part of tx that crosses between nodes."""

    payload: float
    tx: float
    rx: float
    scopes: dict[str, tuple[float, float, float]]
    inter_tx: float


def traffic_function(
    model_name: str, overrides: list[str], meta_model=None, gpus_per_node: int = GPUS_PER_NODE,
    warmup: bool = False, backend: str = "nccl",
) -> Callable[[int], Traffic]:
    """W -> (payload, tx, rx, per-link) bytes per worker and step for one optimizer config
    (``warmup``: before its compression starts) on ``backend``'s collectives (NCCL, a cluster's;
    gloo's reduce-scatter is an all-reduce); the config is composed and validated once."""
    return config_traffic_function(_compose_groups([f"model={model_name}", *overrides]), meta_model,
                                   gpus_per_node, warmup, backend)


def config_traffic_function(
    raw: dict, meta_model=None, gpus_per_node: int = GPUS_PER_NODE, warmup: bool = False, backend: str = "nccl",
) -> Callable[[int], Traffic]:
    """:func:`traffic_function` of a composed config (a run directory's ``config.yaml``)."""
    strategy_cls, optimizer_cfg = validate_optimizer(raw)
    strategy = strategy_cls(optimizer_cfg, raw["compression"], Communicator())
    model = meta_model if meta_model is not None else build_model(ModelSpec(**raw["model"]), "meta")
    if hasattr(strategy, "analytic_scope_bytes"):
        def scoped(world_size: int) -> Traffic:
            scopes = strategy.analytic_scope_bytes(model, world_size, gpus_per_node, backend=backend)
            payload, tx, rx = (sum(values[i] for values in scopes.values()) for i in range(3))
            return Traffic(payload, tx, rx, scopes, scopes["inter"][1] if "inter" in scopes else 0.0)

        scoped.world_step = gpus_per_node  # its layout needs whole nodes
        return scoped
    def flat(world_size: int) -> Traffic:
        wire = strategy.analytic_traffic(model, world_size, warmup=warmup)
        return Traffic(wire.payload, wire.tx, wire.rx, {}, wire.inter_node_tx(world_size, gpus_per_node))

    flat.world_step = 1
    return flat


def measure(
    model_name: str, overrides: list[str], world_size: int, meta_model=None, gpus_per_node: int = GPUS_PER_NODE,
    warmup: bool = False, backend: str = "nccl",
) -> Traffic:
    """(payload, tx, rx) bytes per worker and step for one optimizer config (``warmup``: before
    its compression starts), and the same per link (scope) for strategies that report them."""
    return traffic_function(model_name, overrides, meta_model, gpus_per_node, warmup, backend)(world_size)


def crossover_world_size(
    traffic: Callable[[int], Traffic], baseline: Callable[[int], Traffic], limit: int = MAX_CROSSOVER_WORLD
) -> int | None:
    """The smallest world size at which ``traffic``'s tx per worker exceeds ``baseline``'s, or
    None if it does not up to ``limit``. World sizes are multiples of the row's node size (a
    strategy laid out by node) and at least 2. The difference changes sign at most once: an
    all-gather's tx grows as (W-1) p, an all-reduce's as 2(W-1)/W P, so bisection finds it."""
    step = getattr(traffic, "world_step", 1)
    candidates = max(2, step) // step, limit // step  # W = k x step for k in [lo, hi]

    def exceeds(k: int) -> bool:
        return traffic(k * step)[1] > baseline(k * step)[1]

    low, high = candidates
    if exceeds(low):
        return low * step
    if not exceeds(high):
        return None
    while high - low > 1:  # invariant: not exceeds(low), exceeds(high)
        middle = (low + high) // 2
        if exceeds(middle):
            high = middle
        else:
            low = middle
    return high * step


def build_table(
    models: list[str], world_size: int, rows: list[tuple[str, list[str], bool]] | None,
    gpus_per_node: int = GPUS_PER_NODE,
) -> list[Row]:
    """``rows``: (label, overrides, warm-up phase) per optimizer config; None: the paper's rows
    and every peer. Every row but the baseline gets its crossover with AdamW-DDP's default."""
    table = []
    for model_name in models:
        raw = _compose_groups([f"model={model_name}"])
        meta_model = build_model(ModelSpec(**raw["model"]), "meta")
        baseline = traffic_function(model_name, ["optimizer=adamw_ddp"], meta_model, gpus_per_node)
        custom = rows is not None
        specs = [(label, ov, None, warmup) for label, ov, warmup in rows] if custom else (
            [(label, ov, mb, False) for label, ov, mb in paper_rows(model_name)]
            + [(label, ov, None, warmup) for label, ov, warmup in PEER_ROWS])
        for label, overrides, paper_mb, warmup in specs:
            traffic = traffic_function(model_name, overrides, meta_model, gpus_per_node, warmup=warmup)
            payload, tx, rx, scopes, inter_tx = traffic(world_size)
            crossover = 0 if label == BASELINE_LABEL and not custom else crossover_world_size(traffic, baseline)
            table.append(Row(model_name, label, payload / 1e6, tx / 1e6, rx / 1e6, paper_mb, crossover,
                             inter_tx / 1e6))
            for scope, (scope_payload, scope_tx, scope_rx) in scopes.items():
                # the inter-node link against the share of AdamW-DDP's world ring that crosses nodes
                scope_crossover = crossover_world_size(
                    _link(traffic, scope), _inter_node_part(baseline, gpus_per_node)) if scope == "inter" else 0
                table.append(Row(model_name, f"{label}: {scope}", scope_payload / 1e6, scope_tx / 1e6,
                                 scope_rx / 1e6, crossover_w=scope_crossover))
    return table


def _link(traffic: Callable[[int], Traffic], scope: str) -> Callable[[int], Traffic]:
    """One link's bytes of a strategy that reports them per link, as a Traffic function."""
    def link(world_size: int) -> Traffic:
        payload, tx, rx = traffic(world_size).scopes[scope]
        return Traffic(payload, tx, rx, {}, 0.0)

    link.world_step = getattr(traffic, "world_step", 1)
    return link


def _inter_node_part(traffic: Callable[[int], Traffic], gpus_per_node: int) -> Callable[[int], Traffic]:
    """A world collective's bytes that cross between nodes, per worker on average: its ring
    leaves each node once, so nodes / W of its hops are inter-node."""
    def inter(world_size: int) -> Traffic:
        payload, tx, rx, _, _ = traffic(world_size)
        share = ring_inter_node_share(world_size, gpus_per_node)
        return Traffic(payload, tx * share, rx * share, {}, tx * share)

    return inter


def _inter_text(row: Row) -> str:
    return "" if row.inter_tx_mb is None else f"{row.inter_tx_mb:.3f}"


def crossover_text(row: Row) -> str:
    if row.crossover_w == 0:
        return ""
    return "none" if row.crossover_w is None else str(row.crossover_w)


def format_table(table: list[Row], world_size: int) -> str:
    header = (f"{'model':<10} {'optimizer':<34} {'payload MB/step':>15} {f'tx MB (W={world_size})':>14} "
              f"{f'rx MB (W={world_size})':>14} {'inter-node tx':>13} {'crossover W':>11} {'paper MB':>9} {'diff':>8}  truncated")
    lines = [header, "-" * len(header)]
    for row in table:
        paper = f"{row.paper_text:>9}" if row.paper_text is not None else f"{'':>9}"
        diff = f"{row.diff_percent:+7.2f}%" if row.diff_percent is not None else f"{'':>8}"
        match = {True: "  = paper", False: "  differs", None: ""}[row.matches_truncated]
        lines.append(f"{row.model:<10} {row.label:<34} {row.payload_mb:15.3f} {row.tx_mb:14.3f} {row.rx_mb:14.3f} "
                     f"{_inter_text(row):>13} {crossover_text(row):>11} {paper} {diff}{match}")
    return "\n".join(lines)

