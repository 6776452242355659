"""Metrics: ``metrics.jsonl`` always (one JSON object per logged step or evaluation, and per
event such as a resume at another world size), wandb
optionally, and a one-line console report. Only rank 0 writes."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lowcomm.rundir import MetricsError, RunDir, checkpoint_step, list_checkpoints, read_metrics

__all__ = ["MetricsWriter", "Progress", "check_resumable", "read_metrics", "truncate_after"]


def check_resumable(run_dir: Path) -> None:
    """Before a resume: the run's record of the steps its checkpoints hold is there and readable.

    A missing ``metrics.jsonl`` is refused, not warned about: the resume would write a new one
    from the checkpoint's step on, so the curves, tables and figures of the run would start
    there with nothing to say that steps were lost, and a copy of the old file (a backup, a
    snapshot) could no longer be put back without merging. To resume without those steps is a
    choice the user makes by creating the file empty. A line that does not parse (other than a
    last one cut off while being written) is named with its line number."""
    path = RunDir(run_dir).metrics
    newest = list_checkpoints(RunDir(run_dir).checkpoints)
    if not newest:
        return
    if not path.exists():
        step = checkpoint_step(newest[0])
        raise MetricsError(
            f"{path} is missing, but the run has checkpoints (the newest at step {step}): resuming would leave "
            f"the metrics of steps 1-{step} out of its curves and tables. Put the file back; or, to resume without "
            f"them, create it empty (touch {path}); or remove {run_dir} to train the run again")
    try:
        read_metrics(path)
    except MetricsError as exc:
        raise MetricsError(f"{exc}: fix or delete that line, then run the same command again") from exc

def truncate_after(path: Path, step: int) -> int:
    """Drop records logged after ``step`` (a resumed run re-logs them), and the events of a resume
    from ``step`` itself (a resume from it again records its own); return how many."""
    if not path.is_file():
        return 0
    records = read_metrics(path)
    kept = [record for record in records if record["step"] < step or (record["step"] == step and "event" not in record)]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(tmp, path)
    return len(records) - len(kept)


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, wandb_cfg, run_name: str, config: dict,
                 resume_step: int | None):
        self.enabled = enabled
        self.path = RunDir(run_dir).metrics
        self._wandb = None
        if not enabled:
            return
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        if wandb_cfg.mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=wandb_cfg.project, entity=wandb_cfg.entity, name=run_name, id=run_name,
                resume="allow", mode=wandb_cfg.mode, dir=str(run_dir), config=config,
            )
            self._wandb.define_metric("comm/cum_payload_MB")
            for prefix in ("train", "val"):
                self._wandb.define_metric(f"{prefix}/*", step_metric="comm/cum_payload_MB")

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def event(self, step: int, event: str, **fields: Any) -> None:
        """A change in how the run goes on (``"event": "resume"`` at another world size), a line of
        ``metrics.jsonl`` at the step it happened; not a metric, so not sent to wandb."""
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, "event": event, **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """``step 120/300 | loss 2.431 | val 2.412 (floor 2.072) | 0.81 MB/step, 97.3 MB sent | 41.2k tok/s | ETA 00:00:32``

    MB/step is the run's average so far (cumulative payload / steps), which is what the
    comparison between every-step and periodic-sync optimizers needs."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool, stream=sys.stdout):
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream
        self._t0 = time.perf_counter()
        self._s0 = start_step
        self.last_val: str = ""

    def report(self, step: int, loss: float, cum_mb: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        done = step + 1 - self._s0
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(done, 1) * (self.total - step - 1)
        line = (
            f"step {step + 1:>{len(str(self.total))}}/{self.total} | loss {loss:.4f}{self.last_val} | "
            f"{cum_mb / (step + 1):.3f} MB/step, {cum_mb:,.1f} MB sent | {tokens_per_s / 1e3:.1f}k tok/s | "
            f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        )
        print(line, file=self.stream, flush=True)
