"""Reading run directories (never wandb): config, metrics, summary and evaluations.

A run that is still training or was stopped early has no ``summary.json``; its numbers are then
taken from ``metrics.jsonl`` at the last logged step, so a partial sweep can be reported too.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from lowcomm.config import labels as run_labels
from lowcomm.config import load_run_config
from lowcomm.config.labels import OPTIMIZER_NAMES, dct_setting, run_label
from lowcomm.rundir import RunDir

__all__ = ["OPTIMIZER_NAMES", "RunRecord", "distinct_labels", "find_runs", "load_run"]


# The events of a run of replica groups that leave and rejoin (marked on its loss curves).
MEMBERSHIP_EVENTS = ("heal", "membership", "exchange_dropped")


@dataclass
class RunRecord:
    """Everything one run directory holds, read once."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] | None
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def optimizer(self) -> str:
        return self.config["optimizer"]["name"]

    @property
    def model(self) -> str:
        return self.config["model"]["name"]

    @property
    def label(self) -> str:
        """The config's ``label`` (a sweep writes one for each job), else the optimizer's name
        plus its DCT chunk and k when it has them (:mod:`lowcomm.config.labels`)."""
        return run_label(self.config)

    @property
    def chunk(self) -> int | None:
        """DCT block side: the ``dct_topk`` compression group's, else the optimizer's own
        ``compression_chunk`` (DeMo's fields); None for a run that sends no DCT top-k."""
        return dct_setting(self.config, "chunk")

    @property
    def topk(self) -> int | None:
        """Coefficients kept per DCT block, found like :attr:`chunk`."""
        return dct_setting(self.config, "topk")

    @property
    def complete(self) -> bool:
        """Whether the run finished (only a finished run writes ``summary.json``)."""
        return self.summary is not None

    @property
    def final_step(self) -> int | None:
        if self.summary is not None and self.summary.get("steps") is not None:
            return int(self.summary["steps"])
        return self.metrics[-1]["step"] if self.metrics else None

    @property
    def diverged(self) -> dict | None:
        """The summary's ``diverged`` entry (step, reason, lr) of a run that diverged, else None."""
        return (self.summary or {}).get("diverged")

    @property
    def final_val_loss(self) -> float | None:
        """The summary's final validation loss, else the last ``val/loss`` logged; None for a run
        that diverged (its losses before it are no result: reports rank it worst)."""
        if self.diverged:
            return None
        if self.summary is not None and self.summary.get("final_val_loss") is not None:
            return float(self.summary["final_val_loss"])
        _, losses = self.series("val/loss")
        return losses[-1] if losses else None

    @property
    def final_train_loss(self) -> float | None:
        """The last ``train/loss`` logged (the mean over workers of that step's loss); None for a
        run that diverged."""
        if self.diverged:
            return None
        _, losses = self.series("train/loss")
        return losses[-1] if losses else None

    @property
    def world_size(self) -> int:
        if self.summary is not None and self.summary.get("world_size"):
            return int(self.summary["world_size"])
        cluster = self.config["cluster"]
        return int(cluster["workers"] if cluster.get("launcher", "local") == "local"
                   else cluster["nodes"] * cluster["tasks_per_node"])

    @property
    def bayes_floor(self) -> float | None:
        if self.summary is not None and self.summary.get("bayes_floor") is not None:
            return float(self.summary["bayes_floor"])
        _, floors = self.series("val/bayes_floor")
        return floors[-1] if floors else None

    @property
    def payload_mb_per_step(self) -> float | None:
        """MB (1e6 bytes) this worker contributed per step, averaged over the run: the papers'
        "Tx MB/step". From the summary, else the cumulative payload at the last logged step."""
        return self._mb_per_step("payload_MB_per_step", "comm/cum_payload_MB")

    @property
    def two_links(self) -> bool:
        """Did the run report an inter-node link of its own (FlexDeMo's ``inter`` scope)?"""
        return any("comm/inter_payload_bytes" in record for record in self.metrics)

    @property
    def inter_node_payload_mb_per_step(self) -> float | None:
        """MB per step this worker contributed on the link between nodes (the ``inter`` scope);
        for a run with one link, all of its payload."""
        if not self.two_links:
            return self.payload_mb_per_step
        return self._mb_per_step("inter_node_payload_MB_per_step", "comm/cum_inter_payload_MB")

    @property
    def tx_mb_per_step(self) -> float | None:
        """MB this worker sent per step under each collective's standard algorithm (ring)."""
        return self._mb_per_step("tx_MB_per_step", "comm/cum_tx_MB")

    def _mb_per_step(self, summary_key: str, cumulative_key: str) -> float | None:
        if self.summary is not None and self.summary.get(summary_key) is not None:
            return float(self.summary[summary_key])
        steps, cumulative = self.series(cumulative_key)
        return cumulative[-1] / steps[-1] if steps and steps[-1] > 0 else None

    def membership_changes(self) -> list[tuple[int, str]]:
        """``(step, event)`` of every change a replica group recorded (lowcomm.comm.ft): a heal
        from a live peer, a quorum that shrank or grew, an exchange every group dropped."""
        return [(r["step"], r["event"]) for r in self.metrics if r.get("event") in MEMBERSHIP_EVENTS]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of every logged ``key``, by step; a step logged twice keeps its
        last value (a resumed run re-logs the steps after its checkpoint)."""
        by_step = {r["step"]: r[key] for r in self.metrics if r.get(key) is not None}
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]

    def cumulative_mb_at(self, steps: list[int], *, inter_node: bool = False) -> list[float]:
        """Cumulative payload MB at each of ``steps`` (the x axis of loss-vs-MB curves); with
        ``inter_node``, the part of it that crossed between nodes (a run with two links).

        Exact at the steps that logged it; in between (an evaluation logged on its own line)
        linearly interpolated, which is exact for a constant payload per step."""
        key = "comm/cum_inter_payload_MB" if inter_node and self.two_links else "comm/cum_payload_MB"
        logged_steps, cumulative = self.series(key)
        if not logged_steps:
            raise ValueError(f"{self.path}: metrics.jsonl has no {key}")
        return [float(v) for v in np.interp(steps, logged_steps, cumulative)]

    def eval_result(self, step: int | None = None) -> tuple[int, dict[str, Any]] | None:
        """The evaluation stored for ``step`` (default: the latest one) as ``(step, result)``."""
        if not self.evals:
            return None
        chosen = max(self.evals) if step is None else step
        return (chosen, self.evals[chosen]) if chosen in self.evals else None


def load_run(path: str | Path) -> RunRecord:
    path = Path(path)
    run_dir = RunDir(path)
    if not run_dir.is_run():
        raise FileNotFoundError(f"{run_dir.config} is missing: {path} is not a lowcomm run directory")
    return RunRecord(
        path=path,
        config=OmegaConf.to_container(load_run_config(run_dir.config), resolve=True),
        metrics=run_dir.read_metrics(),
        summary=run_dir.read_summary(),
        evals=run_dir.read_evals(),
    )


def find_runs(patterns: list[str]) -> list[RunRecord]:
    """Run directories matching globs (a directory with a config.yaml), sorted by path."""
    found = sorted({Path(p) for pattern in patterns for p in glob.glob(str(pattern))
                    if RunDir(Path(p)).is_run()})
    return [load_run(p) for p in found]


def distinct_labels(runs: list[RunRecord], ignore: tuple[str, ...] = ()) -> list[str]:
    """Each run's :attr:`~RunRecord.label`, extended where two runs would share one by the
    config values that tell them apart (``DeMo lr=0.001``; not the keys in ``ignore``), else by
    their run directory, for legends and table rows."""
    return run_labels.distinct_labels([run.config for run in runs], [run.label for run in runs], ignore=ignore,
                                      fallbacks=[f"({run.path.parent.name}/{run.name})" for run in runs])
