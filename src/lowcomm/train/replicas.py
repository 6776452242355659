"""A worker's replica group, in a run that survives lost workers
(``cluster.fault_tolerance=torchft``; the exchange itself: :mod:`lowcomm.comm.ft`).

Under it nothing is world-wide but the method's exchange. Each group (``cluster.ranks_per_group``
ranks: the local launcher's workers numbered across groups, or a torchrun of its own per group,
:func:`group_place`) trains its own shard of every step's batch, validates, checkpoints and
agrees on a stop by itself, so that a group's death stops no other. Its records go to its own run
directory: group 0's is the run's (``<run_dir>``: what the reports read), group g's
``<run_dir>/replicas/<g>``. A group that comes back behind its peers is given a live peer's
state at its next exchange (a heal): the loop then continues from the peer's step.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

from lowcomm.comm import Communicator
from lowcomm.comm.ft import FT_RECORD, LIGHTHOUSE_ENV, ReplicaGroups
from lowcomm.config import ConfigError, RunConfig
from lowcomm.distenv import DistEnv, rendezvous_address
from lowcomm.rundir import RunDir
from lowcomm.strategies import Strategy

# A checkpoint's or a heal's record of the loop's step (the steps a group has done)
HEALED_STEP = "step"


def replica_run_dir(run_dir: str | Path, replica: int) -> Path:
    """Where replica group ``replica`` keeps its records: the run's directory for group 0."""
    run_dir = Path(run_dir)
    return run_dir if replica == 0 else run_dir / "replicas" / str(replica)


def own_run_dir(run_dir: str | Path, replica: int) -> Path:
    """:func:`replica_run_dir`, made with the run's ``config.yaml`` in it: a run directory of its
    own, which the reports can read as one."""
    path = replica_run_dir(run_dir, replica)
    if replica:
        path.mkdir(parents=True, exist_ok=True)
        config, copy = RunDir(run_dir).config, RunDir(path).config
        shutil.copyfile(config, copy.with_suffix(".tmp"))
        os.replace(copy.with_suffix(".tmp"), copy)
    return path


# Under torchrun each replica group is one torchrun (``--standalone``, its own rendezvous and
# restarts), under SLURM a job of its own (a node; :mod:`lowcomm.launch.slurm` sets it), and this
# says which group it is (torchft's REPLICA_GROUP_ID); the local launcher's workers are numbered
# across groups instead.
REPLICA_GROUP_ENV = "LOWCOMM_REPLICA_GROUP"


def group_env(env: DistEnv, ranks_per_group: int) -> DistEnv:
    """A worker's place in its replica group: ranks ``g * R ... g * R + R - 1`` of the launch
    (``env``) are group g's ranks 0 ... R - 1."""
    return DistEnv(rank=env.rank % ranks_per_group, world_size=ranks_per_group, local_rank=env.local_rank,
                   local_world_size=min(env.local_world_size, ranks_per_group))


def group_place(run: RunConfig, env: DistEnv) -> tuple[int, DistEnv]:
    """(this worker's replica group, its environment within the group). Under torchrun or SLURM
    (``$LOWCOMM_REPLICA_GROUP``) the launch's world is the group; under the local launcher rank r
    of the launch is rank r mod R of group r // R. A layout that does not fit the config is a
    ConfigError naming both."""
    cluster = run.cluster
    ranks, groups = cluster.ranks_per_group, cluster.replica_groups
    given = os.environ.get(REPLICA_GROUP_ENV)
    if given is None:
        return env.rank // ranks, group_env(env, ranks)
    if not given.isdigit() or int(given) >= groups:
        raise ConfigError([f"${REPLICA_GROUP_ENV}={given!r} is not a replica group of this run (0 ... {groups - 1}: "
                           f"{cluster.describe_replica_groups()})"])
    if env.world_size != ranks:
        raise ConfigError([f"each replica group started apart (a torchrun, a SLURM job) has cluster.ranks_per_group "
                           f"({ranks}) ranks, but this one has {env.world_size} (torchrun: --nproc-per-node on one "
                           "node, --standalone)"])
    return int(given), env


def locked_dir(run: RunConfig) -> Path:
    """The directory a launch of this process holds (its lock): the run's, or under torchrun its
    replica group's (each group is a torchrun of its own, started and restarted apart)."""
    given = os.environ.get(REPLICA_GROUP_ENV, "")
    if run.cluster.fault_tolerance != "torchft" or not given.isdigit():
        return Path(run.run_dir)
    path = replica_run_dir(run.run_dir, int(given))
    path.mkdir(parents=True, exist_ok=True)
    return path


def lighthouse_address(run_dir: Path, wait_s: float = 0.0) -> str:
    """The job's lighthouse: the launcher's ``$LOWCOMM_TORCHFT_LIGHTHOUSE``, else the run's record
    (``torchft.json``, written by the launcher, ``lowcomm-lighthouse --record`` or the SLURM
    lighthouse job), waited for at most ``wait_s`` (a group's job may start before the
    lighthouse's)."""
    if address := os.environ.get(LIGHTHOUSE_ENV):
        return address
    record = Path(run_dir) / FT_RECORD
    deadline, said = time.monotonic() + wait_s, False
    while not record.is_file() and time.monotonic() < deadline:
        if not said:
            print(f"[lowcomm] waiting for the lighthouse's address in {record} (at most {wait_s:.0f} s)", flush=True)
            said = True
        time.sleep(LIGHTHOUSE_POLL_S)
    if record.is_file():
        return str(json.loads(record.read_text())["lighthouse"])
    raise RuntimeError(f"cluster.fault_tolerance=torchft but no lighthouse: neither ${LIGHTHOUSE_ENV} nor {record} "
                       f"{f'after {wait_s:.0f} s ' if wait_s else ''}(the local launcher starts one per job, and a "
                       "SLURM submission a lighthouse job; under torchrun start `lowcomm-lighthouse --record "
                       "RUN_DIR` first)")


# How often a group waiting for the lighthouse's record looks for it
LIGHTHOUSE_POLL_S = 1.0


class ReplicaGroup:
    """This worker's replica group: its index, its run directory and its exchange with the
    other groups (:class:`~lowcomm.comm.ft.ReplicaGroups`), and the state a heal moves.
    ``members``: the Communicator of the group's own ranks (``cluster.ranks_per_group``:
    :func:`group_place`), whose process group meets at the store its launcher made for the group
    (``MASTER_ADDR``/``MASTER_PORT``: the local launcher's, or the group's torchrun's)."""

    def __init__(self, run: RunConfig, replica: int, members: Communicator, device: torch.device):
        # under SLURM a group's job starts once the lighthouse job has (--dependency=after), and
        # waits for its record; elsewhere the lighthouse is started first
        wait_s = run.cluster.collective_timeout_s if run.cluster.launcher == "slurm" else 0.0
        lighthouse = lighthouse_address(run.run_dir, wait_s=wait_s)
        self.replica, self.replicas = replica, run.cluster.replica_groups
        self.lighthouse = lighthouse
        self.members = members
        self.shared_dir = Path(run.run_dir)  # the run's, where the groups of a launch meet
        self.run_dir = own_run_dir(run.run_dir, self.replica) if members.rank == 0 else \
            replica_run_dir(run.run_dir, self.replica)
        timeout = datetime.timedelta(seconds=run.cluster.collective_timeout_s)
        self.exchange = ReplicaGroups(self.replica, self.replicas, lighthouse=lighthouse,
                                      min_replicas=run.cluster.min_replicas, meter=members.meter, device=device,
                                      timeout=timeout, quorum_timeout=timeout, run_id=run.run_name,
                                      members=members, store=rendezvous_address() if members.world_size > 1 else None)
        self._healed_to: int | None = None

    def serve(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy) -> None:
        """The state a peer behind this group is sent: the optimizer's, the loop's step, and the
        model's parameters where the strategy says (:meth:`~lowcomm.strategies.Strategy.heal_sends_model`:
        not where the optimizer restores them from its own global copy, the DiLoCo family at an
        outer step, nor where its state holds them: Streaming DiLoCo's); and what of a peer's
        state this group does not keep (:meth:`~lowcomm.strategies.Strategy.after_heal`)."""

        def save() -> dict:
            sent = {key: value for key, value in optimizer.state_dict().items() if key not in strategy.heal_leaves_out}
            state = {HEALED_STEP: self.stepping, "optimizer": sent}
            if strategy.heal_sends_model(self.stepping):
                state["model"] = model.state_dict()
            return state

        def load(state: dict) -> None:
            if "model" in state:
                model.load_state_dict(state["model"])
            own = optimizer.state_dict()
            optimizer.load_state_dict({**state["optimizer"], **{key: own[key] for key in strategy.heal_leaves_out}})
            strategy.after_heal(optimizer)
            self._healed_to = int(state[HEALED_STEP])

        self.exchange.serve_state(save, load)

    def join(self, timeout_s: float) -> None:
        """Ready to train: become a member the lighthouse waits for, then wait (at most
        ``timeout_s``) until every group of this launch is one too. Without the wait a group that
        starts seconds later than the others (imports on shared cores) would find their first
        exchanges made without it, and heal at once; once all are members, a quorum waits for
        each. The groups meet by files under the run directory, per launch (its lighthouse); a
        group started again in the same launch finds them all."""
        self.exchange.join()
        launch = re.sub(r"[^A-Za-z0-9]+", "_", self.lighthouse).strip("_")
        here = self.shared_dir / "replicas" / ".ready" / launch
        here.mkdir(parents=True, exist_ok=True)
        (here / f"{self.replica}.{self.members.rank}").touch()
        deadline = time.monotonic() + timeout_s
        while len(list(here.iterdir())) < self.replicas * self.members.world_size and time.monotonic() < deadline:
            time.sleep(0.05)

    @property
    def stepping(self) -> int:
        """The steps done once the step in progress ends: what a heal sends, and what a quorum
        compares (the loop sets it before each step)."""
        return self.exchange.progress

    @stepping.setter
    def stepping(self, steps: int) -> None:
        self.exchange.progress = steps

    def take_heal(self) -> int | None:
        """The step this group continues from after a heal in the step just ended, else None."""
        healed, self._healed_to = self._healed_to, None
        return healed

    def take_events(self) -> list[dict]:
        return self.exchange.take_events()

    def close(self) -> None:
        self.exchange.shutdown()
