"""What the network-namespace tests (test_wire, test_wan, test_nodes, ...) need before they
start: root and iproute2. Where either is missing they skip, or fail under
``LOWCOMM_REQUIRE_NETNS=1`` (a CI box that must run them). And torchrun on each node of a
``node_network``. A helper module, not a test itself."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The wire's overhead over what the meter counts, measured by tests/test_wire.py on one
# namespace's loopback (see its module doc) and bounded with room for a busier machine; the
# multi-node tests (tests/test_nodes.py) hold each node's links to the same bounds.
OVERHEAD_PER_BYTE_MAX = 0.01  # measured 0.18 %: TCP/IP headers of 64 KiB segments
OVERHEAD_PER_MESSAGE = (200.0, 1500.0)  # bytes per metered message; measured 690
# Four ranks on two cores (tests/test_nodes.py) read their sockets late: the kernel then sends
# smaller segments and more window updates, each with its headers and its ACK on the loopback.
# CI saw 3.1 % beyond the per-message bound once (2026-11-25, AdamW-DDP's intra-node ring: 981,200
# bytes on lo for 933,888 metered in 12 messages); the bound leaves room for three times that.
OVERHEAD_PER_BYTE_LOADED_MAX = 0.10

# slurm/local_slurm.sh's lock around apt-get (APT_LOCK there)
APT_LOCK = "/var/lock/lowcomm-apt.lock"


def need_iproute2() -> None:
    """iproute2 on a fresh CI box: install it the way the SLURM fixture installs slurm."""
    if shutil.which("ip"):
        return
    if shutil.which("apt-get"):
        # one apt at a time, on slurm/local_slurm.sh's lock: the suite's other worker may be installing
        with open(APT_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not shutil.which("ip"):
                subprocess.run(["apt-get", "update"], capture_output=True, timeout=600)
                subprocess.run(["apt-get", "install", "-y", "iproute2"], capture_output=True, timeout=600,
                               env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if not shutil.which("ip"):
        netns_unavailable("iproute2 (ip) is not installed and could not be installed with apt-get")


def listed_namespaces() -> list[str]:
    """The network namespaces ``ip netns list`` names now (without its ``(id: N)`` notes)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def run_shaping_benchmark(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``script`` (a benchmark that makes network namespaces and shapes their links with tc's
    tbf) with ``args``, from ``cwd``; skipped, or failed under ``LOWCOMM_REQUIRE_NETNS=1``, where
    this machine cannot run it: not root, no iproute2, no tbf in the kernel."""
    if os.geteuid() != 0:
        netns_unavailable("not root (ip netns add needs CAP_SYS_ADMIN)")
    need_iproute2()
    done = subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "Specified qdisc kind is unknown" in done.stderr:
        netns_unavailable("tc's tbf qdisc is not available in this kernel")
    return done


def left_behind(namespaces: list[str]) -> list[str]:
    """Of a benchmark's network (its ``namespaces``), the namespaces still listed: each of its
    names ends in the tag of its network (benchmarks/netns.py), a switch's too. Other tests'
    namespaces, made and deleted beside it by the suite's other worker, are not its to answer for."""
    tags = {name.rsplit("-", 1)[1] for name in namespaces}
    assert tags, namespaces
    return [name for name in listed_namespaces() if name.rsplit("-", 1)[-1] in tags]


def netns_unavailable(reason: str) -> None:
    if os.environ.get("LOWCOMM_REQUIRE_NETNS") == "1":
        pytest.fail(f"LOWCOMM_REQUIRE_NETNS=1 but network namespaces are unavailable: {reason}", pytrace=False)
    pytest.skip(f"network namespaces unavailable: {reason}")


def torchrun_on_node(nodes, index: int, config_path: Path, *, ranks_per_node: int = 2,
                     port: int = 29751) -> subprocess.Popen:
    """``lowcomm-torchrun`` (torchrun ending as lowcomm's launcher does) on node ``index`` of
    ``nodes``, ``ranks_per_node`` workers of ``lowcomm.train.worker``, the first node's hostname
    as the rendezvous; its output (both streams) in ``stdout``."""
    argv = [sys.executable, "-m", "lowcomm.cli.torchrun", "--nnodes", str(len(nodes)), "--nproc-per-node",
            str(ranks_per_node), "--node-rank", str(index), "--master-addr", nodes[0].hostname,
            "--master-port", str(port), "-m", "lowcomm.train.worker", str(config_path)]
    return subprocess.Popen(nodes[index].command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"})
