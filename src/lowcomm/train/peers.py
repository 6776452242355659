"""Who the other ranks are, and which of them a failed collective lost.

A collective that fails says little about why: gloo reports "Timed out waiting 120000ms for recv
operation" or "Connection closed by peer" on every rank of the ring, whichever peer caused it,
and torchrun or SLURM then add a traceback per rank. This module turns that into one line that
names what was lost, e.g.::

    [lowcomm] lost node lctest-node1 (ranks 2, 3): no answer within 15 s
    (cluster.collective_timeout_s); the last checkpoint is step 6; rerun the same command to resume

How. At start-up every rank opens a *beacon*, a TCP socket on an ephemeral port served by a
daemon thread that answers every line it is sent with one byte, and the ranks exchange their
hostname and beacon address in one metered control all-gather (:meth:`PeerTable.gather`). When
a collective fails, each surviving rank probes every other rank's beacon at once, for at most
``PROBE_TIMEOUT_S``:

- it answers: the rank lives (it may be failing the same collective);
- the connection is refused: its host answers but its process is gone (killed, crashed);
- the connection opens but nothing comes: its process is stopped or hung (the kernel accepts
  connections for a stopped process, which cannot answer);
- no connection at all (no answer, host or network unreachable): its host is unreachable; a
  host none of whose ranks can be reached is a lost node.

A surviving rank that leaves first would look gone to a survivor that fails after it (a ring
stalls behind the first failure). So before leaving, every survivor sends a *farewell* to the
beacons that answered, and a rank that said farewell is a survivor, never a lost rank. The
lowest surviving rank of each node prints the line (once per node: each node's launcher shows
its own output); the others wait for its farewell before they exit, so that a launcher that
stops a node's workers when the first one exits (torchrun) cannot cut the line off. The lowest
surviving rank of all leads what follows (under SLURM: the requeue).

A stopped rank can wake up (SLURM's requeue sends SIGCONT before it kills the job): its
collectives then fail against survivors that have left, and it would take them for lost and act
(requeue the job again, or cancel it). So the survivors leave a line in every stopped rank's
beacon queue saying it was given up; woken, it reads that before anything else and leaves quietly.

A failure that no probe explains (every rank answers) is not a lost peer: it is raised as it was,
and so is any error that is not a collective's (:func:`is_collective_failure`): every rank raising
the same error (a bad checkpoint) must not blame the first one to leave.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowcomm.comm import Communicator
from lowcomm.distenv import rendezvous_address

# The exit status of a rank that stopped because it lost peers: EX_TEMPFAIL of sysexits.h, "a
# temporary failure; the user is invited to retry", which is what rerunning the command does.
EXIT_PEERS_LOST = 75

# A live beacon answers in well under a millisecond; an unreachable host costs this long.
PROBE_TIMEOUT_S = 2.0
# How long a survivor that does not print waits for its node's printing rank to say farewell.
REPORT_WAIT_S = PROBE_TIMEOUT_S + 2.0

ANSWERS, GONE, SILENT, UNREACHABLE = "answers", "gone", "silent", "unreachable"
_ALIVE_BYTE = b"A"
# One rank's entry in the start-up all-gather, padded to a fixed size (a hostname is at most 253).
_ENTRY_BYTES = 512


@dataclass(frozen=True)
class Peer:
    rank: int
    hostname: str
    address: str  # where its beacon listens
    port: int


class Beacon:
    """A listening socket served by a daemon thread, one connection after another (so a
    connection is handled after every one that reached the queue before it). Each brings one
    JSON line, answered with one byte: ``{"probe": r}``; ``{"farewell": r}`` (rank r leaves as a
    survivor, recorded in :attr:`farewells`); ``{"lost_by": r}`` (rank r gave this one up as
    lost; it was stopped: it must not act once it wakes, recorded in :attr:`lost_by`)."""

    def __init__(self) -> None:
        if socket.has_dualstack_ipv6():
            self.socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=256)
        else:
            self.socket = socket.create_server(("", 0), backlog=256)
        self.port = self.socket.getsockname()[1]
        self.farewells: set[int] = set()
        self.lost_by: set[int] = set()
        self.arrived = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="lowcomm-beacon", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:  # closed
                return
            with connection:
                try:
                    connection.settimeout(1.0)
                    message = _read_line(connection)
                    self._record(message)
                    connection.sendall(_ALIVE_BYTE)
                except OSError:
                    continue

    def _record(self, message: bytes) -> None:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            entry = json.loads(message)
            with self.arrived:
                if "farewell" in entry:
                    self.farewells.add(int(entry["farewell"]))
                if "lost_by" in entry:
                    self.lost_by.add(int(entry["lost_by"]))
                self.arrived.notify_all()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept (close alone does not)
        self.socket.close()


def _read_line(connection: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < 256:
        chunk = connection.recv(256)
        if not chunk:
            break
        data += chunk
    return data


def probe(address: str, port: int, timeout_s: float = PROBE_TIMEOUT_S, message: dict | None = None) -> str:
    """One beacon's state: :data:`ANSWERS`, :data:`GONE`, :data:`SILENT` or :data:`UNREACHABLE`;
    ``message`` is what to tell it (default: a plain probe)."""
    try:
        connection = socket.create_connection((address, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return GONE
    except OSError:  # timed out, no route to the host or network
        return UNREACHABLE
    with connection:
        try:
            connection.sendall(json.dumps(message or {"probe": True}).encode() + b"\n")
            return ANSWERS if connection.recv(1) == _ALIVE_BYTE else GONE
        except TimeoutError:
            return SILENT
        except OSError:  # reset: the process went away while we asked
            return GONE


def tell(address: str, port: int, message: dict, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Leave ``message`` in a beacon's queue without waiting for an answer: a stopped process's
    kernel still accepts the connection and keeps the line until the process reads it."""
    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=timeout_s) as connection:
        connection.sendall(json.dumps(message).encode() + b"\n")


def reachable_address() -> str:
    """The address other hosts reach this one at: the source address of the route to the
    rendezvous host (a UDP ``connect`` sends nothing; it only chooses the route). A host name
    is no use here: Debian maps its own to 127.0.1.1."""
    master = rendezvous_address()
    if master is not None:
        with contextlib.suppress(OSError):
            family, kind, _, _, sockaddr = socket.getaddrinfo(master[0], 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, kind) as udp:
                udp.connect(sockaddr)
                return udp.getsockname()[0]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # a host name that does not resolve: only ranks on this host can be probed
        return "127.0.0.1"


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and what it was raised from (DDP re-raises a failed all-reduce as its own error)."""
    for _ in range(10):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a collective that failed for want of a
    peer: torch's distributed errors and gloo's transport errors. Anything else (a bug, a bad
    checkpoint that every rank rejects) is not diagnosed: a rank that raised it and left would
    look gone to the others."""
    return any(isinstance(error, dist.DistError)
               or (isinstance(error, RuntimeError) and any(marker in str(error) for marker in _GLOO_MARKERS))
               for error in _chain(exc))


_GLOO_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def _timed_out(exc: BaseException) -> bool:
    return any("timed out" in str(error).lower() or "timeout" in str(error).lower() for error in _chain(exc))


@dataclass(frozen=True)
class Diagnosis:
    """What this rank found after a failed collective: every peer's state, and who left before."""

    rank: int
    peers: tuple[Peer, ...]
    states: dict[int, str]  # every other rank's probe result
    departed: frozenset[int]  # survivors that said farewell before this rank probed
    timed_out: bool  # the failure was a collective's timeout (else: a closed connection)
    timeout_s: int
    given_up_by: frozenset[int] = frozenset()  # survivors that found this rank lost (it was stopped)

    @property
    def hostname(self) -> str:
        return self.peers[self.rank].hostname

    @property
    def lost(self) -> list[int]:
        return sorted(rank for rank, state in self.states.items() if state != ANSWERS and rank not in self.departed)

    @property
    def survivors(self) -> list[int]:
        """Ranks that answered, this one and those that left as survivors."""
        return sorted({self.rank, *self.departed, *(r for r, s in self.states.items() if s == ANSWERS)})

    @property
    def reports(self) -> bool:
        """Whether this rank prints the line: the lowest survivor on its node."""
        return not self.given_up_by and self.rank == min(
            r for r in self.survivors if self.peers[r].hostname == self.hostname)

    @property
    def leads(self) -> bool:
        """Whether this rank acts for all survivors (a requeue): the lowest survivor of all."""
        return not self.given_up_by and self.rank == self.survivors[0]

    def summary(self) -> str:
        """``lost node lctest-node1 (ranks 2, 3): no answer within 15 s (cluster.collective_timeout_s)``."""
        if self.given_up_by:
            return f"rank {self.rank} was given up as lost by {_ranks(sorted(self.given_up_by))} while it did not answer"
        waited = f"no answer within {self.timeout_s} s (cluster.collective_timeout_s)"
        parts = []
        by_host: dict[str, list[int]] = {}
        for rank in self.lost:
            by_host.setdefault(self.peers[rank].hostname, []).append(rank)
        for host, ranks in by_host.items():
            on_host = [peer.rank for peer in self.peers if peer.hostname == host]
            states = {self.states[rank] for rank in ranks}
            if ranks == on_host and states == {UNREACHABLE}:
                parts.append(f"node {host} ({_ranks(ranks)}): " + (waited if self.timed_out else "unreachable"))
                continue
            for state in (GONE, SILENT, UNREACHABLE):
                these = [rank for rank in ranks if self.states[rank] == state]
                if not these:
                    continue
                why = {GONE: "its process is gone" if len(these) == 1 else "their processes are gone",
                       SILENT: "stopped or hung, " + (waited if self.timed_out else "no answer"),
                       UNREACHABLE: "unreachable"}[state]
                parts.append(f"{_ranks(these)} on {host}: {why}")
        return "lost " + "; and ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class PeersLost(RuntimeError):
    """A collective failed because peers are gone (:attr:`diagnosis` says which). Raised from
    the collective's own error on every surviving rank; :meth:`line` is what to print (where
    :attr:`Diagnosis.reports`), then :meth:`leave`, then exit with :data:`EXIT_PEERS_LOST`."""

    def __init__(self, diagnosis: Diagnosis, table: PeerTable, checkpoint_step: int | None):
        self.diagnosis, self.table, self.checkpoint_step = diagnosis, table, checkpoint_step
        super().__init__(diagnosis.summary())

    @property
    def reports(self) -> bool:
        return self.diagnosis.reports

    @property
    def leads(self) -> bool:
        return self.diagnosis.leads

    def line(self, next_step: str = "rerun the same command to resume") -> str:
        where = (f"the last checkpoint is step {self.checkpoint_step}" if self.checkpoint_step is not None
                 else "no checkpoint was written yet (a rerun starts from step 0)")
        return f"[lowcomm] {self.diagnosis.summary()}; {where}; {next_step}"

    def leave(self) -> None:
        """Say farewell to every survivor; a rank that does not print then waits (at most
        ``REPORT_WAIT_S``) for its node's printing rank to say farewell first."""
        self.table.leave(self.diagnosis)


class PeerTable:
    """Every rank's hostname and beacon (:meth:`gather`, collective), and the diagnosis of a
    failed collective (:meth:`diagnose`, local: it only probes)."""

    def __init__(self, rank: int, peers: tuple[Peer, ...], beacon: Beacon | None, timeout_s: int):
        self.rank, self.peers, self.beacon, self.timeout_s = rank, peers, beacon, timeout_s

    @classmethod
    def gather(cls, comm: Communicator, timeout_s: int) -> PeerTable:
        """Open this rank's beacon and learn everyone's, in one control all-gather. Every rank of
        ``comm`` calls it. Alone (one rank), nothing is opened."""
        hostname = socket.gethostname()
        if not comm.distributed:
            return cls(comm.rank, (Peer(comm.rank, hostname, "", 0),), None, timeout_s)
        beacon = Beacon()
        entry = json.dumps([hostname, reachable_address(), beacon.port]).encode()
        if len(entry) > _ENTRY_BYTES:
            raise ValueError(f"host name too long for the peer table: {hostname!r}")
        padded = torch.zeros(_ENTRY_BYTES, dtype=torch.uint8, device=comm.control_device)
        padded[: len(entry)] = torch.frombuffer(bytearray(entry), dtype=torch.uint8)
        gathered = comm.all_gather(padded, purpose="control")
        peers = []
        for rank, tensor in enumerate(gathered):
            host, address, port = json.loads(bytes(tensor.cpu().tolist()).rstrip(b"\0"))
            peers.append(Peer(rank, host, address, int(port)))
        return cls(comm.rank, tuple(peers), beacon, timeout_s)

    def diagnose(self, exc: BaseException) -> Diagnosis | None:
        """After ``exc``: probe every other rank; None when it is not a collective's failure or
        when no rank is lost (``exc`` is then the failure to report). A rank that others gave up
        as lost while it was stopped learns it here, and its diagnosis says so
        (:attr:`Diagnosis.given_up_by`): it must neither print nor act."""
        if self.beacon is None or not is_collective_failure(exc):
            return None
        me = self.peers[self.rank]
        # to this rank's own beacon, last in its queue: every line that reached it before is read
        probe(me.address, me.port)
        with self.beacon.arrived:
            given_up_by = frozenset(self.beacon.lost_by)
        others = [peer for peer in self.peers if peer.rank != self.rank]
        states = {} if given_up_by else self._probe_all(others, {"probe": self.rank})
        with self.beacon.arrived:
            departed = frozenset(self.beacon.farewells)
        diagnosis = Diagnosis(self.rank, self.peers, states, departed, _timed_out(exc), self.timeout_s, given_up_by)
        if given_up_by:
            return diagnosis
        # a stopped rank may wake (SLURM's requeue sends SIGCONT before it kills): tell it first
        self._run_all([self.peers[r] for r in diagnosis.lost if states[r] == SILENT],
                      lambda peer: tell(peer.address, peer.port, {"lost_by": self.rank}))
        return diagnosis if diagnosis.lost else None

    @staticmethod
    def _run_all(peers: list[Peer], call) -> list:
        if not peers:
            return []
        with ThreadPoolExecutor(max_workers=min(len(peers), 128)) as pool:
            return list(pool.map(call, peers))

    def _probe_all(self, peers: list[Peer], message: dict) -> dict[int, str]:
        states = self._run_all(peers, lambda peer: probe(peer.address, peer.port, message=message))
        return {peer.rank: state for peer, state in zip(peers, states, strict=True)}

    def leave(self, diagnosis: Diagnosis) -> None:
        if self.beacon is None or diagnosis.given_up_by:
            return
        alive = [self.peers[rank] for rank, state in diagnosis.states.items() if state == ANSWERS]
        self._probe_all(alive, {"farewell": self.rank})
        if diagnosis.reports:
            return
        printer = min(r for r in diagnosis.survivors if self.peers[r].hostname == diagnosis.hostname)
        deadline = time.monotonic() + REPORT_WAIT_S
        with self.beacon.arrived:
            while printer not in self.beacon.farewells and time.monotonic() < deadline:
                self.beacon.arrived.wait(timeout=max(0.0, deadline - time.monotonic()))

    @contextlib.contextmanager
    def watch(self, checkpoint_step) -> Iterator[None]:
        """Turn a collective's failure inside the block into :class:`PeersLost` where peers are
        lost; ``checkpoint_step()`` gives the newest checkpoint's step (None: none) for the line."""
        try:
            yield
        except Exception as exc:
            diagnosis = self.diagnose(exc)
            if diagnosis is None:
                raise
            raise PeersLost(diagnosis, self, checkpoint_step()) from exc

    def close(self) -> None:
        if self.beacon is not None:
            self.beacon.close()
