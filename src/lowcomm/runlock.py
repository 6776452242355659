"""One writer per run directory.

Two launches of the same config share one run directory (its name is derived from the config).
Had both trained, their ranks would resume from different checkpoints, deadlock in collectives
and interleave their metrics. Whatever starts the run therefore holds ``<run_dir>/.lock`` while
it trains: the local launcher for its workers, rank 0 under torchrun
(:func:`lowcomm.train.worker.run_rank`); a second launch, by either, fails at once naming the
owner. A foundation module, so that both layers can take it.

The lock is the kernel's: ``flock`` on the open file, which the kernel releases when its holder
dies, however it dies and in whatever PID namespace it runs (a container, ``unshare --pid``), so
a lock is never mistaken for stale while its holder lives, nor for live because its pid now
belongs to another process. The file's content (host, boot id, pid, start time) only names the
holder in the message; a file that nobody holds is a leftover of a dead launcher, taken over with
a message. Over NFS, Linux maps flock to the server's byte-range locks.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirLocked(RuntimeError):
    """Another live process holds this run directory."""


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return "?"


class RunDirLock:
    """``with RunDirLock(run_dir):`` holds the run directory for this process."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.owner = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                      "pid_namespace": _pid_namespace(),
                      "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        self._descriptor: int | None = None
        self._made_dir = False

    def acquire(self) -> None:
        # a launch refused before it wrote anything (bad data, a changed config) leaves no empty
        # run directory behind to be mistaken for a run
        self._made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            # O_CLOEXEC: the workers must not inherit the lock (it would outlive the launcher)
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read(descriptor))
                os.close(descriptor)
                raise RunDirLocked(f"{self.path.parent} is in use by {holder} (another launch of the same config "
                                   "is running); wait for it, or stop it first") from None
            # held; but a releasing owner unlinks the file before letting go of it: this must
            # still be the file at the path, else lock the new one
            try:
                current = os.stat(self.path).st_ino == os.fstat(descriptor).st_ino
            except FileNotFoundError:
                current = False
            if not current:
                os.close(descriptor)
                continue
            left = _read(descriptor)
            if left:
                print(f"[lowcomm] taking over {self.path}: its owner ({_describe(left)}) is gone", flush=True)
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, json.dumps(self.owner).encode(), 0)
            self._descriptor = descriptor
            return
        raise RunDirLocked(f"could not take {self.path}: other launches keep taking and releasing it")

    def release(self) -> None:
        if self._descriptor is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still held: a waiting launch then locks a fresh file
        os.close(self._descriptor)
        self._descriptor = None
        if self._made_dir:
            with contextlib.suppress(OSError):  # not empty: something was written, keep it
                self.path.parent.rmdir()

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir`` now (``pid 123 on host ...``), or None when nobody does: the
    kernel's answer, asked without taking the lock for longer than the asking."""
    path = Path(run_dir) / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(_read(descriptor))
    else:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return None
    finally:
        os.close(descriptor)


def _read(descriptor: int) -> str:
    return os.pread(descriptor, 4096, 0).decode(errors="replace").strip()


def _pid_namespace() -> int | None:
    """This process's PID namespace (the inode of /proc/self/ns/pid), which tells whose pid a
    recorded pid is: one in a container's namespace means nothing outside it."""
    with contextlib.suppress(OSError):
        return os.stat("/proc/self/ns/pid").st_ino
    return None


def _describe(content: str) -> str:
    """``pid 123 on host (boot 1a2b3c4d) since ...`` from a lock file's content; a pid of another
    PID namespace than this process's (a container, ``unshare --pid``) is said to be one."""
    try:
        owner = json.loads(content)
        pid = f"pid {owner['pid']}"
        theirs = owner.get("pid_namespace")
        if theirs is not None and theirs != _pid_namespace():
            pid += " in another PID namespace (a container's, say)"
        return (f"{pid} on {owner['host']} (boot {str(owner.get('boot_id', '?'))[:8]}) "
                f"since {owner.get('since', '?')}")
    except (ValueError, KeyError, TypeError):
        return "an unknown launch (its lock file is unreadable)"
