"""Replica groups that leave and rejoin a run: the methods' exchange across groups through a
torchft ``Manager`` (``cluster.fault_tolerance=torchft``).

Each replica group (one rank or several: a node's) trains on its own and meets the others only at its
method's exchange. There, :meth:`ReplicaGroups.begin_exchange` asks the job's lighthouse for a
quorum: the groups alive at that moment. A group that has died is simply not in it (the
lighthouse stops hearing its heartbeat) and the others average over who is there; a group that
comes back joins the next quorum, and when it is behind, it *heals*: a live peer sends it its
state (torchft's checkpoint transport), and it contributes nothing to that one exchange but
applies its result, so that it leaves the exchange where its peers do. An exchange a group lost
midway (a peer died inside it) is not committed by anyone (:meth:`commit`), and each group
goes on from the state before it.

Every byte goes through the meter: the exchange as the ring all-reduce (or all-gather) gloo runs
over the live groups, a flag per group saying which contribute as control traffic, and a heal as
its own kind (purpose ``heal``: the state's tensor bytes, sent by the peer and received by the
healed group, outside the paper's MB/step column).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from lowcomm.comm.communicator import Communicator, DoneWork, nbytes
from lowcomm.comm.meter import CommMeter, ring_all_gather_traffic, ring_all_reduce_traffic
from lowcomm.rundir import write_json_atomic

# The launcher puts the job's lighthouse address here for its workers (the run's record has it too).
LIGHTHOUSE_ENV = "LOWCOMM_TORCHFT_LIGHTHOUSE"
# The run's record of its replica groups: the lighthouse and the settings it serves with.
FT_RECORD = "torchft.json"
HEAL = "heal"


def quiet_torchft() -> None:
    """torchft tells every quorum, commit and reconfiguration (its Rust side on stderr, at INFO
    unless ``RUST_LOG`` says otherwise); lowcomm's own lines and events say what changed. Before
    torchft's Rust part is loaded; a ``RUST_LOG`` of the user's own is kept."""
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)


def start_lighthouse(min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float):
    """The job's torchft lighthouse, serving on a port of the kernel's choosing (its ``address()``).
    ``join_timeout_s``: how long a first quorum (or one after a loss) waits for groups beyond
    ``min_replicas``; ``heartbeat_timeout_s``: how long a silent group stays a member."""
    quiet_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=int(join_timeout_s * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def lighthouse_url(host: str, address: str) -> str:
    """The address of a lighthouse serving at ``address`` (``http://[::]:port``: every interface)
    as groups on other hosts reach it: by ``host``'s name."""
    return f"http://{host}:{address.rsplit(':', 1)[1]}"


def record_lighthouse(run_dir: str | Path, address: str, **settings) -> Path:
    """Write the run's ``torchft.json``: the lighthouse's ``address`` and ``settings``; where a
    worker finds the lighthouse when no launcher of its own told it (torchrun)."""
    path = Path(run_dir) / FT_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"lighthouse": address, **settings})
    return path


def state_bytes(state: Any) -> int:
    """The tensor bytes of a (nested) state dict: what a heal moves, besides pickling's framing."""
    if isinstance(state, torch.Tensor):
        return nbytes(state)
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def metered_transport(meter: CommMeter, timeout: datetime.timedelta):
    """torchft's HTTP checkpoint transport with the heal's bytes in ``meter``: the sending peer
    counts the state once per group it serves, the healed group what it received."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class MeteredTransport(HTTPTransport):
        def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
            served = state_bytes(state_dict)
            meter.record(HEAL, served, served * len(dst_ranks), 0, messages=len(dst_ranks), purpose=HEAL)
            return super().send_checkpoint(dst_ranks, step, state_dict, timeout)

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            meter.record(HEAL, 0, 0, state_bytes(state), purpose=HEAL)
            return state

    return MeteredTransport(timeout=timeout, num_chunks=0)


def _refused(collective: str):
    def refused(self, *args, **kwargs):  # noqa: ARG001 - any collective's signature
        raise NotImplementedError(f"{collective} between replica groups (cluster.fault_tolerance=torchft): only the "
                                  "all-reduce and the all-gather into one tensor run there")
    return refused


class _Averaged:
    """An exchange's work whose result is divided by the contributors once it is in."""

    def __init__(self, work, tensor: torch.Tensor, contributors: int):
        self._work, self._tensor, self._contributors = work, tensor, contributors

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as dist.Work
        self._work.wait()
        self._tensor.div_(max(self._contributors, 1))
        return True


class ReplicaGroups(Communicator):
    """The exchange between replica groups, metered, through a torchft ``Manager``.

    ``world_size`` is the number of groups in the current quorum (``replicas`` when all are
    alive), ``rank`` this group's index. Two collectives are offered, over gloo on the CPU,
    between :meth:`begin_exchange` and :meth:`commit`: an averaging (or summing) all-reduce (the
    DiLoCo family's outer step, the DDP methods' gradients) and, between groups of one rank, an
    all-gather into one tensor (SparseLoCo's sparse payloads); any other raises, naming itself.

    A group of several ranks (a node's: ``members``, the Communicator of its own process group)
    exchanges as torchft's HSDP does: each rank all-reduces with the rank of the same place in
    every other live group (a Manager per rank; the group's rank 0 meets the lighthouse, the
    others learn the quorum through the group's ``store``), then within its group, so that every
    rank holds the sum over all contributing ranks.

    Args:
        replica / replicas: this group's index, and the number of groups the run has.
        lighthouse: the job's lighthouse address (``host:port``).
        min_replicas: the fewest groups an exchange commits with.
        meter: where bytes go (the training loop's).
        timeout: a collective's or a heal's wait; ``quorum_timeout``: a quorum's.
        members: this group's own ranks (None: a group of one rank).
        store: ``(host, port)`` of a TCP store the group's ranks share (with ``members``).
    """

    replica_groups = True

    def __init__(self, replica: int, replicas: int, *, lighthouse: str, min_replicas: int, meter: CommMeter,
                 device: torch.device | str = "cpu", timeout: datetime.timedelta = datetime.timedelta(seconds=60),
                 quorum_timeout: datetime.timedelta = datetime.timedelta(seconds=300), run_id: str = "lowcomm",
                 members: Communicator | None = None, store: tuple[str, int] | None = None):
        quiet_torchft()
        if torch.device(device).type != "cpu":
            raise RuntimeError(f"replica groups exchange over gloo on the CPU; this worker's device is {device} "
                               "(set cluster.device=cpu with cluster.fault_tolerance=torchft)")
        super().__init__(meter=meter, device=device, timeout=timeout)  # no group: the Manager's is the one
        if members is not None and members.world_size > 1 and store is None:
            raise ValueError("a replica group of several ranks needs the TCP store they share (store=)")
        self.members = members if members is not None and members.world_size > 1 else None
        self._group_store = store
        self.served = self.control_served = {"cpu": "gloo"}
        self.rank = self.global_rank = replica
        self.replicas = self.world_size = replicas
        self.contributors = replicas
        self.contributing = True  # False in the exchange right after a heal: this group sends zeros
        self._contributed: list[bool] | None = None  # per participant of the quorum (None: all)
        self._behind = 0  # steps the next quorum is told less than the loop's (fall_behind)
        self.events: list[dict] = []
        self.healed_state: dict | None = None  # what the last heal loaded, until the loop takes it
        self._save: Callable[[], dict] | None = None
        self._load: Callable[[dict], None] | None = None
        self._members: int | None = None
        # this group's progress (the loop's steps done when the exchange ends): what a quorum
        # compares, so that a group with fewer steps behind it heals from one with the most
        self.progress = 0
        self._manager_args = dict(min_replica_size=min_replicas, timeout=timeout, quorum_timeout=quorum_timeout,
                                  lighthouse_addr=lighthouse, replica_id=f"{run_id}_replica{replica}")
        self._manager = None

    def join(self) -> None:
        """Become a member the lighthouse waits for (torchft's Manager starts its heartbeat): once
        this group is ready to train, so that a group restarting (importing, loading its
        checkpoint) holds up no quorum of the others meanwhile, and groups starting together meet
        at their first exchange (a quorum waits ``join_timeout_s`` for the members it knows)."""
        _ = self.manager

    @property
    def manager(self):
        """The group's torchft Manager, made when it joins (:meth:`join`; at the latest, its
        first exchange)."""
        if self._manager is None:
            from torch.distributed import TCPStore
            from torchft.manager import Manager
            from torchft.process_group import ProcessGroupGloo

            args, timeout = self._manager_args, self._manager_args["timeout"]
            host = socket.gethostname()
            if self.members is None:
                # a group of one rank: a store of its own, by its host's name (the groups of a
                # quorum meet at its primary's store)
                self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
                store_addr, store_port, rank, world = host, self._store.port, 0, 1
            else:  # the ranks of a group share theirs; its rank 0's Manager meets the lighthouse
                (store_addr, store_port), rank, world = self._group_store, self.members.rank, self.members.world_size
            self._pg = ProcessGroupGloo(timeout=timeout)  # the quorum's, reconfigured by the Manager
            self._manager = Manager(
                pg=self._pg, load_state_dict=self._load_state, state_dict=self._state,
                use_async_quorum=False, connect_timeout=timeout, rank=rank, world_size=world, store_addr=store_addr,
                store_port=store_port, hostname=host, checkpoint_transport=metered_transport(self.meter, timeout),
                init_sync=False, **args)
        return self._manager

    def __repr__(self) -> str:
        return f"ReplicaGroups(replica={self.rank}, live={self.world_size}/{self.replicas})"

    # ------------------------------------------------------------------ state a heal moves
    def serve_state(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """What a peer behind this group is sent (``save()``), and how this group takes a peer's
        (``load(state)``, in the training thread, inside :meth:`begin_exchange`)."""
        self._save, self._load = save, load

    def _state(self) -> dict:
        if self._save is None:
            raise RuntimeError("a peer asked for this group's state before the run set it (serve_state)")
        return self._save()

    def _load_state(self, state: dict) -> None:
        if self._load is None:
            raise RuntimeError("this group was sent a peer's state before the run could take it (serve_state)")
        self._load(state)
        self.healed_state = state

    # ------------------------------------------------------------------ one exchange
    def begin_exchange(self) -> None:
        """Join the quorum of the groups alive now (healing from a live peer when this group is
        behind), then count the groups that contribute: all but a group that has just healed."""
        healed_before = self.healed_state
        # torchft's step is its count of commits; a dropped exchange would leave it behind the
        # steps a group has trained, so the quorum is given the steps themselves
        self.manager.load_state_dict({"step": self.progress - self._behind, "batches_committed": 0})
        self._behind = 0
        self.manager.start_quorum()
        healed = self.healed_state is not healed_before
        self.world_size = self.manager.num_participants()
        # which participants contribute: a one-hot flag each, summed (an all-gather's rows are theirs)
        flags = torch.zeros(max(self.world_size, 1))
        flags[self.manager.participating_rank() or 0] = 0.0 if healed else 1.0
        self._record("all_reduce", nbytes(flags), ring_all_reduce_traffic(nbytes(flags), self.world_size), "control")
        self._issue(flags, "sum").wait()
        self._contributed = [bool(round(float(flag))) for flag in flags]
        self.contributors = sum(self._contributed)
        self.contributing = not healed
        if self._members is not None and self.world_size != self._members:
            self.events.append({"event": "membership", "groups": self.world_size, "was": self._members})
        if healed:
            self.events.append({"event": "heal", "groups": self.world_size, "bytes": state_bytes(self.healed_state)})
        self._members = self.world_size

    def commit(self) -> bool:
        """Whether every group in the quorum finished this exchange (none died inside it): only
        then is its result applied, by all of them alike."""
        committed = self.manager.should_commit()
        if not committed:
            self.events.append({"event": "exchange_dropped", "groups": self.world_size})
        return committed

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    @property
    def averaged_over(self) -> int:
        # (at least one: where the flags' own all-reduce failed, the exchange is dropped anyway)
        return max(1, self.contributors) * (self.members.world_size if self.members is not None else 1)

    def fall_behind(self) -> None:
        """At the next quorum, count one step fewer than the loop has done: a group whose state
        left an exchange its peers applied (one in flight when it checkpointed, dropped on
        resume) heals from a peer there, rather than going on apart from them. Where every group
        did the same (a whole job resumed), no one is ahead and no one heals."""
        self._behind = 1

    # ------------------------------------------------------------------ collectives
    def _issue(self, tensor: torch.Tensor, op: str):
        from torch.distributed import ReduceOp

        return self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM if op in ("sum", "avg") else _unsupported(op))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False, purpose: str = "data"):
        """Sum over the live groups' ranks; ``op="avg"`` divides by the ranks that contributed
        (the contributing groups' ranks)."""
        self._route("all_reduce", purpose, tensor)
        if not self.contributing and purpose == "data":
            tensor.zero_()  # what this group computed before its heal belongs to no one's step
        payload = nbytes(tensor)
        self._record("all_reduce", payload, ring_all_reduce_traffic(payload, self.world_size), purpose)
        ranks = self.members.world_size if self.members is not None else 1
        if self.world_size <= 1:
            work = DoneWork([tensor])
        else:
            work = self._issue(tensor, op)
        if self.members is not None:
            # then within the group: the same payload again, so only its ring's wire bytes count
            work.wait()
            self._record("all_reduce", 0, ring_all_reduce_traffic(payload, ranks), purpose)
            torch.distributed.all_reduce(tensor, group=self.members.group)
            work = DoneWork([tensor])
        if op == "avg":
            work = _Averaged(work, tensor, self.averaged_over)
        if async_op:
            return work
        work.wait()
        return None

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False,
                               purpose: str = "data"):
        """All-gather into ``output`` (a row per live group, in the quorum's order), over groups
        of one rank (:attr:`lowcomm.strategies.Strategy.replica_groups_of_one_rank`). A group
        that has just healed sends zeros; :meth:`contributions` leaves its row out."""
        if self.members is not None:
            raise NotImplementedError("an all-gather between replica groups of several ranks (cluster.ranks_per_group "
                                      "> 1) is not built")
        self._route("all_gather", purpose, output, tensor)
        if not self.contributing and purpose == "data":
            tensor = torch.zeros_like(tensor)
        payload = nbytes(tensor)
        self._record("all_gather", payload, ring_all_gather_traffic(payload, self.world_size), purpose)
        if self.world_size <= 1:
            output.view(-1).copy_(tensor.reshape(-1))
        elif not self.manager.errored():  # (after an error this exchange is dropped: no collective)
            rows = list(output.view(self.world_size, -1).unbind(0))
            try:  # an error (a group lost inside it) is the Manager's to report: the exchange is dropped
                work = self._pg.allgather([rows], [tensor.reshape(-1).contiguous()], AllgatherOptions())
                self.manager.wrap_future(work.get_future(), rows).wait()
            except Exception as exc:  # noqa: BLE001 - any failure of the collective drops the exchange
                self.manager.report_error(exc)
        if self.world_size > 1 and self.manager.errored():
            output.zero_()  # what a failed gather left is no one's: decoded as nothing, then not committed
        work = DoneWork([output])
        return work if async_op else None

    def contributions(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of an all-gather (``rows[i]``: participant i's) of the groups that contribute
        to this exchange: all but a group that has just healed."""
        if self._contributed is None or all(self._contributed) or rows.shape[0] <= 1:
            return rows
        if len(self._contributed) != rows.shape[0]:
            raise ValueError(f"an all-gather of {rows.shape[0]} rows in a quorum of {len(self._contributed)} groups")
        return rows[torch.tensor(self._contributed, device=rows.device)]

    # the methods that run this way need none of these (Strategy.replica_groups_refusal)
    all_gather = _refused("all_gather")
    reduce_scatter = _refused("reduce_scatter")
    all_reduce_quantized = _refused("all_reduce_quantized")
    broadcast = _refused("broadcast")
    exchange = _refused("exchange")
    split = _refused("split")

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)


def _unsupported(op: str):
    raise NotImplementedError(f"all_reduce op {op!r} between replica groups: sum or avg")

