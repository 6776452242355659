"""The training loop end to end on real gloo workers: AdamW-DDP's metered bytes, checkpoints,
SIGKILL and exact resume, fallback from a damaged checkpoint, metrics and wandb output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lowcomm.launch.local import launch_local
from lowcomm.models import build_model, count_parameters
from lowcomm.train.checkpoint import list_checkpoints
from lowcomm.train.metrics import read_metrics
from runs import TINY, as_in_a_terminal, first_metrics, tiny_run, train_in_workers

pytestmark = pytest.mark.slow


@pytest.mark.slow
def test_adamw_ddp_payload_is_every_gradient_element_and_tx_rx_follow_the_ring(trained_run):
    world = 4
    run = trained_run("train.checkpoint_every=0", workers=world, max_steps=3)
    n_params = count_parameters(build_model(run.model, "meta"))
    records = read_metrics(run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["comm/payload_bytes"] == n_params * 2  # bf16 gradients (the default), each element once
        # per bucket: 2(W-1)/W of it each way; the buckets' integer divisions can lose a byte each
        ring = 2 * (world - 1) * n_params * 2 / world
        assert record["comm/tx_bytes"] == record["comm/rx_bytes"] == pytest.approx(ring, abs=64)
        assert record["comm/messages"] % (2 * (world - 1)) == 0  # 2(W-1) ring sends per bucket
    assert records[-1]["comm/cum_payload_MB"] == pytest.approx(3 * n_params * 2 / 1e6)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert "payload_MB_per_step" in summary
    # FLOPs per token both ways; MFU only where a GPU's peak is known, never on CPU
    assert summary["flops_per_token_6N"] == 6 * n_params
    assert summary["flops_per_token_olmo_core"] > summary["flops_per_token_6N"]
    assert "mfu_6N" not in summary and "mfu_olmo_core" not in summary


def _train_cmd(run_root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lowcomm.cli.train", *TINY, "data.train_tokens=65536", "data.val_tokens=4096",
            f"run_root={run_root}", "cluster.workers=2", "train.max_steps=40", "train.checkpoint_every=4",
            "train.keep_checkpoints=3", "train.eval_every=10", *extra]


def _worker_pids(config_path: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"lowcomm.train.worker {config_path}"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_is_bit_identical(tmp_path):
    reference_root, killed_root = tmp_path / "reference", tmp_path / "killed"
    # the uninterrupted reference is what the run computes, not a process's fate: forked ranks,
    # _train_cmd's settings (the killed run below is found by its name)
    ref_dir = train_in_workers(tiny_run(reference_root, "train.checkpoint_every=4", "train.keep_checkpoints=3",
                                        "train.eval_every=10", max_steps=40))

    proc = subprocess.Popen(_train_cmd(killed_root), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = killed_root / "default" / ref_dir.name
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "step_000000008").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before its second checkpoint"
        time.sleep(0.01)
    for pid in _worker_pids(run_dir / "config.yaml"):
        os.kill(pid, signal.SIGKILL)
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode != 0 and "killed by signal 9" in output
    interrupted_at = max(int(p.name.split("_")[1]) for p in list_checkpoints(run_dir / "checkpoints"))
    assert interrupted_at < 40

    resumed = subprocess.run(_train_cmd(killed_root), cwd=tmp_path, timeout=300, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step_{interrupted_at:09d}" in resumed.stdout

    final = "checkpoints/step_000000040/model.pt"
    ref_state, resumed_state = torch.load(ref_dir / final), torch.load(run_dir / final)
    for name, tensor in ref_state.items():
        assert torch.equal(tensor, resumed_state[name]), f"{name} differs after resume"
    ref_metrics, resumed_metrics = read_metrics(ref_dir / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in resumed_metrics]
    assert steps == sorted(set(steps)), "metrics.jsonl has duplicated steps after the resume"
    for key in ("train/loss", "val/loss", "comm/payload_bytes", "comm/cum_payload_MB"):
        assert [r.get(key) for r in resumed_metrics] == [r.get(key) for r in ref_metrics], key


@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_and_the_previous_complete_one_is_used(tmp_path, capfd):
    run = tiny_run(tmp_path, "train.checkpoint_every=2", "train.keep_checkpoints=3", max_steps=4)
    train_in_workers(run)
    newest = run.run_dir / "checkpoints" / "step_000000004"
    with (newest / "model.pt").open("r+b") as handle:
        handle.truncate(100)
    (run.run_dir / "summary.json").unlink()  # as if killed before the end: a finished run is not rerun
    capfd.readouterr()
    train_in_workers(run)
    text = "".join(capfd.readouterr())
    assert f"{newest / 'model.pt'} is truncated or altered" in text
    assert "resuming from step_000000002" in text

    (newest / "rank1.pt").unlink()  # the re-run wrote step 4 again; now a rank's file goes missing
    (run.run_dir / "summary.json").unlink()
    train_in_workers(run)
    text = "".join(capfd.readouterr())
    assert f"{newest / 'rank1.pt'} is missing" in text
    assert "resuming from step_000000002" in text

    # killed after the final checkpoint but before summary.json: a rerun evaluates and summarises
    summary = json.loads((run.run_dir / "summary.json").read_text())
    (run.run_dir / "summary.json").unlink()
    train_in_workers(run)
    assert "resuming from step_000000004" in "".join(capfd.readouterr())
    rerun = json.loads((run.run_dir / "summary.json").read_text())
    assert rerun["final_val_loss"] == summary["final_val_loss"] and rerun["steps"] == 4


@pytest.mark.slow
def test_wandb_offline_writes_a_local_run(tmp_path):
    run = tiny_run(tmp_path, "wandb.mode=offline", "train.checkpoint_every=0", max_steps=2)
    train_in_workers(run)
    offline_runs = list((run.run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and any(offline_runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_ctrl_c_checkpoints_at_the_next_step_and_says_where_in_one_line(tmp_path):
    """SIGINT to the terminal's process group (what Ctrl-C sends): no traceback, a checkpoint at
    the step the ranks stopped at, and a rerun that resumes from it. The signal follows the first
    metrics line (step 10) within 50 ms, 30 steps before the last (40), which the rerun reaches."""
    command = _train_cmd(tmp_path, "train.checkpoint_every=0")
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_in_a_terminal)
    metrics = first_metrics(proc, tmp_path / "default")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=240)

    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err
    run_dir = metrics.parent
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert len(checkpoints) == 1
    stopped_at = int(checkpoints[0].name.split("_")[1])
    assert 0 < stopped_at < 40
    final = [line for line in err.splitlines() if line.startswith("lowcomm-train:")]
    assert final == [f"lowcomm-train: interrupted: stopped with a checkpoint at {checkpoints[0]}; "
                     "run the same command to resume"]

    resumed = subprocess.run(_train_cmd(tmp_path, "train.checkpoint_every=0"),
                             cwd=tmp_path, timeout=600, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from step_{stopped_at:09d}" in resumed.stdout
    steps = [record["step"] for record in read_metrics(metrics)]
    assert steps == sorted(set(steps)) and steps[-1] == 40


@pytest.mark.slow
def test_rerunning_a_finished_run_says_so_and_changes_nothing(tmp_path, capfd):
    run = tiny_run(tmp_path, max_steps=3)
    train_in_workers(run)
    files = {name: (run.run_dir / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    capfd.readouterr()

    launch_local(run)

    assert f"{run.run_name} is complete" in capfd.readouterr().out
    assert {name: (run.run_dir / name).read_bytes() for name in files} == files


def test_a_second_launch_of_a_running_config_fails_at_once_naming_the_owner(tmp_path, capsys):
    from lowcomm.cli.train import main
    from lowcomm.runlock import RunDirLock

    overrides = [*TINY, "data.train_tokens=65536", "data.val_tokens=4096", f"run_root={tmp_path}",
                 "cluster.workers=2", "train.max_steps=3"]
    run_dir = tiny_run(tmp_path, max_steps=3).run_dir
    with RunDirLock(run_dir):  # this test process is the live owner
        assert main(overrides) == 1
    assert f"is in use by pid {os.getpid()}" in capsys.readouterr().err
    assert not (run_dir / "config.yaml").exists()  # the second launch touched nothing


def test_a_stale_lock_is_taken_over_with_a_message(tmp_path, capsys):
    import json
    import socket

    from lowcomm.runlock import LOCK_FILE, RunDirLock

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout)}))
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert f"taking over {tmp_path / LOCK_FILE}: its owner (pid {int(gone.stdout)} on" in out and "is gone" in out
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.slow
def test_workers_die_with_their_launcher(tmp_path):
    proc = subprocess.Popen(_train_cmd(tmp_path, "train.max_steps=4000", "train.checkpoint_every=0"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    config = None
    while config is None or len(_worker_pids(config)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        config = next((tmp_path / "default").glob("*/config.yaml"), None) if (tmp_path / "default").exists() else None
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while _worker_pids(config) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _worker_pids(config) == [], "workers outlived their killed launcher"


@pytest.mark.slow
def test_the_launcher_refuses_to_resume_on_changed_data(tmp_path):
    from lowcomm.data.memmap import DataError

    run = tiny_run(tmp_path, "train.checkpoint_every=2", max_steps=2)
    train_in_workers(run)
    (run.run_dir / "summary.json").unlink()  # as if killed before the end
    train_file = next((tmp_path / "data").glob("synthetic-*/train.bin"))
    with train_file.open("r+b") as handle:
        handle.seek(train_file.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DataError, match=f"{train_file.resolve()} changed content"):
        launch_local(run)


def test_a_compiled_model_trains_as_the_eager_one_and_its_checkpoint_keys_are_the_same(tmp_path):
    """train.compile=true on the CPU (inductor): the same losses over 3 steps, and checkpoints an
    eager run can read (nn.Module.compile adds no prefix to the state dict)."""
    runs = {setting: tiny_run(tmp_path / setting, f"train.compile={setting}", "train.checkpoint_every=3",
                              workers=1, max_steps=3)
            for setting in ("false", "true")}
    assert runs["false"].run_name == runs["true"].run_name  # how it runs, not what it trains
    for run in runs.values():
        train_in_workers(run)
    losses = {setting: [r["train/loss"] for r in read_metrics(run.run_dir / "metrics.jsonl")]
              for setting, run in runs.items()}
    assert len(losses["true"]) == 3
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)
    states = {setting: torch.load(list_checkpoints(run.run_dir / "checkpoints")[0] / "model.pt")
              for setting, run in runs.items()}
    assert states["true"].keys() == states["false"].keys()
