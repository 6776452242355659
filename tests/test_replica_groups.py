"""Replica groups that leave and rejoin (``cluster.fault_tolerance=torchft``, lowcomm.comm.ft):
every method either runs as replica groups or is refused before anything starts, with its
reason; an exchange averages over the groups that contribute (a group that has just healed
contributes nothing) and a heal's bytes are metered on both ends; and through the real launcher,
a group killed mid-run stops no other, is relaunched, and heals from a live peer at its next
exchange (or, where none was made without it, replays its steps to it), after which both groups
end on one model, near an uninterrupted run's; benchmarks/churn.py's test makes the heal happen."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch

from lowcomm.comm.ft import LIGHTHOUSE_ENV, ReplicaGroups, start_lighthouse
from lowcomm.comm.meter import CommMeter
from lowcomm.comm.spawn import spawn_workers
from lowcomm.config import ConfigError, validate
from lowcomm.config.compose import compose
from lowcomm.launch.estimate import checkpoint_estimate
from lowcomm.launch.local import launch_local
from lowcomm.models import build_model
from lowcomm.report.figures import mark_membership, plot_loss_curves
from lowcomm.report.runs import load_run
from lowcomm.rundir import RunDir
from lowcomm.strategies import STRATEGIES
from lowcomm.train.checkpoint import load_file, optim_rank_file
from lowcomm.train.metrics import read_metrics
from lowcomm.train.replicas import replica_run_dir
from runs import SMALL_SYNTHETIC, TINY, train_in_workers, worker_pids

TORCHFT = ["cluster.fault_tolerance=torchft"]


# ------------------------------------------------------------------ before anything starts
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_method_runs_as_replica_groups_or_is_refused_before_anything_starts(name, tmp_path):
    strategy = STRATEGIES[name]
    cfg = compose([*TINY, f"run_root={tmp_path}", f"optimizer={name}", "cluster.workers=2", *TORCHFT,
                   *strategy.replica_groups_overrides()])
    refusal = strategy.replica_groups_refusal
    if refusal is None:
        assert validate(cfg).cluster.fault_tolerance == "torchft"
    else:
        with pytest.raises(ConfigError) as refused:
            validate(cfg)
        assert f"optimizer={name} cannot run under cluster.fault_tolerance=torchft: {refusal}" in refused.value.errors


@pytest.mark.parametrize(("overrides", "error"), [
    (["compression=quantize"], "dense exchange only (compression=none)"),
    (["cluster.min_replicas=3"], "cluster.min_replicas (3) is more than the run's replica groups"),
    (["cluster.workers=4", "cluster.ranks_per_group=2", "cluster.min_replicas=3"],
     "cluster.min_replicas (3) is more than the run's replica groups (2: cluster.workers=4 in groups of 2)"),
    (["cluster.workers=3", "cluster.ranks_per_group=2"], "cluster.workers (3) must be a multiple of cluster.ranks_per_group"),
    (["cluster.ranks_per_group=0"], "cluster.ranks_per_group must be an integer >= 1"),
    (["cluster.fault_tolerance=none", "cluster.ranks_per_group=2"], "only cluster.fault_tolerance=torchft has"),
    (["cluster.fault_tolerance=always"], "cluster.fault_tolerance must be one of: none, torchft"),
    (["cluster.join_timeout_s=0"], "cluster.join_timeout_s must be a positive number"),
    (["optimizer=sparseloco", "cluster.workers=4", "cluster.ranks_per_group=2"],
     "runs as replica groups of one rank each (its exchange between them is an all-gather"),
    (["cluster=slurm_debug"], "under SLURM a replica group is a node, a job of its own: set cluster.ranks_per_group=2"),
    (["cluster=slurm_local_2node", "cluster.ranks_per_group=2", "cluster.min_replicas=3"],
     "more than the run's replica groups (2: cluster.nodes=2, a group each)"),
    (["cluster=slurm_64gpu", "cluster.ranks_per_group=8"], "over gloo on the CPU: set cluster.device=cpu"),
    (["cluster.device=cuda"], "over gloo on the CPU: set cluster.device=cpu"),
    (["optimizer=streaming_diloco"], "sends its fragments dense (optimizer.quantization=none)"),
    # two fragments every 4 steps are sent 2 steps apart: a fragment must be merged before the next leaves
    (["optimizer=streaming_diloco", "optimizer.quantization=none", "optimizer.sync_every=4",
      "optimizer.num_fragments=2", "optimizer.overlap=2"], "optimizer.overlap (2) must be below the 2 steps"),
])
def test_a_replica_group_setting_that_cannot_run_is_refused_naming_it(overrides, error, tmp_path):
    optimizer = [] if any(o.startswith("optimizer=") for o in overrides) else ["optimizer=diloco"]
    cfg = compose([*TINY, f"run_root={tmp_path}", *optimizer, "cluster.workers=2", *TORCHFT, *overrides])
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert any(error in line for line in refused.value.errors), refused.value.errors


def test_under_torchrun_a_group_is_named_by_its_env_and_its_world_is_the_groups(tmp_path, monkeypatch):
    from lowcomm.distenv import DistEnv
    from lowcomm.train.replicas import REPLICA_GROUP_ENV, group_place, locked_dir

    run = validate(compose([*TINY, f"run_root={tmp_path}", "optimizer=diloco", "cluster.workers=4",
                            "cluster.ranks_per_group=2", *TORCHFT]))
    launch = DistEnv(rank=3, world_size=4, local_rank=3, local_world_size=4)
    monkeypatch.delenv(REPLICA_GROUP_ENV, raising=False)
    replica, within = group_place(run, launch)  # the local launcher: rank 3 of 4 is group 1's rank 1
    assert (replica, within.rank, within.world_size) == (1, 1, 2)
    assert locked_dir(run) == Path(run.run_dir)
    torchrun = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    monkeypatch.setenv(REPLICA_GROUP_ENV, "1")  # one torchrun per group: its world is the group
    assert group_place(run, torchrun) == (1, torchrun)
    assert locked_dir(run) == replica_run_dir(run.run_dir, 1) and locked_dir(run).is_dir()
    monkeypatch.setenv(REPLICA_GROUP_ENV, "2")
    with pytest.raises(ConfigError, match=r"LOWCOMM_REPLICA_GROUP='2' is not a replica group of this run \(0 ... 1"):
        group_place(run, torchrun)
    monkeypatch.setenv(REPLICA_GROUP_ENV, "0")
    with pytest.raises(ConfigError, match="has cluster.ranks_per_group \\(2\\) ranks, but this one has 4"):
        group_place(run, launch)


def test_the_lighthouse_for_groups_started_apart_records_itself_and_stops_on_sigterm(tmp_path, monkeypatch):
    from lowcomm.train.replicas import lighthouse_address

    proc = subprocess.Popen([sys.executable, "-m", "lowcomm.cli.lighthouse", "--record", str(tmp_path),
                             "--min-replicas", "2", "--host", "10.0.0.7"], stdout=subprocess.PIPE, text=True)
    record = tmp_path / "torchft.json"
    deadline = time.monotonic() + 60
    while not record.is_file():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    written = json.loads(record.read_text())
    assert written["lighthouse"].startswith("http://10.0.0.7:") and written["min_replicas"] == 2
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)  # a worker no launcher told reads the record
    assert lighthouse_address(tmp_path) == written["lighthouse"]
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://elsewhere:1")  # the launcher's word first
    assert lighthouse_address(tmp_path) == "http://elsewhere:1"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "lighthouse stopped (SIGTERM)" in out


# ------------------------------------------------------------------ nobody lost: the plain run
RUNNABLE = sorted(name for name, strategy in STRATEGIES.items() if strategy.replica_groups_refusal is None)


def _dense(name: str) -> list[str]:
    """A method's config as replica groups run it, the DiLoCo family synchronising every 3 steps
    (a 6-step run ends on one); Streaming DiLoCo's two fragments every 4, each sent at its own
    step and merged a step later (steps 2, 4 and 6, merged at 3, 5 and after the run)."""
    fields = STRATEGIES[name].Config.__dataclass_fields__
    if "num_fragments" in fields:
        period = ["optimizer.sync_every=4", "optimizer.num_fragments=2", "optimizer.overlap=1"]
    else:
        period = ["optimizer.sync_every=3"] if "sync_every" in fields else []
    return [*STRATEGIES[name].replica_groups_overrides(), *period]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNNABLE)
def test_replica_groups_that_lose_nobody_train_what_the_plain_run_trains(name, tmp_path, trained_run):
    plain = trained_run(f"optimizer={name}", *_dense(name))
    groups = validate(compose([*TINY, *SMALL_SYNTHETIC, f"run_root={tmp_path}", "cluster.workers=2",
                               "train.max_steps=6", f"optimizer={name}", *_dense(name), *TORCHFT]))
    train_in_workers(groups)  # forked ranks: what the groups compute, not how they are started
    expected = RunDir(plain.run_dir).read_summary()
    for replica in (0, 1):
        group_dir = replica_run_dir(groups.run_dir, replica)
        summary = RunDir(group_dir).read_summary()
        strategy = STRATEGIES[name]
        if not strategy.replicated_optimizer_state and not strategy.replicated_state_keys:
            # no state alike on every worker (Streaming DiLoCo: a fragment trains while another
            # is merged; eager DiLoCo: each applies its own term at once): each group's own state
            # is the plain run's rank's, tensor for tensor
            final = Path("checkpoints") / "step_000000006"
            own = list(_tensors(load_file(group_dir / final / optim_rank_file(0))))
            plain_own = list(_tensors(load_file(Path(plain.run_dir) / final / optim_rank_file(replica))))
            assert len(own) == len(plain_own) > 0
            for mine, theirs in zip(own, plain_own, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
        else:  # every group ends on the model the plain run ends on
            assert summary["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-4)
        assert summary["payload_MB_per_step"] == pytest.approx(expected["payload_MB_per_step"])
        assert summary["world_size"] == 2 and summary["heal_rx_MB"] == summary["heal_tx_MB"] == 0
    # the dry run's checkpoint size: the replicated state once per group (groups checkpoint apart)
    estimate = checkpoint_estimate(groups)
    per_rank = (estimate.boundary_per_rank_bytes if estimate.final_on_boundary and estimate.boundary_per_rank_bytes
                is not None else estimate.per_rank_bytes)
    expected_bytes = 2 * estimate.replicated_bytes + 2 * per_rank
    written = sum(path.stat().st_size for replica in (0, 1) for path in
                  (replica_run_dir(groups.run_dir, replica) / "checkpoints" / "step_000000006").glob("*.pt"))
    assert estimate.replicated_copies == 2 and estimate.total_bytes >= expected_bytes
    assert written <= 1.05 * expected_bytes + 64_000, (written, estimate)
    # (Streaming DiLoCo's is the most a checkpoint holds: its fragments' means in flight, none at the end)
    assert written >= expected_bytes or "num_fragments" in STRATEGIES[name].Config.__dataclass_fields__


@pytest.mark.slow
def test_groups_of_two_ranks_that_lose_nobody_train_what_four_plain_ranks_train(tmp_path, trained_run):
    """Two groups of two ranks (cluster.ranks_per_group=2: a node's ranks on a cluster): each
    rank all-reduces with its place in the other group, then within its group."""
    plain = trained_run("optimizer=diloco", *_dense("diloco"), workers=4)
    groups = validate(compose([*TINY, *SMALL_SYNTHETIC, f"run_root={tmp_path}", "cluster.workers=4",
                               "cluster.ranks_per_group=2", "train.max_steps=6", "optimizer=diloco",
                               *_dense("diloco"), *TORCHFT]))
    launch_local(groups)
    expected = RunDir(plain.run_dir).read_summary()
    params = expected["parameters"]
    for replica in (0, 1):
        summary = RunDir(replica_run_dir(groups.run_dir, replica)).read_summary()
        assert summary["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-4)
        assert summary["world_size"] == 4 and summary["payload_MB_per_step"] == expected["payload_MB_per_step"]
        # by hand: two outer steps in 6, each fp32 tensor once in a ring of the 2 groups (P) and
        # once in the group's ring of 2 (P); the plain run's ring of 4 carries 2 x 3/4 P
        assert summary["tx_MB_per_step"] * 1e6 * 6 == pytest.approx(2 * (4 * params + 4 * params), rel=1e-6)
        assert expected["tx_MB_per_step"] * 1e6 * 6 == pytest.approx(2 * 1.5 * 4 * params, rel=1e-6)
    assert json.loads((Path(groups.run_dir) / "torchft.json").read_text())["ranks_per_group"] == 2


def _tensors(state):
    """Every tensor of a nested state, in a fixed order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for key in sorted(state, key=str):
            yield from _tensors(state[key])
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _tensors(value)


# ------------------------------------------------------------------ one exchange, two groups
def _two_groups(worker) -> list[dict]:
    """``worker(rank, 2, lighthouse)`` as two replica groups meeting at a lighthouse of their own
    (an exchange commits with both); their results."""
    lighthouse = start_lighthouse(min_replicas=2, join_timeout_s=30, heartbeat_timeout_s=5)
    try:
        return spawn_workers(worker, 2, lighthouse.address(), timeout_s=120)
    finally:
        lighthouse.shutdown()


def _groups(rank: int, world: int, lighthouse: str, meter: CommMeter | None = None) -> ReplicaGroups:
    """This worker's ReplicaGroups of ``world`` one-rank groups (both needed for a commit)."""
    return ReplicaGroups(rank, world, lighthouse=lighthouse, min_replicas=2, meter=meter or CommMeter(),
                         timeout=datetime.timedelta(seconds=60))


def _exchange_after_a_heal(rank: int, world: int, lighthouse: str) -> dict:
    """Group 0 has trained 30 steps, group 1 10: at their first quorum together group 1
    takes group 0's state (a heal), contributes nothing (what it offers is sent as zeros), and
    both average what group 0 sent over the one group that contributed."""
    meter = CommMeter()
    groups = _groups(rank, world, lighthouse, meter)
    state = {"w": torch.full((1000,), 10.0 + rank)}
    groups.serve_state(lambda: {"w": state["w"]}, lambda sent: state["w"].copy_(sent["w"]))
    groups.progress = 30 if rank == 0 else 10  # the steps each has trained
    groups.begin_exchange()
    # the healed group's tensor was computed before its heal: it is sent as zeros
    sent = torch.full((1000,), 4.0 if rank == 0 else 7.0)
    groups.all_reduce(sent, op="avg")
    committed = groups.commit()
    result = {"w": float(state["w"][0]), "mean": float(sent[0]), "committed": committed, "live": groups.world_size,
              "contributors": groups.contributors, "events": groups.take_events(), "bytes": meter.breakdown()}
    groups.shutdown()
    return result


@pytest.mark.slow
def test_an_exchange_averages_over_the_groups_that_contribute_and_a_heal_is_metered_on_both_ends():
    ahead, healed = _two_groups(_exchange_after_a_heal)
    assert healed["w"] == ahead["w"] == 10.0  # group 1 took group 0's state
    assert ahead["live"] == healed["live"] == 2 and ahead["contributors"] == healed["contributors"] == 1
    assert ahead["mean"] == healed["mean"] == 4.0  # (4 + 0) / 1 contributor: not 7 in it, nor / 2 groups
    assert ahead["committed"] and healed["committed"]
    assert [event["event"] for event in healed["events"]] == ["heal"] and healed["events"][0]["bytes"] == 4000
    assert ahead["events"] == []
    # the heal: 1,000 fp32 values from group 0 to group 1, one way; the exchange: a ring of two
    sent, received = ahead["bytes"]["heal/world/heal"], healed["bytes"]["heal/world/heal"]
    assert (sent["tx"], sent["rx"], received["tx"], received["rx"]) == (4000, 0, 0, 4000)
    for side in (ahead, healed):
        data = side["bytes"]["data/world/all_reduce"]
        assert (data["payload"], data["tx"], data["rx"]) == (4000, 4000, 4000)  # 2 (W-1)/W x 4,000 at W=2


def _gather_after_a_heal(rank: int, world: int, lighthouse: str) -> dict:
    """As :func:`_exchange_after_a_heal`, an all-gather (SparseLoCo's): both groups get a row
    from each, and the healed group's (zeros) is left out of what counts."""
    meter = CommMeter()
    groups = _groups(rank, world, lighthouse, meter)
    groups.serve_state(lambda: {"w": torch.zeros(1)}, lambda _sent: None)
    groups.progress = 30 if rank == 0 else 10
    groups.begin_exchange()
    rows = torch.empty(groups.world_size * 3)
    groups.all_gather_into_tensor(rows, torch.full((3,), 4.0 if rank == 0 else 7.0))
    counted = groups.contributions(rows.view(groups.world_size, 3))
    result = {"rows": rows.view(-1, 3).tolist(), "counted": counted.tolist(), "committed": groups.commit(),
              "bytes": meter.breakdown()["data/world/all_gather"]}
    groups.shutdown()
    return result


@pytest.mark.slow
def test_an_all_gather_between_groups_counts_the_rows_of_the_groups_that_contribute():
    ahead, healed = _two_groups(_gather_after_a_heal)
    for side in (ahead, healed):
        assert side["committed"] and sorted(side["rows"]) == [[0.0] * 3, [4.0] * 3]  # the healed group sent zeros
        assert side["counted"] == [[4.0] * 3]  # its row is not counted: group 0's alone
        # a ring all-gather of 12 bytes between two: each sends its 12 and receives the other's
        assert (side["bytes"]["payload"], side["bytes"]["tx"], side["bytes"]["rx"]) == (12, 12, 12)


def _streaming_heal_at_another_phase(rank: int, world: int, lighthouse: str) -> dict:
    """Streaming DiLoCo, two fragments of unequal size every 4 steps (sent after steps 4k and
    4k + 2), merged one step later. Group 0 has done 5 inner steps and sends fragment 1 after its
    6th; group 1 restarted at step 3 and would send fragment 0 after its 4th: at their quorum it
    heals to group 0's step 6, sends fragment 1 as zeros, and both merge group 0's outer gradient."""
    from lowcomm.optim.streaming_diloco import StreamingDiLoCo, StreamingDiLoCoArgs

    groups = _groups(rank, world, lighthouse)
    torch.manual_seed(0)
    fragments = [[torch.nn.Parameter(torch.zeros(3))], [torch.nn.Parameter(torch.zeros(5))]]
    params = [p for fragment in fragments for p in fragment]
    args = StreamingDiLoCoArgs(sync_every=4, overlap=1, mixing=0.5, outer_lr=0.7, outer_momentum=0.9,
                               nesterov=True, exchange="all_reduce")
    optimizer = StreamingDiLoCo(fragments, torch.optim.SGD(params, lr=0.1), args, comm=groups)
    groups.serve_state(optimizer.state_dict, optimizer.load_state_dict)
    optimizer.local_step = 5 if rank == 0 else 3
    with torch.no_grad():  # what each has trained so far
        for p in params:
            p.fill_(1.0 + rank)
    sent = []
    # the loop's steps done at the end of each step; the gradients: group 1's first is its own
    # (lost in the heal), after it both take a step of gradient 1 (to compare the models after it)
    for progress, gradient in ((6, 1.0), (7, 1.0)) if rank == 0 else ((4, 5.0), (7, 1.0)):
        groups.progress = progress
        for p in params:
            p.grad = torch.full_like(p, gradient)
        optimizer.step()
        sent.append(optimizer.local_step)
    result = {"local_steps": sent, "params": [p.detach().tolist() for p in params],
              "global": [[t.tolist() for t in fragment] for fragment in optimizer._global],
              "contributors": groups.contributors, "events": [e["event"] for e in groups.take_events()]}
    groups.shutdown()
    return result


@pytest.mark.slow
def test_streaming_diloco_group_rejoining_at_another_phase_sends_the_peers_fragment():
    ahead, healed = _two_groups(_streaming_heal_at_another_phase)
    assert healed["events"] == ["heal"] and ahead["events"] == []
    assert ahead["local_steps"] == healed["local_steps"] == [6, 7]  # group 1 went on from group 0's step
    assert ahead["params"] == healed["params"] and ahead["global"] == healed["global"]  # one model again
    # by hand: group 0's fragment 1 after its SGD step 1 - 0.1 = 0.9, its outer gradient 0 - 0.9;
    # the mean over the one contributor -0.9; Nesterov (momentum 0.9): direction -0.9 (1 + 0.9) = -1.71;
    # global 0 + 0.7 x 1.71 = 1.197; after step 7 (SGD 0.9 - 0.1 = 0.8) mixed: 0.5 x 0.8 + 0.5 x 1.197
    assert ahead["global"][1] == [pytest.approx([1.197] * 5)] and ahead["global"][0] == [[0.0] * 3]
    assert ahead["params"][1] == pytest.approx([0.9985] * 5)
    assert ahead["params"][0] == pytest.approx([0.8] * 3)  # fragment 0: two SGD steps, not sent


SCALE_EAGER = (1.0, 3.0)


def _eager_heal(rank: int, world: int, lighthouse: str) -> dict:
    """tests/test_eager_diloco.py's hand-worked case (x = 0, H = 2, outer lr 0.5, no momentum,
    inner SGD lr 1, gradient c_r k in phase k, c = (1, 3)) as two replica groups. Both make outer
    step 1 together; then group 1 starts again from nothing (x = 0, its own phase 1), and at its
    outer step, behind group 0's step 4, it heals from group 0."""
    from lowcomm.optim.eager_diloco import EagerDiLoCo, EagerDiLoCoArgs

    args = EagerDiLoCoArgs.defaults(sync_every=2, outer_lr=0.5, outer_momentum=0.0, mode="eager",
                                    exchange="all_reduce")
    groups = _groups(rank, world, lighthouse)

    def start() -> tuple[torch.nn.Parameter, EagerDiLoCo]:
        param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        optimizer = EagerDiLoCo([param], lambda ps: torch.optim.SGD(ps, lr=1.0), args, comm=groups)
        groups.serve_state(optimizer.state_dict, optimizer.load_state_dict)
        return param, optimizer

    param, optimizer = start()
    # (phase, steps done after the step) of each step; group 1's second outer step is its first again
    steps = [(1, 1), (1, 2), (2, 3), (2, 4), (3, 5), (3, 6)] if rank == 0 else \
        [(1, 1), (1, 2), "restart", (1, 1), (1, 2), (3, 5), (3, 6)]
    history = []
    for step in steps:
        if step == "restart":  # its process lost: what it had in flight is committed by nobody
            param, optimizer = start()
            continue
        phase, groups.progress = step
        param.grad = torch.tensor([SCALE_EAGER[rank] * phase], dtype=torch.float64)
        optimizer.step()
        history.append(param.item())
    result = {"history": history, "events": [e["event"] for e in groups.take_events()]}
    groups.shutdown()
    return result


@pytest.mark.slow
def test_an_eager_diloco_group_that_heals_applies_the_peers_delayed_mean_less_the_peers_own_term():
    ahead, healed = _two_groups(_eager_heal)
    assert healed["events"] == ["heal"] and ahead["events"] == []
    # By hand. Outer step 1 (both): Delta = (2, 6), D = Delta / 2, theta^1 = (-0.5, -1.5); the mean 4
    # in flight. Group 0, steps 3-4 (phase 2): x = -2.5, -4.5, Delta^2 = 4. Group 1 again from 0:
    # x = -3, -6; at its outer step it heals (group 0's theta^1, own term 2 over 2, the mean 4) and
    # contributes nothing: one contributor, W = 1. Group 0: D = 4 + 4 / 1 - 2 / 2 = 7, theta^2 =
    # -0.5 - 3.5 = -4; group 1: D = 4 + 0 - 2 / 2 = 3, theta^2 = -0.5 - 1.5 = -2 (it lacks only group
    # 0's fresh term, which reaches it in the mean of this step: (4 + 0) / 1 = 4). Phase 3: group 0
    # x = -7, -10, Delta^3 = 6; group 1 x = -11, -20, Delta^3 = 18; both contribute, W = 2. Group 0:
    # D = 4 + 6 / 2 - 4 / 1 = 3, theta^3 = -5.5; group 1 (its own term 0): D = 4 + 18 / 2 = 13,
    # theta^3 = -8.5.
    assert ahead["history"] == [-1, -0.5, -2.5, -4, -7, -5.5]
    assert healed["history"] == [-3, -1.5, -3, -2, -11, -8.5]


# ------------------------------------------------------------------ a run that loses a group
# two groups of two ranks (a group of one rank is lost and back in tests/test_churn.py)
RUN = [*TINY, *SMALL_SYNTHETIC, "optimizer=diloco", "optimizer.sync_every=5", "cluster.workers=4",
       "cluster.ranks_per_group=2", *TORCHFT, "train.max_steps=120", "train.checkpoint_every=10", "train.eval_every=40"]
def _records(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def _steps_trained(run_dir: Path) -> int:
    steps = [record["step"] for record in _records(run_dir) if "train/loss" in record] if \
        (run_dir / "metrics.jsonl").is_file() else []
    return max(steps, default=0)


@pytest.mark.slow
def test_a_killed_group_stops_no_other_is_relaunched_and_rejoins_on_the_others_model(tmp_path):
    uninterrupted = validate(compose([*RUN, f"run_root={tmp_path / 'uninterrupted'}"]))
    launch_local(uninterrupted)

    # group 0 computes 3 times slower (cluster.slowdown: it sleeps, its heartbeat goes on), so that
    # it is still training when group 1 has started again on busy cores (a group whose peers have
    # all finished goes on alone, on a model of its own)
    churn = [*RUN, "cluster.slow_ranks=[0,1]", "cluster.slowdown=3", f"run_root={tmp_path / 'churn'}"]
    run = validate(compose(churn))
    proc = subprocess.Popen([sys.executable, "-m", "lowcomm.cli.train", *churn],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    group0, group1 = replica_run_dir(run.run_dir, 0), replica_run_dir(run.run_dir, 1)
    deadline = time.monotonic() + 240
    while _steps_trained(group1) < 12 or len(worker_pids(run.run_dir)) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    killed_at = _steps_trained(group1)
    os.kill(worker_pids(run.run_dir)[3], signal.SIGKILL)  # group 1's second rank: the group is lost
    out, err = proc.communicate(timeout=240)

    assert proc.returncode == 0, out + err
    # (its killed rank, or its other rank, which may find the group lost first on busy cores)
    assert re.search(r"\[lowcomm\] replica group 1 \(its rank [01]\) left \([^)]*\); starting it again to rejoin", out), out
    # group 0 was never stopped: one start, and a record of every step in order
    assert out.count(f"[lowcomm] {run.run_name}: starting") == 1
    steps0 = [record["step"] for record in _records(group0) if "train/loss" in record]
    assert steps0 == list(range(1, 121))
    # group 1 resumed from its own checkpoint. Where group 0 committed an exchange without it
    # (its restart outlasted group 0's wait for its heartbeat), it took group 0's state at its
    # next exchange; else it replayed its steps to the same exchange (benchmarks/churn.py, which
    # holds the restart back, heals every time: tests/test_churn.py)
    assert f"[lowcomm] {run.run_name}-replica1: resuming from step_" in out
    heals = [record for record in _records(group1) if record.get("event") == "heal"]
    for heal in heals:
        assert heal["step"] > killed_at and f"rejoined and healed from a live peer at step {heal['step']}" in out
    # a heal's bytes, on both ends (each rank of the group heals from its place in the other, and
    # a summary is its rank 0's): the outer state of DiLoCo at a boundary (global copy, outer
    # momentum, AdamW's two moments: 4 x the parameters in fp32, and AdamW's step, a 4-byte
    # tensor per parameter tensor); the model's own parameters are the global copy there
    summary0, summary1 = RunDir(group0).read_summary(), RunDir(group1).read_summary()
    tensors = len(list(build_model(run.model, "meta").parameters()))
    per_heal = 4 * 4 * summary0["parameters"] + 4 * tensors
    assert all(heal["bytes"] == per_heal for heal in heals)
    expected = per_heal * len(heals)
    assert summary0["heal_tx_MB"] * 1e6 == pytest.approx(expected, abs=1) and summary0["heal_rx_MB"] == 0
    assert summary1["heal_rx_MB"] * 1e6 == pytest.approx(expected, abs=1) and summary1["heal_tx_MB"] == 0
    # both groups end on the same global model; near the uninterrupted run's (group 1's data
    # between its last checkpoint and the heal was not averaged in)
    final = RunDir(uninterrupted.run_dir).read_summary()["final_val_loss"]
    assert summary0["final_val_loss"] == summary1["final_val_loss"]
    assert summary0["final_val_loss"] == pytest.approx(final, abs=0.1)
    assert json.loads((Path(run.run_dir) / "torchft.json").read_text())["replica_groups"] == 2
    # group 1's two ranks started twice (the launch and the rejoin), group 0's once
    assert out.count(f"[lowcomm] {run.run_name}-replica1: ") >= 2
    # each group's directory is a run directory the reports read; a heal is marked on its curves
    records = [load_run(group0), load_run(group1)]
    marked = [(step, event) for step, event in records[1].membership_changes() if event == "heal"]
    assert marked == [(heal["step"], "heal") for heal in heals]
    written = plot_loss_curves(records, tmp_path / "figures", formats=("png",))
    assert sorted(path.name for path in written) == ["loss_vs_cum_MB.png", "loss_vs_step.png"]


def test_a_membership_change_is_a_dotted_vertical_named_at_the_foot_of_the_axes():
    fig, ax = plt.subplots()
    mark_membership(ax, [30.0, 55.0], ["heal", "membership"], "C0")
    assert [line.get_xdata()[0] for line in ax.lines] == [30.0, 55.0]
    assert [text.get_text() for text in ax.texts] == ["healed", "groups changed"]
    plt.close(fig)
