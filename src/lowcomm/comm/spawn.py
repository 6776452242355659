"""Run a function on W local processes joined by a real process group (gloo by default; NCCL
or ``cuda:gloo`` for workers on GPUs).

Used by the tests, the benchmarks and anything else that needs a few CPU workers without the
full training launcher: ``results = spawn_workers(fn, world_size, *args)`` calls
``fn(rank, world_size, *args)`` in each process (after ``init_process_group``) and returns
the W return values in rank order. A worker's exception is re-raised here with its traceback.

Workers are forked from a fork server, started at the first call, that has imported
torch once (``PRELOAD``): a worker then starts in a tenth of a second instead of the three to four
seconds a fresh interpreter spends importing torch and OLMo, which is what made a test of a few
milliseconds of collectives take seconds. Each worker still runs in a process of its own, with
the caller's working directory, ``sys.path`` and environment as they are at the call.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serialize(obj) -> bytes:
    # Tensors put on a multiprocessing queue travel as shared-memory handles that die with the
    # worker; plain bytes survive it.
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _deserialize(blob: bytes):
    import io

    import torch

    return torch.load(io.BytesIO(blob), weights_only=False)


# What the fork server imports before it forks any worker: torch's own modules and OLMo's model,
# the ~3.5 s a fresh interpreter spends before a worker can build a model (OLMo 1.8 s of it: its
# package imports `datasets`, pandas and pyarrow). Not lowcomm's: a module may read the
# environment when imported, and a worker has the caller's environment of the moment. OLMo's
# import leaves one thread of pyarrow's beside the main one, idle, and a fork copies only the
# forking thread: a worker must not use pyarrow (or `datasets`, whose config read the server's
# environment), and none does; lm-eval runs in the caller's process. Importing these
# initialises no CUDA (a forked worker could not use it).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "olmo.model"]


class _Caller:
    """What a worker takes from the caller of :func:`spawn_workers` at the call: its environment
    and its stdout and stderr (a forked worker otherwise has the fork server's, which are the
    first caller's: a test capturing its output, say, would see nothing of a later call's
    workers). The descriptors travel as multiprocessing passes any: duplicated into the
    worker as it starts, where ``streams`` are their numbers there."""

    STREAMS = (1, 2)

    def __init__(self, environment: dict[str, str], streams: list[int]) -> None:
        self.environment, self.streams = environment, streams

    @classmethod
    def now(cls) -> _Caller:
        return cls(dict(os.environ), list(cls.STREAMS))

    def __reduce__(self):
        from multiprocessing import reduction

        return _Caller._received, (self.environment, [reduction.DupFd(fd) for fd in self.streams])

    @staticmethod
    def _received(environment: dict[str, str], streams: list) -> _Caller:
        return _Caller(environment, [stream.detach() for stream in streams])

    def adopt(self) -> None:
        """In the worker: the caller's environment, stdout and stderr."""
        os.environ.clear()
        os.environ.update(self.environment)
        for fd, stream in zip(self.STREAMS, self.streams, strict=True):
            if stream != fd:  # a spawned worker has the caller's descriptors under their own numbers
                os.dup2(stream, fd)
                os.close(stream)


def _entry(rank, world_size, port, fn, args, queue, threads, backend, caller):
    import torch
    import torch.distributed as dist

    caller.adopt()
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        if backend is not None:  # at the caller's store (spawn_workers)
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        if dist.is_initialized():  # fn may have torn the group down itself (Trainer.close)
            # a CUDA-only backend ("cuda:gloo") has no CPU barrier: a gloo group beside it does
            dist.barrier(group=None if "cpu" in dist.get_backend_config() else dist.new_group(backend="gloo"))
        queue.put((rank, True, _serialize(result)))
    except BaseException:  # noqa: BLE001 - report anything to the parent, then die
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0, threads: int = 1,
    backend: str | None = "gloo",
) -> list[Any]:
    """``fn`` must be importable (module level) so that it can be pickled to the workers.
    ``backend`` is ``init_process_group``'s: ``"cuda:gloo"`` gives a group that, like NCCL,
    refuses CPU tensors; None, no world-wide group (workers that meet in groups of their own,
    as replica groups do)."""
    # Workers fork from a server that has imported PRELOAD and nothing else: CUDA cannot run in
    # a process forked from one that initialised it, and importing PRELOAD does not (on an H200,
    # 2026-11-28, forked workers ran NCCL at W=1 and gloo on CUDA tensors at W=2 while the
    # caller itself had CUDA up).
    ctx = mp.get_context("forkserver")  # Linux and macOS
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call's
    queue = ctx.Queue()
    # The rendezvous store is the caller's, on a port of the kernel's choosing, as the local
    # launcher hosts its workers' (a port picked free here and bound later by rank 0 could be
    # taken meanwhile: EADDRINUSE in a busy suite). The workers reach it as $MASTER_PORT too.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    caller = _Caller.now()
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, queue, threads, backend, caller),
                    daemon=False)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout_s)
            if ok:
                results[rank] = _deserialize(value)
            else:
                failures.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if failures else timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results[r] for r in range(world_size)]
