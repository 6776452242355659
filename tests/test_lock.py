"""The one-writer lock of a run directory is the kernel's flock: a holder in another PID
namespace (a container, ``unshare --pid``) is seen, a dead one never blocks, and a leftover file
naming a pid that now belongs to an unrelated live process is taken over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from lowcomm.runlock import LOCK_FILE, RunDirLock, RunDirLocked

HOLD = ("import sys, time\nfrom lowcomm.runlock import RunDirLock\n"
        "with RunDirLock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_holder_in_another_pid_namespace_is_seen_and_its_death_frees_the_lock(tmp_path):
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", HOLD,
                               str(tmp_path)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # its pid is the namespace's own, and said to be (issue 45: "pid 1" alone, a pid outside it)
        with pytest.raises(RunDirLocked, match=r"is in use by pid 1 in another PID namespace \(a container's, say\) "
                                               r"on .* \(boot [0-9a-f]{8}\) since"):
            RunDirLock(tmp_path).acquire()  # pid 1 in its namespace: no pid check could have told
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # unshare and its child, pid 1 of the namespace
        holder.wait()
    # the kernel releases the lock when the holder is gone: the namespace's pid 1 may outlive
    # unshare by a moment on a loaded machine
    deadline = time.monotonic() + 30
    lock = RunDirLock(tmp_path)
    while True:
        try:
            lock.acquire()
            break
        except RunDirLocked:
            assert time.monotonic() < deadline, "the lock outlived its holder"
            time.sleep(0.05)
    try:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid() == lock.owner["pid"]
    finally:
        lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


TRY = ("import sys\nfrom lowcomm.runlock import RunDirLock, RunDirLocked\n"
       "try:\n    RunDirLock(sys.argv[1]).acquire()\n    print('taken')\nexcept RunDirLocked as exc:\n    print(exc)\n")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_launch_in_another_pid_namespace_cannot_take_a_live_lock(tmp_path):
    """The other way round: the holder's pid does not exist in the second launch's namespace."""
    with RunDirLock(tmp_path):
        done = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", TRY, str(tmp_path)],
                              capture_output=True, text=True, timeout=60)
    assert f"is in use by pid {os.getpid()} in another PID namespace (a container's, say) on" in done.stdout, (
        done.stdout + done.stderr)


def test_a_leftover_lock_naming_a_live_unrelated_pid_is_taken_over(tmp_path, capsys):
    # pid 1 lives (init, or a container's entry point) but holds nothing: today's file is a leftover
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "since": "earlier"}))
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over {tmp_path / LOCK_FILE}: its owner (pid 1 on" in capsys.readouterr().out


def test_the_workers_do_not_inherit_the_lock(tmp_path):
    """A worker that outlived its launcher must not keep the run directory locked."""
    lock = RunDirLock(tmp_path)
    lock.acquire()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.release()
        with RunDirLock(tmp_path):  # the child still runs, and holds nothing
            assert child.poll() is None
    finally:
        child.kill()
        child.wait()
