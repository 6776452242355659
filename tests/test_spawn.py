"""``spawn_workers`` forks its workers from a fork server that imported torch once: each is a
process of its own, with the caller's environment, working directory, ``sys.path``, stdout and
stderr as they are at the call (not as they were when the server started), and a worker's
failure comes back with its traceback."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from lowcomm.comm.spawn import spawn_workers


def _where(rank: int, world_size: int) -> dict:
    value = torch.tensor([rank + 1])
    dist.all_reduce(value)
    return {"pid": os.getpid(), "variable": os.environ.get("LOWCOMM_SPAWN_TEST"), "cwd": os.getcwd(),
            "path": list(sys.path), "sum": int(value.item()), "world": world_size}


def _say(rank: int, world_size: int) -> None:
    del world_size
    # one write each: the two workers' lines must not interleave
    os.write(1, f"rank {rank} to stdout\n".encode())
    os.write(2, f"rank {rank} to stderr\n".encode())


def _fail(rank: int, world_size: int) -> None:
    del world_size
    if rank == 1:
        raise ValueError("rank 1 refuses")


@pytest.mark.slow
def test_each_call_sees_the_callers_environment_directory_and_path_of_that_moment(tmp_path, monkeypatch):
    first = spawn_workers(_where, 2)  # starts the fork server, if no test did before
    monkeypatch.setenv("LOWCOMM_SPAWN_TEST", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))
    second = spawn_workers(_where, 2)
    assert [r["sum"] for r in first + second] == [3] * 4 and [r["world"] for r in second] == [2, 2]
    assert len({r["pid"] for r in first + second} | {os.getpid()}) == 5
    assert [r["variable"] for r in second] == ["set after the server started"] * 2
    assert all(r["variable"] is None for r in first)
    assert [r["cwd"] for r in second] == [str(tmp_path)] * 2
    assert all(r["path"][0] == str(tmp_path / "extra") for r in second)


def test_a_workers_exception_is_raised_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: rank 1 refuses"):
        spawn_workers(_fail, 2, timeout_s=60)


@pytest.mark.parametrize("backend", ["gloo", "cuda:gloo"])  # both forked from the server; cuda:gloo adds a gloo group
def test_a_workers_output_goes_where_the_callers_goes_at_the_call(capfd, backend):
    """Not to where the fork server's went when an earlier call started it, whatever the
    backend (until 2026-11-28 a CUDA backend's workers were spawned, not forked)."""
    spawn_workers(_where, 1)
    capfd.readouterr()
    spawn_workers(_say, 2, backend=backend)
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["rank 0 to stdout", "rank 1 to stdout"]
    assert sorted(line for line in err.splitlines() if line.startswith("rank")) == ["rank 0 to stderr",
                                                                                 "rank 1 to stderr"]
