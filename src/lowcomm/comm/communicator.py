"""The Communicator: the only code in lowcomm that calls torch.distributed collectives.

Its methods mirror ``torch.distributed`` (``all_reduce``, ``all_gather``, ``reduce_scatter``,
``broadcast``, each with ``async_op``), :meth:`Communicator.exchange` (point-to-point: isend to
a few peers and irecv from them, NoLoCo's gossip), plus :meth:`Communicator.all_reduce_quantized` (the
mean of encoded tensors, reduced in float32 where it lands: torchft's quantized all-reduce,
built of an all-to-all and an all-gather, see :mod:`lowcomm.comm.quantized`); every call is recorded in a :class:`CommMeter`
before it is issued. Optimizers, DDP comm hooks and the training loop all talk through it, so
the meter sees every byte that crosses a process boundary.

A Communicator without an initialised process group (or over a group of one) is valid: its
collectives are local identities and record zero bytes on the wire, so an optimizer written
against it runs unchanged in a single process.

Devices. A backend serves tensors of some device types only: NCCL takes CUDA tensors and
raises ``No backend type associated with device type cpu`` for anything else. A Communicator
has a data ``device`` (where the optimizer's tensors live) and checks every data tensor against
it before the call, so a CPU tensor headed for NCCL fails with a message naming the collective
even in a CPU-only test. The harness's own bookkeeping (barriers, flags, loss totals) is built
on ``control_device``: the CPU when a CPU backend is at hand (the group's own, or a gloo
``control_group`` beside it, see :meth:`Communicator.world`), else the data device.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lowcomm.comm.meter import (
    CommMeter,
    Traffic,
    chain_broadcast_traffic,
    peer_exchange_traffic,
    reduce_scatter_traffic,
    ring_all_gather_traffic,
    ring_all_reduce_traffic,
)
from lowcomm.comm.quantized import (
    chunk_runs,
    payload_bytes,
    payload_size,
    quantized_all_reduce_traffic,
    stacked_chunks,
    stacked_from_bytes,
    unstacked,
)

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}
# Backends whose all-reduce and reduce-scatter take ReduceOp.AVG (gloo has it since torch 2.x;
# a backend not listed here gets a division and a sum instead).
_AVG_BACKENDS = {"nccl", "gloo"}


def backend_devices(group=None) -> dict[str, str]:
    """``{device type: backend name}`` that the process group serves, e.g. ``{"cuda": "nccl"}``
    for ``init_process_group("nccl")`` or ``{"cpu": "gloo", "cuda": "gloo"}`` for gloo."""
    config = dist.get_backend_config(group)
    served = {}
    for entry in config.split(","):
        device, _, backend = entry.partition(":")
        served[device.strip()] = backend.strip()
    return served


class DoneWork:
    """Stands in for a ``dist.Work`` when nothing had to be sent (a group of one)."""

    def __init__(self, result: list[torch.Tensor]):
        self._result = result

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as dist.Work
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


class _AllWork:
    """Several ``dist.Work`` handles (a batch of point-to-point sends and receives) waited for
    as one."""

    def __init__(self, works: list):
        self._works = works

    def wait(self, timeout=None) -> bool:
        done = True
        for work in self._works:  # every one, even after one reports False
            done = (work.wait() if timeout is None else work.wait(timeout)) and done
        return done

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class _TimedWork:
    """A ``dist.Work`` whose ``wait()`` tells the meter how long the collective was in flight
    before it (:meth:`CommMeter.in_flight`): the time the caller went on working while its
    traffic moved. Only ``wait`` is timed: a future's callback (DDP's comm hook) runs at the
    backend's pace, not the caller's. On a GPU the time is the host's, which queues kernels
    ahead of the device: an upper bound on the device's own overlap."""

    def __init__(self, work, meter: CommMeter):
        self._work, self._meter, self._issued = work, meter, time.perf_counter()

    def wait(self, timeout=None) -> bool:
        waited = time.perf_counter()
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._meter.in_flight(self._issued, waited, time.perf_counter())
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Communicator:
    """A metered view of one process group.

    Args:
        group: the process group; ``None`` means the default (world) group when
            torch.distributed is initialised, else a single-process communicator.
        meter: where bytes are recorded; sub-communicators share their parent's.
        scope: the label of the link this group's traffic crosses (``world``, ``intra``,
            ``inter``); it becomes the ``comm/<scope>_*`` keys when more than one is used.
        timeout: how long a collective of the groups this Communicator creates (its control
            group, :meth:`split`'s sub-groups) waits for its peers. torch's ``new_group`` does
            not inherit the default group's timeout (it takes the backend's default: 30 min on
            gloo), so it is passed explicitly; None leaves torch's default.
    """

    # a fixed world; :class:`lowcomm.comm.ft.ReplicaGroups`: groups that may leave and rejoin
    replica_groups = False

    def __init__(
        self,
        group=None,
        meter: CommMeter | None = None,
        scope: str = "world",
        *,
        device: torch.device | str | None = None,
        control_group=None,
        timeout: datetime.timedelta | None = None,
    ):
        self.group = group
        self.timeout = timeout
        self.meter = meter if meter is not None else CommMeter()
        self.scope = scope
        # None: data on any device the backend serves (an optimizer used outside the harness)
        self.device = torch.device(device) if device is not None else None
        self.control_group = control_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_rank = dist.get_rank()
            self.served = backend_devices(group)
            self.control_served = backend_devices(control_group) if control_group is not None else self.served
        else:
            if group is not None or control_group is not None:
                raise RuntimeError("a process group was given but torch.distributed is not initialised")
            self.rank, self.world_size, self.global_rank = 0, 1, 0
            # nothing is sent: any device will do
            self.served = self.control_served = {kind: "local" for kind in ("cpu", "cuda")}
        if "cpu" in self.control_served:
            self.control_device = torch.device("cpu")
        else:
            self.control_device = self.device or torch.device(next(iter(self.served)))

    @classmethod
    def world(cls, device: torch.device | str, meter: CommMeter | None = None,
              timeout: datetime.timedelta | None = None) -> Communicator:
        """The Communicator of the default group for data on ``device``. If that group has no
        CPU backend (``init_process_group("nccl")``), a gloo group beside it carries the control
        traffic, so that a barrier or a flag never needs a GPU tensor. Every rank must call it
        (creating a group is collective). ``timeout``: the default group's, given to every group
        created from here."""
        control_group = None
        if dist.is_available() and dist.is_initialized() and "cpu" not in backend_devices():
            control_group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(meter=meter, device=device, control_group=control_group, timeout=timeout)

    def __repr__(self) -> str:
        return f"Communicator(scope={self.scope!r}, rank={self.rank}, world_size={self.world_size})"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _record(self, collective: str, payload: int, traffic: Traffic, purpose: str) -> None:
        self.meter.record(collective, payload, traffic.tx, traffic.rx, messages=traffic.messages,
                          scope=self.scope, purpose=purpose)

    def _route(self, collective: str, purpose: str, *tensors: torch.Tensor):
        """The process group to issue on, after checking that the backend serves the tensors'
        device. Data must be on :attr:`device`; control traffic may also be on the CPU when a
        CPU backend carries it. Raises before anything is sent, naming the collective."""
        for tensor in tensors:
            kind = tensor.device.type
            if purpose == "data":
                if (self.device is not None and kind != self.device.type) or kind not in self.served:
                    raise RuntimeError(
                        f"{collective} ({purpose}, scope {self.scope}): tensor on {tensor.device}, but this "
                        f"Communicator's data device is {self.device} and its backends serve "
                        f"{_describe(self.served)}"
                    )
            elif kind not in self.served and kind not in self.control_served:
                raise RuntimeError(
                    f"{collective} ({purpose}, scope {self.scope}): tensor on {tensor.device}, which no backend "
                    f"of this Communicator serves (backends: {_describe(self.served)}"
                    + (f"; control: {_describe(self.control_served)})" if self.control_group is not None else ")")
                )
        if purpose != "data" and self.control_group is not None and tensors[0].device.type not in self.served:
            return self.control_group
        return self.group

    def _native_avg(self, group) -> bool:
        backend = self.control_served if group is not None and group is self.control_group else self.served
        return set(backend.values()) <= _AVG_BACKENDS

    def _timed(self, work):
        """An async collective's work, timed in flight (:class:`_TimedWork`); None (a blocking
        call) as it is."""
        return None if work is None else _TimedWork(work, self.meter)

    # ---------------------------------------------------- an exchange that may lose a peer
    def begin_exchange(self) -> None:
        """Before a method's exchange. Here the world is fixed and nothing happens; between
        replica groups that may leave and rejoin (:class:`lowcomm.comm.ft.ReplicaGroups`) it
        forms the quorum of the groups alive, and may replace this worker's state with a live
        peer's (a heal) before the exchange starts."""

    def commit(self) -> bool:
        """After the exchange, before its result is applied: whether to apply it. Always here (a
        lost peer ends the run); between replica groups, False when a group died inside it."""
        return True

    def fall_behind(self) -> None:
        """Between replica groups: heal from a live peer at the next quorum
        (:meth:`lowcomm.comm.ft.ReplicaGroups.fall_behind`); nothing here."""

    def contributions(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of an all-gather (one per rank) that count in this exchange: all here;
        between replica groups, those of the groups that contribute."""
        return rows

    @property
    def averaged_over(self) -> int:
        """The ranks an averaging exchange begun now divides by: every rank here; between replica
        groups, those of the groups that contribute to it."""
        return self.world_size

    # -------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False, purpose: str = "data"):
        """In-place all-reduce. ``op="avg"`` is the backend's AVG (no extra pass over the tensor);
        a backend without it gets a division by W before a sum."""
        group = self._route("all_reduce", purpose, tensor)
        payload = nbytes(tensor)
        self._record("all_reduce", payload, ring_all_reduce_traffic(payload, self.world_size), purpose)
        if not self.distributed:
            return DoneWork([tensor]) if async_op else None
        if op == "avg" and not self._native_avg(group):
            tensor.div_(self.world_size)
            op = "sum"
        work = dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op)
        # only the optimizer's traffic counts as hidden behind compute (perf/in_flight_s)
        return self._timed(work) if purpose == "data" else work

    def all_gather(
        self, tensor: torch.Tensor, *, async_op: bool = False, purpose: str = "data"
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], object]:
        """All-gather equal-shaped tensors; returns the W tensors (and the work if async)."""
        group = self._route("all_gather", purpose, tensor)
        payload = nbytes(tensor)
        self._record("all_gather", payload, ring_all_gather_traffic(payload, self.world_size), purpose)
        if not self.distributed:
            gathered = [tensor.clone()]
            return (gathered, DoneWork(gathered)) if async_op else gathered
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, tensor.contiguous(), group=group, async_op=async_op)
        return (gathered, self._timed(work)) if async_op else gathered

    def all_gather_into_tensor(
        self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False, purpose: str = "data"
    ):
        """All-gather into ``output`` (W x the input's numel), rank-ordered."""
        group = self._route("all_gather", purpose, output, tensor)
        payload = nbytes(tensor)
        self._record("all_gather", payload, ring_all_gather_traffic(payload, self.world_size), purpose)
        if not self.distributed:
            output.view(-1).copy_(tensor.reshape(-1))
            return DoneWork([output]) if async_op else None
        return self._timed(dist.all_gather_single(output, tensor.contiguous(), group=group, async_op=async_op))

    def reduce_scatter(
        self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
        purpose: str = "data",
    ):
        """Reduce ``tensor`` (W equal rank-ordered chunks) and leave chunk ``rank`` in ``output``.
        ``op="avg"`` is the backend's AVG; without it, a divided copy of ``tensor`` is summed.
        Metered as the backend runs it: NCCL's ring, or gloo's all-reduce of the whole input."""
        group = self._route("reduce_scatter", purpose, output, tensor)
        payload = nbytes(tensor)
        backend = self.served.get(tensor.device.type, "nccl")
        self._record("reduce_scatter", payload, reduce_scatter_traffic(payload, self.world_size, backend), purpose)
        if not self.distributed:
            output.view(-1).copy_(tensor.reshape(-1))
            return DoneWork([output]) if async_op else None
        if op == "avg" and not self._native_avg(group):
            tensor = tensor / self.world_size
            op = "sum"
        return self._timed(dist.reduce_scatter_single(
            output, tensor.contiguous(), op=_OPS[op], group=group, async_op=async_op
        ))

    def all_reduce_quantized(
        self, tensors: Sequence[torch.Tensor], codec, *, out: Sequence[torch.Tensor] | None = None,
        residual: bool = False, async_op: bool = False,
    ):
        """The mean over ranks of ``tensors``, sent encoded by ``codec``, written to ``out``
        (default: ``tensors`` themselves): every rank encodes W chunks of each tensor, an
        all-to-all brings chunk j of every rank to rank j, which decodes, sums in float32,
        divides by W and encodes the mean again, and an all-gather returns the reduced chunks
        (:mod:`lowcomm.comm.quantized`). Every rank ends with the same values: the decoded
        re-encoded mean.

        ``residual``: leave in each input what its encoding dropped (input - decode(sent)), the
        update of an error-feedback accumulator; the re-encoding of the mean is not fed back (as
        in MuLoCo's code, where error feedback sees only the worker's own quantization).
        All inputs are read before anything is written, so ``out`` may be ``tensors``. One call
        for many tensors costs one all-to-all and one all-gather. Metered as one
        ``all_reduce_quantized`` record: the payload is this rank's encoded chunks, tx / rx
        both phases (about 2 (W-1)/W x the payload each way).

        Returns None, or with ``async_op`` a work whose ``wait()`` finishes the exchange (the
        all-to-all runs in the background until then; the reduction and the all-gather run in
        ``wait``)."""
        out = list(tensors) if out is None else list(out)
        if len(out) != len(tensors):
            raise ValueError(f"all_reduce_quantized: {len(tensors)} inputs but {len(out)} outputs")
        for index, (source, target) in enumerate(zip(tensors, out, strict=True)):
            if source.shape != target.shape:
                raise ValueError(f"all_reduce_quantized: input {index} has shape {tuple(source.shape)} but its "
                                 f"output {tuple(target.shape)}")
            if residual and source is target:
                raise ValueError("all_reduce_quantized: residual=True leaves the residual in the inputs, so the "
                                 "outputs must be other tensors")
        group = self._route("all_reduce_quantized", "data", *tensors, *out)
        world = self.world_size
        # phase 1, locally: encode every chunk; sent[t][j] is tensor t's chunk j (None: empty)
        # (each run of equal-shape chunks encoded in one call: a few operations per tensor, not
        # a few per tensor and rank)
        sent = []
        for tensor in tensors:
            payloads: list = [None] * world
            for run in chunk_runs(tensor.shape, world):
                chunks = stacked_chunks(tensor.detach(), run)
                stacked = codec.encode_stacked(chunks)
                if residual:
                    chunks.sub_(codec.dequantize(stacked).to(chunks.dtype).view_as(chunks))
                for row, rank in enumerate(run[0]):
                    payloads[rank] = unstacked(stacked, row)
            sent.append(payloads)
        exchange = self._quantized_exchange(group, codec, sent, out)
        self._record("all_reduce_quantized", sum(exchange.chunk_bytes),
                     quantized_all_reduce_traffic(exchange.chunk_bytes, self.rank, world), "data")
        exchange.start()
        if async_op:
            return self._timed(exchange)
        exchange.wait()
        return None

    def _quantized_exchange(self, group, codec, sent: list[list], out: list[torch.Tensor]) -> QuantizedExchange:
        """The exchange :meth:`all_reduce_quantized` runs (a subclass may move its bytes
        another way: benchmarks/senders.py's simulated senders)."""
        return QuantizedExchange(self, group, codec, sent, out)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False, purpose: str = "data"):
        """Broadcast from group rank ``src``; the payload is the source's message."""
        group = self._route("broadcast", purpose, tensor)
        size = nbytes(tensor)
        payload = size if self.rank == src else 0
        self._record("broadcast", payload, chain_broadcast_traffic(size, self.world_size, self.rank, src), purpose)
        if not self.distributed:
            return DoneWork([tensor]) if async_op else None
        global_src = dist.get_global_rank(group, src) if group is not None else src
        return self._timed(dist.broadcast(tensor, src=global_src, group=group, async_op=async_op))

    def exchange(
        self, tensors: Sequence[torch.Tensor], peers: Sequence[int], *, async_op: bool = False,
    ) -> list[list[torch.Tensor]] | tuple[list[list[torch.Tensor]], object]:
        """Send ``tensors`` to each of ``peers`` (group ranks) and receive the same shapes from
        each: ``received[k][i]`` is peer k's tensor i. Every peer must call it naming this rank
        among its own peers, with tensors of the same shapes and dtypes; nobody else takes part
        (no collective over the group). One ``batch_isend_irecv``: each tensor is one message
        each way per peer. Metered as the point-to-point traffic it is
        (:func:`~lowcomm.comm.meter.peer_exchange_traffic`): tx = the bytes sent to the peers,
        rx = those received, so summed over ranks tx equals rx.

        With ``async_op`` returns ``(received, work)``: the buffers are filled once
        ``work.wait()`` returns."""
        peers = list(peers)
        if self.rank in peers or len(set(peers)) != len(peers):
            raise ValueError(f"exchange: rank {self.rank}'s peers {peers} must be other ranks, each once")
        if any(not 0 <= peer < self.world_size for peer in peers):
            raise ValueError(f"exchange: peers {peers} outside the group of {self.world_size} ranks")
        group = self._route("exchange", "data", *tensors)
        payload = sum(nbytes(tensor) for tensor in tensors)
        self._record("exchange", payload, peer_exchange_traffic(payload, len(peers), len(tensors)), "data")
        received = [[torch.empty_like(tensor) for tensor in tensors] for _ in peers]
        operations = []
        for peer, buffers in zip(peers, received, strict=True):
            global_peer = dist.get_global_rank(group, peer) if group is not None else peer
            for tensor, buffer in zip(tensors, buffers, strict=True):
                operations.append(dist.P2POp(dist.isend, tensor.contiguous(), global_peer, group))
                operations.append(dist.P2POp(dist.irecv, buffer, global_peer, group))
        works = dist.batch_isend_irecv(operations) if operations else []
        work = self._timed(_AllWork(works)) if works else DoneWork(received)
        if async_op:
            return received, work
        work.wait()
        return received

    def barrier(self) -> None:
        """A metered barrier: an all-reduce of one int (the backend's own barrier would be
        unmetered), on the control device."""
        self.all_reduce(torch.zeros(1, dtype=torch.int32, device=self.control_device), purpose="control")

    # --------------------------------------------------------------- utilities
    def share(self, values: Sequence[int], src: int = 0) -> list[int]:
        """Rank ``src``'s list of integers on every rank (two control broadcasts: its length,
        then the values), e.g. the checkpoint steps rank 0 chose to try."""
        length = torch.tensor([len(values)], dtype=torch.int64, device=self.control_device)
        self.broadcast(length, src=src, purpose="control")
        data = torch.tensor(list(values) if self.rank == src else [0] * int(length.item()),
                            dtype=torch.int64, device=self.control_device)
        if data.numel():
            self.broadcast(data, src=src, purpose="control")
        return [int(v) for v in data.tolist()]

    def agree(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (a control all-reduce)."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.control_device)
        self.all_reduce(value, op="max", purpose="control")
        return bool(value.item())

    def first(self, flag: bool) -> int | None:
        """The lowest rank where ``flag`` is true, the same on every rank; None where it is
        nowhere (a control all-reduce): one rank then speaks for all, with its own reason."""
        value = torch.tensor([self.rank if flag else self.world_size], dtype=torch.int64, device=self.control_device)
        self.all_reduce(value, op="min", purpose="control")
        lowest = int(value.item())
        return lowest if lowest < self.world_size else None

    def split(self, groups: Sequence[Sequence[int]], scope: str) -> Communicator:
        """Create one sub-group per entry of ``groups`` (global ranks; every rank must call
        this with the same list) and return the Communicator of the group holding this rank.
        The sub-communicator shares this meter and records under ``scope``."""
        if not (dist.is_available() and dist.is_initialized()):
            return Communicator(meter=self.meter, scope=scope, device=self.device, timeout=self.timeout)
        # a real group even at world size 1: FSDP's device mesh is built from it
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks=list(ranks), timeout=self.timeout)
            if self.global_rank in ranks:
                mine = group
        if mine is None:
            raise ValueError(f"global rank {self.global_rank} is in none of the groups {groups}")
        # no control group: a sub-group's control traffic (FSDP's validation gathers) is on the data device
        return Communicator(group=mine, meter=self.meter, scope=scope, device=self.device, timeout=self.timeout)


class QuantizedExchange:
    """A quantized all-reduce in flight (see :meth:`Communicator.all_reduce_quantized`):
    :meth:`start` issues the all-to-all; :meth:`wait` reduces this rank's chunks, re-encodes
    them, all-gathers and decodes every chunk into the outputs."""

    def __init__(self, comm: Communicator, group, codec, sent: list[list], out: list[torch.Tensor]):
        self.comm, self.group, self.codec, self.sent, self.out = comm, group, codec, sent, out
        world = comm.world_size
        # chunk_bytes[j]: rank j's chunks of every tensor, encoded (the same sizes on every rank);
        # offsets[t][j]: where tensor t's chunk j starts among them
        self.offsets, running = [], [0] * world
        for payloads in sent:
            self.offsets.append(list(running))
            running = [total + payload_size(payload) for total, payload in zip(running, payloads, strict=True)]
        self.chunk_bytes = running
        self.device = out[0].device if out else torch.device("cpu")
        self.received = self.work = None
        self.done = False

    def start(self) -> None:
        world, rank = self.comm.world_size, self.comm.rank
        if world == 1:
            return
        send = torch.cat([payload_bytes(payloads[j]) for j in range(world) for payloads in self.sent
                          if payloads[j] is not None] or [torch.empty(0, dtype=torch.uint8)]).to(self.device)
        self.received = torch.empty(world * self.chunk_bytes[rank], dtype=torch.uint8, device=self.device)
        self.work = self._all_to_all(self.received, send)

    def _all_to_all(self, received: torch.Tensor, send: torch.Tensor):
        """Phase 2 on the wire: ``send`` holds this rank's chunks for rank 0, 1, ... in turn
        (``chunk_bytes[j]`` bytes each); ``received`` gets every rank's chunk for this one, in
        rank order. Returns the work to wait for."""
        size = self.chunk_bytes[self.comm.rank]
        return dist.all_to_all_single(received, send, [size] * self.comm.world_size, self.chunk_bytes,
                                      group=self.group, async_op=True)

    def _all_gather(self, gathered: torch.Tensor, buffer: torch.Tensor) -> None:
        """Phase 4 on the wire: every rank's reduced chunks (``buffer``, padded to one size)
        into ``gathered``, in rank order."""
        dist.all_gather_single(gathered, buffer, group=self.group)

    def is_completed(self) -> bool:
        return self.done

    def _reduced(self) -> list:
        """This rank's chunk of every tensor: the W senders' chunks summed in float32 (float64
        for a float64 tensor) in rank order, divided by W and encoded again (None where the
        chunk is empty). Each tensor's W chunks are dequantized in one call, into one column
        block of a W-row matrix per precision, and the rows are summed once for all tensors:
        a few operations per tensor and W per call, not a few per tensor and sender."""
        world, rank = self.comm.world_size, self.comm.rank
        if world == 1:
            return [payloads[0] for payloads in self.sent]
        self.work.wait()
        rows = self.received.view(world, -1)  # row s: sender s's chunks of every tensor, for this rank
        placed, columns = [], {}  # (tensor, template, precision, first column); columns per precision
        for index, payloads in enumerate(self.sent):
            template = payloads[rank]
            if template is None:
                continue
            # float32 for bf16 / fp32 tensors (torchft's), the tensor's own precision above that
            accumulate = torch.promote_types(template.meta["dtype"], torch.float32)
            placed.append((index, template, accumulate, columns.get(accumulate, 0)))
            columns[accumulate] = columns.get(accumulate, 0) + template.meta["shape"].numel()
        sums = {dtype: torch.empty(world, count, dtype=dtype, device=self.device) for dtype, count in columns.items()}
        for index, template, accumulate, first in placed:
            start = self.offsets[index][rank]
            stacked = stacked_from_bytes(rows[:, start:start + payload_size(template)], template)
            sums[accumulate][:, first:first + template.meta["shape"].numel()].copy_(self.codec.dequantize(stacked))
        for matrix in sums.values():
            for sender in range(1, world):  # in rank order, one addition per sender for every tensor
                matrix[0].add_(matrix[sender])
            matrix[0].div_(world)
        reduced = [None] * len(self.sent)
        for index, template, accumulate, first in placed:
            mean = sums[accumulate][0, first:first + template.meta["shape"].numel()]
            encoded = self.codec.encode(mean.view(template.meta["shape"]))
            encoded.meta = template.meta  # decoded to the tensor's dtype, like every other rank's chunk
            reduced[index] = encoded
        return reduced

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as dist.Work
        if self.done:
            return True
        world = self.comm.world_size
        reduced = self._reduced()
        if world == 1:
            for own, target in zip(reduced, self.out, strict=True):
                if own is not None:  # (an empty tensor has nothing to decode)
                    target.detach().copy_(self.codec.decode([own]).view_as(target))
            self.done = True
            return True
        # every rank's reduced chunks, padded to the largest rank's (an all-gather of equal sizes)
        padded = max(self.chunk_bytes)
        mine = torch.cat([payload_bytes(p) for p in reduced if p is not None]
                         or [torch.empty(0, dtype=torch.uint8)]).to(self.device)
        buffer = torch.zeros(padded, dtype=torch.uint8, device=self.device)
        buffer[: mine.numel()] = mine
        gathered = torch.empty(world * padded, dtype=torch.uint8, device=self.device)
        self._all_gather(gathered, buffer)
        for payloads, offsets, target in zip(self.sent, self.offsets, self.out, strict=True):
            # each run of equal-shape chunks lies end to end in the target: its bytes gathered
            # and decoded in one call
            for run in chunk_runs(target.shape, world):
                ranks = run[0]
                length = payload_size(payloads[ranks.start])
                starts = torch.tensor([j * padded + offsets[j] for j in ranks], device=self.device)
                stacked = stacked_from_bytes(gathered[starts.unsqueeze(1) + torch.arange(length, device=self.device)],
                                             payloads[ranks.start])
                chunks = stacked_chunks(target.detach(), run)
                chunks.copy_(self.codec.dequantize(stacked).view_as(chunks))
        self.done = True
        return True


def _describe(served: dict[str, str]) -> str:
    return ", ".join(f"{device}:{backend}" for device, backend in served.items())
