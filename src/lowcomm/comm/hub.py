"""A hub: one process that learners push tensors to and pull tensors from over TCP, each on its
own clock, every byte metered (the transport of a synchronizer: :mod:`lowcomm.optim.synchronizer`).

A collective makes every worker wait for the slowest; the methods built for unequal workers
(Decoupled DiLoCo, asynchronous DiLoCo) instead send to one synchronizer whenever a learner is
ready, and take what it sends back whenever it arrives. A gloo process group cannot carry that:
its members are fixed when it forms and one lost member breaks it. So the hub is a TCP server
and each learner one connection to it: a learner that dies closes its connection and no other
notices, and one that starts again connects again.

A message is a header (a small JSON object: what the tensors are, a learner's counters) and
tensors, framed as ``[4 B header length][8 B tensor bytes][header][tensor bytes]`` (lengths
big-endian). Its ``payload`` is the tensor bytes, what the paper counts; ``tx`` / ``rx`` are the
whole frame, what the socket carries (the kernel adds TCP/IP's framing on top). Both ends meter
what they send and receive (:class:`~lowcomm.comm.meter.CommMeter`, collective ``push`` on a
learner's side and ``pull`` for what it receives; the hub's own meter mirrors them), so summed
over learners and hub, tx equals rx.

Sending never blocks the trainer: a learner's :meth:`HubLink.push` queues the frame for a
thread of its own, and a thread receives into a queue the learner reads between its steps
(:meth:`HubLink.take`, :meth:`HubLink.wait_for`). The meter is only ever touched by the caller's
thread: a push is counted as it is queued (its frame's size is known then), a received message as
it is handed to the learner (:meth:`HubLink.take`, :meth:`HubLink.wait_for`), or when the link
closes with it unread.
"""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lowcomm.comm.meter import CommMeter

_PREFIX = struct.Struct("!IQ")
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                            torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}
PUSH, PULL = "push", "pull"  # the meter's collectives: a learner's sends, and what it receives
SYNC = "data"  # the meter's purpose of the synchronizer's traffic: the method's exchange, as a collective's
# A frame without tensors (a hello, DONE, BYE) is the protocol's own: metered as control, as the
# harness's other handshakes are, so that a learner's data bytes per step do not depend on when it
# (re)connected
CONTROL = "control"


def purpose_of(tensor_bytes: int) -> str:
    return SYNC if tensor_bytes else CONTROL
# A learner leaving (HubLink.leave) says DONE; the synchronizer answers BYE once nothing more is
# owed to it, and sends it nothing after: every byte sent was then received, and metered.
DONE, BYE = "done", "bye"


class HubClosed(ConnectionError):
    """The other end of a hub connection is gone."""


@dataclass
class Message:
    """A header and its tensors, as received; ``nbytes``: its whole frame."""

    header: dict
    tensors: list[torch.Tensor]
    nbytes: int

    @property
    def payload(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def frame(header: dict, tensors: Sequence[torch.Tensor]) -> list[bytes | memoryview]:
    """The bytes of one message, in the order they go on the wire."""
    tensors = [t.detach().contiguous().cpu() for t in tensors]
    unknown = sorted({str(t.dtype) for t in tensors} - set(_DTYPES))
    if unknown:
        raise TypeError(f"the hub carries {', '.join(sorted(_DTYPES))}; not {', '.join(unknown)}")
    specs = [[str(t.dtype), list(t.shape)] for t in tensors]
    head = json.dumps({"header": header, "tensors": specs}, separators=(",", ":")).encode()
    data = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"" for t in tensors]
    return [_PREFIX.pack(len(head), sum(len(d) for d in data)), head, *data]


def frame_overhead(header: dict, tensors: Sequence[torch.Tensor]) -> int:
    """The bytes a frame of ``tensors`` under ``header`` carries beside the tensors' own (its
    prefix and JSON head), from their dtypes and shapes alone (meta tensors do)."""
    specs = [[str(t.dtype), list(t.shape)] for t in tensors]
    return _PREFIX.size + len(json.dumps({"header": header, "tensors": specs}, separators=(",", ":")).encode())


def frame_size(parts: Sequence[bytes | memoryview]) -> int:
    return sum(len(part) for part in parts)


def payload_size(parts: Sequence[bytes | memoryview]) -> int:
    """The tensor bytes of a :func:`frame`: what the paper's convention counts."""
    return frame_size(parts[2:])


def _read_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            raise HubClosed("the connection closed mid-message" if got else "the connection closed")
        got += count
    return buffer


def read_message(sock: socket.socket) -> Message:
    head_len, data_len = _PREFIX.unpack(_read_exactly(sock, _PREFIX.size))
    head = json.loads(_read_exactly(sock, head_len))
    data = _read_exactly(sock, data_len) if data_len else bytearray()
    tensors, offset = [], 0
    for dtype_name, shape in head["tensors"]:
        dtype = _DTYPES[dtype_name]
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        chunk = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        tensors.append(chunk.view(dtype).reshape(shape).clone())
        offset += nbytes
    return Message(head["header"], tensors, _PREFIX.size + head_len + data_len)


class _Connection:
    """One socket, with a thread receiving into ``inbox`` (``(tag, Message, None)``, then
    ``(tag, None, error)`` once when it closes) and a thread sending what :meth:`queue_send`
    queues, so that no sender waits for a slow or stuck peer. Threads start with :meth:`start`."""

    def __init__(self, sock: socket.socket, inbox: queue.Queue, tag=None):
        self.sock, self.inbox, self.tag = sock, inbox, tag
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.closed = False
        self.send_error: BaseException | None = None
        self.outbox: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._read, daemon=True, name=f"hub-read-{tag}"),
                         threading.Thread(target=self._send, daemon=True, name=f"hub-send-{tag}")]

    def start(self) -> _Connection:
        for thread in self._threads:
            thread.start()
        return self

    def _read(self) -> None:
        try:
            while True:
                self.inbox.put((self.tag, read_message(self.sock), None))
        except Exception as error:  # noqa: BLE001 - any end of the stream (a closed socket, a bad frame) ends it
            self.closed = True
            self.inbox.put((self.tag, None, error))

    def _send(self) -> None:
        # every queued frame is marked done, sent or not, so that a join() never hangs on a dead peer
        while True:
            parts = self.outbox.get()
            try:
                if parts is None:
                    return
                if self.send_error is None:
                    for part in parts:
                        self.sock.sendall(part)
            except OSError as error:
                self.send_error = error
            finally:
                self.outbox.task_done()

    def queue_send(self, parts: Sequence[bytes | memoryview]) -> None:
        self.outbox.put(parts)

    def close(self) -> None:
        self.closed = True
        self.outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Hub:
    """The synchronizer's end: listens on ``host:port`` (0: the kernel's choice), takes a
    connection from each learner (its first message names it: ``{"learner": m}``) and hands
    every message on, in arrival order, through :meth:`next`. :meth:`send` answers one learner,
    :meth:`learners` says who is connected. Bytes both ways are in ``meter``."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, meter: CommMeter | None = None):
        self.meter = meter if meter is not None else CommMeter()
        self._server = socket.create_server((host, port), reuse_port=False)
        self.port = self._server.getsockname()[1]
        self._inbox: queue.Queue = queue.Queue()
        self._connections: dict[int, _Connection] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name="hub-accept")
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            try:
                hello = read_message(sock)
                learner = int(hello.header["learner"])
            except (OSError, ValueError, KeyError, TypeError):
                sock.close()
                continue
            connection = _Connection(sock, self._inbox, tag=learner)
            with self._lock:
                old = self._connections.get(learner)
                self._connections[learner] = connection
            if old is not None:  # a learner started again: its old connection is stale
                old.close()
            # its arrival before anything it sends (the reader starts after)
            self._inbox.put((learner, Message({"joined": learner}, [], hello.nbytes), None))
            connection.start()

    def learners(self) -> list[int]:
        with self._lock:
            return sorted(m for m, c in self._connections.items() if not c.closed)

    def next(self, timeout: float | None = None) -> tuple[int, Message | None]:
        """The next message and its learner, in arrival order: ``(m, Message)``; ``(m, None)``
        once learner m's connection closed; raises ``queue.Empty`` after ``timeout`` seconds."""
        while True:
            learner, message, error = self._inbox.get(timeout=timeout)
            with self._lock:
                stale = error is not None and self._connections.get(learner) is not None \
                    and not self._connections[learner].closed
            if stale:  # the error of a connection a newer one of the same learner replaced
                continue
            if message is not None:  # (a learner's hello too: its frame crossed the wire)
                self.meter.record(PUSH, message.payload, 0, message.nbytes, purpose=purpose_of(message.payload))
            return learner, message

    def send(self, learner: int, header: dict, tensors: Sequence[torch.Tensor] = ()) -> bool:
        """Queue a message to ``learner`` (a thread of its connection sends it: a slow or stuck
        learner holds up no other); False when it is not connected (a lost learner: nobody waits).
        The tensors are copied now."""
        with self._lock:
            connection = self._connections.get(learner)
        if connection is None or connection.closed or connection.send_error is not None:
            return False
        parts = frame(header, [t.detach().clone() for t in tensors])
        payload = payload_size(parts)
        self.meter.record(PULL, payload, frame_size(parts), 0, messages=1, purpose=purpose_of(payload))
        connection.queue_send(parts)
        return True

    def close(self, drain_s: float = 10.0) -> None:
        """Stop taking learners; send what is queued (at most ``drain_s``: a BYE among it), then
        close every connection."""
        self._closing = True
        with self._lock:
            connections = list(self._connections.values())
        deadline = time.monotonic() + drain_s
        while any(c.outbox.unfinished_tasks and c.send_error is None and not c.closed for c in connections) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        try:  # wakes the acceptor (closing alone does not, on Linux)
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        self._acceptor.join(timeout=5)
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            connection.close()


class HubLink:
    """A learner's end of the hub at ``address`` (``host:port``): :meth:`push` queues a message
    (sent by a thread of its own), :meth:`take` returns what has arrived, :meth:`wait_for` blocks
    for a message that passes a test. Bytes in ``meter``, counted in the caller's thread."""

    def __init__(self, address: str, learner: int, meter: CommMeter, *, connect_timeout_s: float = 60.0):
        host, _, port = address.rpartition(":")
        self.learner, self.meter = learner, meter
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise HubClosed(f"no synchronizer at {address} within {connect_timeout_s:.0f} s") from None
                time.sleep(0.1)
        sock.settimeout(None)
        hello = frame({"learner": learner}, [])
        sock.sendall(b"".join(bytes(p) for p in hello))
        self.meter.record(PUSH, 0, frame_size(hello), 0, messages=1, purpose=CONTROL)
        self._inbox: queue.Queue = queue.Queue()
        self._connection = _Connection(sock, self._inbox, tag=learner).start()
        self._kept: list[Message] = []
        self._gone: BaseException | str | None = None  # why the connection ended, once it has

    def push(self, header: dict, tensors: Sequence[torch.Tensor] = ()) -> int:
        """Queue a message to the synchronizer; returns its frame's size (the tensors are copied
        now: the caller may go on changing its own)."""
        error = self._connection.send_error
        if error is not None or self._connection.closed:
            raise HubClosed(f"the synchronizer is gone ({error or 'connection closed'})")
        parts = frame(header, [t.detach().clone() for t in tensors])
        size, payload = frame_size(parts), payload_size(parts)
        self.meter.record(PUSH, payload, size, 0, messages=1, purpose=purpose_of(payload))
        self._connection.queue_send(parts)
        return size

    def flush(self) -> None:
        """Until every queued push is on the wire (before a checkpoint: nothing in flight)."""
        self._connection.outbox.join()
        if self._connection.send_error is not None:
            raise HubClosed(f"the synchronizer is gone ({self._connection.send_error})")

    def _drain(self, block: bool, timeout: float | None) -> None:
        """Move what has arrived into the kept list (not yet metered: a message is metered as it
        is handed out, so that what a learner has taken at a step does not depend on when the
        bytes happened to arrive). The connection's end is noted, not raised: what came before it
        (a BYE, and the synchronizer closes right after one) is still handed out."""
        if self._gone is not None:
            return
        try:
            item = self._inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return
        while True:
            _, message, error = item
            if message is None:
                self._gone = error or "the connection closed"
                return
            self._kept.append(message)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _raise_if_gone(self) -> None:
        if self._gone is not None:
            raise HubClosed(f"the synchronizer is gone ({self._gone})")

    def _hand_out(self, messages: list[Message]) -> list[Message]:
        for message in messages:
            self.meter.record(PULL, 0, 0, message.nbytes, purpose=purpose_of(message.payload))
        return messages

    def take(self, wanted: Callable[[Message], bool] | None = None) -> list[Message]:
        """Every message arrived so far (``wanted``: those it accepts; the others stay), in order;
        never blocks."""
        self._drain(block=False, timeout=None)
        taken = [m for m in self._kept if wanted is None or wanted(m)]
        self._kept = [m for m in self._kept if not (wanted is None or wanted(m))]
        if not taken:
            self._raise_if_gone()
        return self._hand_out(taken)

    def wait_for(self, wanted: Callable[[Message], bool], timeout_s: float) -> Message:
        """Block until a message that ``wanted`` accepts has arrived and return it (the others
        that arrived meanwhile stay for :meth:`take`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for index, message in enumerate(self._kept):
                if wanted(message):
                    return self._hand_out([self._kept.pop(index)])[0]
            self._raise_if_gone()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message from the synchronizer within {timeout_s:.0f} s")
            self._drain(block=True, timeout=left)

    def leave(self, timeout_s: float = 300.0) -> list[Message]:
        """Say DONE and wait for the synchronizer's BYE (what it still owed this learner comes
        before it), then close; returns the messages that came meanwhile."""
        self.push({"kind": DONE})
        self.wait_for(lambda m: m.header.get("kind") == BYE, timeout_s=timeout_s)
        came, self._kept = self._hand_out(self._kept), []
        self.close()
        return came

    def close(self) -> None:
        """Leave without a word (a lost learner's way). What arrived and was never taken is
        metered now: it crossed the wire."""
        self._connection.close()
        kept, self._kept = self._kept, []
        self._hand_out(kept)
        while True:
            try:
                _, message, _ = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message is not None:
                self._hand_out([message])
