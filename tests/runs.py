"""Helpers for tests that launch real tiny runs (imported by test modules, not a test itself)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lowcomm.comm import Communicator
from lowcomm.comm.ft import LIGHTHOUSE_ENV
from lowcomm.comm.spawn import spawn_workers
from lowcomm.config import validate
from lowcomm.config.compose import compose
from lowcomm.config.sweep import load_sweep
from lowcomm.launch.local import prepare_run_dir, replica_lighthouse
from lowcomm.rundir import RunDir
from lowcomm.train.checkpoint import list_checkpoints
from lowcomm.train.metrics import read_metrics
from lowcomm.train.synchronizer import RECORD as SYNCHRONIZER_RECORD
from lowcomm.train.synchronizer import SYNCHRONIZER_ENV, SynchronizerProcess, uses_synchronizer

# Small enough for 2 cores: a handful of steps of the tiny model on a small synthetic corpus.
TINY = [
    "wandb.mode=disabled",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "train.eval_instances=16",
    "train.log_every=1",
]
SMALL_SYNTHETIC = ["data.train_tokens=65536", "data.val_tokens=4096"]


def tiny_run(run_root: Path, *overrides: str, workers: int = 2, max_steps: int = 6):
    """A validated RunConfig of the tiny model on ``workers`` local processes."""
    synthetic = not any(o.startswith("data=") and o != "data=synthetic" for o in overrides)
    cfg = compose([*TINY, *(SMALL_SYNTHETIC if synthetic else []), f"run_root={run_root}", f"cluster.workers={workers}", f"train.max_steps={max_steps}",
                   *overrides])
    return validate(cfg)


def train_in_workers(run, *, timeout_s: float = 300.0) -> Path:
    """Train ``run`` as :func:`launch_local` does, its directory prepared the same way
    (:func:`prepare_run_dir`: the data made and checked, ``config.yaml`` written) and the same
    :func:`lowcomm.train.loop.train` in each rank, but with the ranks forked from
    :func:`spawn_workers`' fork server instead of started as fresh interpreters: a rank starts in
    a fraction of a second instead of the ~3.5 s a worker spends importing torch and OLMo, which
    is most of a tiny run's time. Each rank is still a process of its own, with none of lowcomm's
    state from an earlier run (the server has imported torch and OLMo alone), so a resume here starts
    from the checkpoint as a relaunched worker does. For tests of what a run computes and
    writes; tests of processes themselves (signals, exit lines, lost peers) launch for real.
    Replica groups of one rank (``cluster.fault_tolerance=torchft``) get their lighthouse as the
    launcher starts it (:func:`replica_lighthouse`: here, its address in the ranks' environment);
    learners, their synchronizer (in a thread here: :class:`ThreadedSynchronizer`).
    A finished run is left as it is, as ``launch_local`` leaves it. Returns the run directory."""
    if RunDir(run.run_dir).read_summary() is not None:
        return run.run_dir
    config_path = prepare_run_dir(run)
    synchronizer = ThreadedSynchronizer(run) if uses_synchronizer(run) else None  # (learners: it first)
    lighthouse = replica_lighthouse(run)
    if lighthouse is not None and run.cluster.ranks_per_group != 1:
        lighthouse.shutdown()
        raise ValueError("train_in_workers runs replica groups of one rank (groups of several meet at stores of "
                         "their own, which launch_local makes)")
    try:
        with pytest.MonkeyPatch.context() as env:  # spawn_workers hands its caller's environment on
            if lighthouse is not None:
                env.setenv(LIGHTHOUSE_ENV, lighthouse.address())
            if synchronizer is not None:
                env.setenv(SYNCHRONIZER_ENV, synchronizer.address)
            # groups and learners: no world-wide group
            spawn_workers(_train_rank, run.world_size, str(config_path), timeout_s=timeout_s,
                          backend=None if lighthouse is not None or synchronizer is not None else "gloo")
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
        if synchronizer is not None:
            assert synchronizer.stop() == 0, f"the synchronizer of {run.run_dir} failed: {synchronizer.error!r}"
    return run.run_dir


class ThreadedSynchronizer:
    """The run's synchronizer (:class:`SynchronizerProcess`, what ``python -m
    lowcomm.train.synchronizer`` serves) in a thread of this process rather than a process of its
    own, as the ranks are forked rather than started: the same state, hub and saved states, without
    an interpreter's start-up. The process itself is tested by the launchers' tests and on nodes."""

    def __init__(self, run):
        Path(run.run_dir, SYNCHRONIZER_RECORD).unlink(missing_ok=True)  # an earlier launch's
        self.process = SynchronizerProcess(run)
        self.address = self.process.address
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="synchronizer")
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.process.serve()
        except BaseException as error:  # noqa: BLE001 - said by stop()
            self.error = error

    def stop(self, wait_s: float = 60.0) -> int:
        """0 once it has served every learner to its end (as the process's exit status); 1 if it
        failed or still serves after ``wait_s`` (left to its idle timeout, a daemon thread)."""
        self._thread.join(wait_s)
        return 1 if self._thread.is_alive() or self.error is not None else 0


def _train_rank(rank: int, world: int, config_path: str) -> int:  # noqa: ARG001 - spawn_workers' signature
    """A rank of :func:`train_in_workers`: what ``python -m lowcomm.train.worker`` does, its rank
    and world read from the environment spawn_workers gives it, as torchrun's would be."""
    from lowcomm.config import load_run_config, validate
    from lowcomm.distenv import DistEnv
    from lowcomm.train.loop import train

    return train(validate(load_run_config(config_path)), DistEnv.from_environ()).final_step


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the local launcher's worker processes of the run in ``run_dir``."""
    found = subprocess.run(["pgrep", "-f", f"lowcomm.train.worker {run_dir}"], capture_output=True, text=True)
    ranks = {}
    for pid in map(int, found.stdout.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it left between the two looks
            continue
        ranks[int(next(e for e in environ if e.startswith(b"RANK=")).split(b"=")[1])] = pid
    return ranks


def quickstart_points() -> dict[str, list[str]]:
    """The quickstart's runs, ``"optimizer=<name>|label=..."`` -> their overrides (without the
    sweep's base): the quickstart covers every registered optimizer (test_resume checks), so a
    test parametrised over these covers them all."""
    sweep = load_sweep("quickstart")
    return {next(o for o in job if o.startswith("optimizer=")) + "|" + job[-1]: job[len(sweep.base):]
            for job in sweep.jobs}


def at_world_size_one(overrides: list[str]) -> list[str]:
    """A quickstart point's overrides for one worker: FlexDeMo's sharding group becomes that one
    rank (a real group of one; its 2x2 setting needs four)."""
    kept = [o for o in overrides if not o.startswith("optimizer.shard_group_size")]
    return kept + (["optimizer.shard_group_size=1"] if kept[0] == "optimizer=flexdemo" else [])


def point_id(point: str) -> str:
    return point.split("|")[1].split("=", 1)[1]


def as_in_a_terminal() -> None:
    """``preexec_fn`` of a command that a test stops with Ctrl-C (SIGINT to its process group):
    SIGINT as a terminal's foreground job has it. A suite started in the background by a
    non-interactive shell (``make test &``) runs with SIGINT ignored, its children inherit that,
    and Python then never turns SIGINT into KeyboardInterrupt: as under ``nohup``, on purpose."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def first_metrics(proc: subprocess.Popen, experiment_dir: Path, timeout_s: float = 240) -> Path:
    """The metrics file of the one run under ``experiment_dir`` (``<run_root>/default``) once
    ``proc``, which trains it, has logged a step: the moment a signal test sends its signal.
    Fails with the process's output if it ends or the deadline passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = sorted(experiment_dir.glob("*/metrics.jsonl")) if experiment_dir.exists() else []
        if found and read_metrics(found[0]):
            return found[0]
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def micro_sweep_overrides(run_root: Path) -> list[str]:
    """Overrides that shrink a quickstart-based sweep to seconds per run (2 workers, 4 sequences
    of 64 tokens per step, a 32k-token corpus), for end-to-end tests of the sweep drivers."""
    return [f"run_root={run_root}", "wandb.mode=disabled", "cluster.workers=2", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.seq_len=64", "train.eval_instances=8", "data.train_tokens=32768",
            "data.val_tokens=2048"]


def _train_cmd(run_root: Path, *extra: str) -> list[str]:
    """``lowcomm-train`` of the tiny model: 14 steps, a checkpoint every 5, evaluation every 7."""
    return [sys.executable, "-m", "lowcomm.cli.train", *TINY, *SMALL_SYNTHETIC, f"run_root={run_root}",
            "cluster.workers=2", "train.max_steps=14", "train.checkpoint_every=5", "train.keep_checkpoints=3",
            "train.eval_every=7", *extra]


def kill_resume_and_compare(tmp_path: Path, *overrides: str, kill_after: str = "step_000000005") -> None:
    """Run to the end; run again, SIGKILL the workers once ``kill_after`` is written, resume,
    and require the final parameters and the whole loss / byte sequence to be identical."""
    reference_root, killed_root = tmp_path / "reference", tmp_path / "killed"
    # the uninterrupted reference is what a run computes, not a process's fate: forked ranks
    reference = tiny_run(reference_root, "train.checkpoint_every=5", "train.keep_checkpoints=3", "train.eval_every=7",
                         *overrides, max_steps=14)
    ref_dir = train_in_workers(reference)  # _train_cmd's settings: the killed run below has its name
    proc = subprocess.Popen(_train_cmd(killed_root, *overrides), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    run_dir = killed_root / "default" / ref_dir.name
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / kill_after).exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before the checkpoint"
        time.sleep(0.01)
    out = subprocess.run(["pgrep", "-f", f"lowcomm.train.worker {run_dir / 'config.yaml'}"], capture_output=True,
                         text=True)
    for pid in [int(p) for p in out.stdout.split()]:
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    interrupted_at = max(int(p.name.split("_")[1]) for p in list_checkpoints(run_dir / "checkpoints"))
    assert interrupted_at < 14
    resumed = subprocess.run(_train_cmd(killed_root, *overrides), cwd=tmp_path, timeout=300, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step_{interrupted_at:09d}" in resumed.stdout
    final = "checkpoints/step_000000014"
    for name in ["model.pt"] + [p.name for p in (ref_dir / final).glob("optim_rank*")]:
        ref_state = torch.load(ref_dir / final / name, weights_only=False)
        resumed_state = torch.load(run_dir / final / name, weights_only=False)
        assert _same(ref_state, resumed_state), f"{name} differs after the resume"
    ref_metrics, resumed_metrics = read_metrics(ref_dir / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    for key in ("train/loss", "val/loss", "comm/payload_bytes", "comm/cum_payload_MB"):
        assert [r.get(key) for r in resumed_metrics] == [r.get(key) for r in ref_metrics], key


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a if k != "rng")
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ------------------------------------------------------------------ runs submitted to SLURM
SLURM_FAILED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def slurm_job_id(run_dir: Path) -> str:
    """The SLURM job of a run's latest submission (``slurm/submissions.jsonl``)."""
    records = (run_dir / "slurm" / "submissions.jsonl").read_text().splitlines()
    return json.loads(records[-1])["job_id"]


def slurm_logs(run_dir: Path) -> str:
    """The ends of a run's SLURM task logs, for a failure message."""
    return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}"
                     for path in sorted((run_dir / "slurm").glob("*_log.*")))


def wait_for_summaries(run_dirs: list[Path], timeout_s: float) -> None:
    """Until every run has written summary.json; fails with the logs when a job ends without."""
    deadline = time.monotonic() + timeout_s
    while not all((run_dir / "summary.json").is_file() for run_dir in run_dirs):
        for run_dir in run_dirs:
            state = subprocess.run(["squeue", "--noheader", "--states=all", f"--jobs={slurm_job_id(run_dir)}",
                                    "--format=%T"], capture_output=True, text=True).stdout.strip()
            if state in SLURM_FAILED and not (run_dir / "summary.json").is_file():
                pytest.fail(f"job of {run_dir.name} ended {state}:\n{slurm_logs(run_dir)}", pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(f"runs not finished within {timeout_s}s:\n" + "\n".join(map(slurm_logs, run_dirs)),
                        pytrace=False)
        time.sleep(0.5)


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, train/loss)`` of every logged step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(record["step"], record["train/loss"]) for record in records if "train/loss" in record]


def preempt_once(run_dir: Path, *, after_losses: int = 3, timeout_s: float = 240) -> str:
    """Once the run has logged ``after_losses`` losses, what SLURM does before a preemption
    (``scancel --signal=USR2``, reaching every task); then wait for it to be requeued and finish.
    Returns task 0's log, which must show exactly one resume from a checkpoint."""
    job_id = slurm_job_id(run_dir)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").is_file() or len(train_losses(run_dir)) < after_losses:
        if time.monotonic() > deadline:
            pytest.fail(f"the run did not start logging:\n{slurm_logs(run_dir)}", pytrace=False)
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    wait_for_summaries([run_dir], timeout_s=timeout_s)
    log = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    resumed = [line for line in log.splitlines() if "resuming from step_" in line]
    assert len(resumed) == 1, f"the requeued job did not resume from a checkpoint:\n{log}"
    return log


def preempted_run_ends_like_an_uninterrupted_one(overrides: list[str], tmp_path: Path, *, steps: int,
                                                 ranks: int) -> Path:
    """Submit ``overrides`` (a SLURM cluster profile among them) twice: once uninterrupted, once
    preempted with USR2 after a few steps, requeued and resumed. The second must log the same
    losses and end with the same checkpoint, bit for bit: model, optimizer and every rank's own
    state (DiLoCo's workers differ between synchronisations). Returns the preempted run's
    directory."""
    from lowcomm.cli.train import run_config
    from lowcomm.config.compose import compose
    from lowcomm.launch.slurm import Queue

    reference = run_config(compose([*overrides, f"run_root={tmp_path / 'reference'}"]))
    wait_for_summaries([reference], timeout_s=240)
    # jobs are named after their run, so the second submission waits for the first to leave the queue
    deadline = time.monotonic() + 60
    while (job := Queue.read().find(job_id=slurm_job_id(reference))) is not None and job.active:
        assert time.monotonic() < deadline, f"the reference job stays {job.state}"
        time.sleep(0.2)
    run_dir = run_config(compose([*overrides, f"run_root={tmp_path / 'preempted'}"]))
    preempt_once(run_dir)
    assert train_losses(run_dir) == train_losses(reference)
    final = f"checkpoints/step_{steps:09d}"
    for name in ("model.pt", "optim.pt", *(f"optim_rank{rank}.pt" for rank in range(ranks))):
        ours, theirs = torch.load(run_dir / final / name), torch.load(reference / final / name)
        flat_ours, flat_theirs = list(tensors(ours)), list(tensors(theirs))
        assert len(flat_ours) == len(flat_theirs) > 0 and all(
            torch.equal(a, b) for a, b in zip(flat_ours, flat_theirs, strict=True)), name
    return run_dir


def tensors(state):
    """Every tensor of a (nested) state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for key in sorted(state, key=str):
            yield from tensors(state[key])
    elif isinstance(state, list | tuple):
        for item in state:
            yield from tensors(item)


def tensor_bytes(state) -> int:
    """Bytes of a (nested) state dict's tensors, 0-dim ones (AdamW's step counters) aside: what
    a strategy's ``optimizer_state_bytes`` counts."""
    return sum(t.numel() * t.element_size() for t in tensors(state) if t.dim())


class DroppingComm(Communicator):
    """One worker between replica groups (:mod:`lowcomm.comm.ft`) whose exchanges commit for the
    first ``commits`` asked, and are dropped after (a peer died inside them), counting the
    commits asked for and the quorums told to heal (``fall_behind``)."""

    replica_groups = True

    def __init__(self, commits: int = 0):
        super().__init__()
        self.allowed, self.commits, self.fell_behind = commits, 0, 0

    def commit(self) -> bool:
        self.commits += 1
        return self.commits <= self.allowed

    def fall_behind(self) -> None:
        self.fell_behind += 1
