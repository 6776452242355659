"""Private network namespaces for the benchmarks and tests that measure the wire (wire_check.py,
wan.py), and several nodes on one machine (:func:`node_network`: a namespace per node, a bridge
between them).

Inside a fresh namespace the loopback is the only link, and everything the gloo workers send
crosses it: its counters (/sys/class/net/lo/statistics) count every byte, and a ``tc`` token
bucket filter on it is a real rate-limited link between them. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# A token bucket lets a burst of its size through at once. A real link has no such bucket, so
# it is kept small: two packets. The loopback's 64 KiB packets would make it 128 KiB (a whole
# DeMo step of the tiny model), so a shaped loopback takes jumbo-frame packets instead.
SHAPED_MTU = 1500


@contextlib.contextmanager
def network_namespace(prefix: str = "lowcomm") -> Iterator[str]:
    """A fresh namespace with its loopback up; always deleted on exit."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def limit_rate(namespace: str, bits_per_s: float | None) -> str:
    """Rate-limit the namespace's loopback to ``bits_per_s`` with a token bucket filter, its MTU
    set to ``SHAPED_MTU`` and its bucket to two packets (None: remove the limit, MTU back to
    64 KiB). The queue holds a second of traffic, so TCP is slowed, not dropped. Returns
    ``tc qdisc show``'s line, as the kernel reports the qdisc."""
    base = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
    subprocess.run([*base, "del", "dev", "lo", "root"], capture_output=True, check=False)
    mtu = 65536 if bits_per_s is None else SHAPED_MTU
    subprocess.run(["ip", "-n", namespace, "link", "set", "lo", "mtu", str(mtu)], check=True)
    if bits_per_s is not None:
        subprocess.run([*base, "add", "dev", "lo", "root", "tbf", "rate", f"{int(bits_per_s)}bit",
                        "burst", str(2 * SHAPED_MTU), "latency", "1s"], check=True, capture_output=True, text=True)
    return subprocess.run([*base, "show", "dev", "lo"], check=True, capture_output=True, text=True).stdout.strip()


def loopback_tx_bytes(namespace: str) -> int:
    """Bytes the namespace's loopback has carried, from its own counter, read from outside it."""
    done = subprocess.run(["ip", "netns", "exec", namespace, "cat", "/sys/class/net/lo/statistics/tx_bytes"],
                          check=True, capture_output=True, text=True)
    return int(done.stdout)


# ------------------------------------------------------------------ several nodes on one machine
NODE_SUBNET = "10.77.{tag}.{host}"  # one /24 per network: the tag keeps concurrent networks apart
NODE_INTERFACE = "eth0"  # each node's end of its veth: its one link to the other nodes
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` mounts /etc/netns/NS/<file> over /etc/<file>


@dataclass(frozen=True)
class Node:
    """One node of a :func:`node_network`: its hostname, network namespace and address. Its
    loopback is the intra-node link, ``eth0`` (a veth to the network's bridge) the inter-node
    one; each has its own kernel counters."""

    hostname: str
    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this node: inside its namespace, under its own hostname (a UTS
        namespace of its own), with ``/etc/hosts`` naming every node of the network."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "sh", *argv]

    def counters(self) -> dict[str, int]:
        """Bytes sent so far on the node's two links: ``intra`` (its loopback: a packet counted
        once) and ``inter`` (its veth to the bridge), from the kernel's counters."""
        read = ["ip", "netns", "exec", self.namespace, "cat",
                "/sys/class/net/lo/statistics/tx_bytes", f"/sys/class/net/{NODE_INTERFACE}/statistics/tx_bytes"]
        intra, inter = subprocess.run(read, check=True, capture_output=True, text=True).stdout.split()
        return {"intra": int(intra), "inter": int(inter)}

    def received(self) -> int:
        """Bytes the node's inter-node link (its veth) has received so far, by the kernel's count."""
        read = ["ip", "netns", "exec", self.namespace, "cat", f"/sys/class/net/{NODE_INTERFACE}/statistics/rx_bytes"]
        return int(subprocess.run(read, check=True, capture_output=True, text=True).stdout)

    def kill_all(self) -> int:
        """The node lost: SIGKILL to every process in its namespace (torchrun's workers run in
        sessions of their own, so killing the agent would leave them); how many there were."""
        found = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, check=False)
        pids = [int(pid) for pid in found.stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def limit_rate(self, bits_per_s: float | None) -> str:
        """Rate-limit the node's inter-node link (its veth's egress) with a token bucket filter
        of two packets (None: remove the limit); returns the qdisc as the kernel reports it."""
        base = ["ip", "netns", "exec", self.namespace, "tc", "qdisc"]
        subprocess.run([*base, "del", "dev", NODE_INTERFACE, "root"], capture_output=True, check=False)
        if bits_per_s is not None:
            subprocess.run([*base, "add", "dev", NODE_INTERFACE, "root", "tbf", "rate", f"{int(bits_per_s)}bit",
                            "burst", str(2 * SHAPED_MTU), "latency", "1s"], check=True, capture_output=True)
        return subprocess.run([*base, "show", "dev", NODE_INTERFACE], check=True, capture_output=True,
                              text=True).stdout.strip()


LOGIN_HOST = 254  # the host's own address on a node network that reaches the host (``login=True``)


@contextlib.contextmanager
def node_network(count: int, prefix: str = "lowcomm", *, login: bool = False) -> Iterator[list[Node]]:
    """``count`` nodes (2 to 4 is what the tests use) joined by one switch: a network namespace
    per node with its loopback up, a veth from each node to a bridge in a namespace of its own
    (nothing is added to the host's network), addresses in one /24, and hostnames
    ``<prefix>-node<i>`` that every node resolves (``ip netns exec`` mounts
    ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``). With ``login``, the host itself joins
    the network too, as a cluster's login node: a veth from the host's own namespace to the
    bridge, address ``.254`` (:func:`login_address`), so that daemons and commands on the host
    (a SLURM controller, sbatch, squeue) reach every node. Everything is deleted on exit, also
    when the body raises. Needs root and iproute2."""
    if not 1 <= count <= 250:
        raise ValueError(f"node_network: 1 to 250 nodes, got {count}")
    tag = uuid.uuid4().hex[:6]
    host_interface = f"{prefix[:4]}h{tag}" if login else None
    switch = f"{prefix}-switch-{tag}"
    subnet = 1 + int(tag, 16) % 250
    nodes = [Node(f"{prefix}-node{i}", f"{prefix}-node{i}-{tag}", NODE_SUBNET.format(tag=subnet, host=i + 1))
             for i in range(count)]
    created: list[str] = []
    try:
        subprocess.run(["ip", "netns", "add", switch], check=True)
        created.append(switch)
        _run_in(switch, ["ip", "link", "add", "br0", "type", "bridge"])
        _run_in(switch, ["ip", "link", "set", "br0", "up"])
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.hostname}\n" for n in nodes)
        for index, node in enumerate(nodes):
            subprocess.run(["ip", "netns", "add", node.namespace], check=True)
            created.append(node.namespace)
            etc = ETC_NETNS / node.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            _run_in(node.namespace, ["ip", "link", "set", "lo", "up"])
            port = f"port{index}"
            _run_in(node.namespace, ["ip", "link", "add", NODE_INTERFACE, "type", "veth", "peer", "name", port,
                                     "netns", switch])
            _run_in(node.namespace, ["ip", "addr", "add", f"{node.address}/24", "dev", NODE_INTERFACE])
            _run_in(node.namespace, ["ip", "link", "set", NODE_INTERFACE, "up"])
            _run_in(switch, ["ip", "link", "set", port, "master", "br0"])
            _run_in(switch, ["ip", "link", "set", port, "up"])
        if host_interface:
            _join_from_host(switch, host_interface, NODE_SUBNET.format(tag=subnet, host=LOGIN_HOST))
        yield nodes
    finally:
        if host_interface:  # at once: the switch's namespace takes its end of the pair with it, but lazily
            subprocess.run(["ip", "link", "delete", host_interface], capture_output=True, check=False)
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)
            shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)


def login_address(nodes: Sequence[Node]) -> str:
    """The host's address on the network of ``nodes`` (made with ``login=True``)."""
    return nodes[0].address.rsplit(".", 1)[0] + f".{LOGIN_HOST}"


def _join_from_host(switch: str, interface: str, address: str) -> None:
    """A veth from the host's namespace (``interface``, ``address``) to the switch's bridge;
    deleting the switch's namespace deletes its far end, and with it the pair."""
    subprocess.run(["ip", "link", "add", interface, "type", "veth", "peer", "name", "login", "netns", switch],
                   check=True, capture_output=True)
    subprocess.run(["ip", "addr", "add", f"{address}/24", "dev", interface], check=True, capture_output=True)
    subprocess.run(["ip", "link", "set", interface, "up"], check=True, capture_output=True)
    _run_in(switch, ["ip", "link", "set", "login", "master", "br0"])
    _run_in(switch, ["ip", "link", "set", "login", "up"])


def _run_in(namespace: str, argv: Sequence[str]) -> None:
    done = subprocess.run(["ip", "netns", "exec", namespace, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"in namespace {namespace}: {' '.join(argv)} failed: {done.stderr.strip()}")


def start_synchronizer_on(node: Node, config_path: Path, run_dir: Path, env: dict[str, str],
                          wait_s: float = 120.0) -> subprocess.Popen:
    """A run of learners' synchronizer (``python -m lowcomm.train.synchronizer``) on ``node``, its
    address in the run's record under the node's hostname, as the local launcher would start it;
    returned once the record is there (the learners find it there)."""
    record = Path(run_dir) / "synchronizer.json"
    record.unlink(missing_ok=True)
    proc = subprocess.Popen(node.command([sys.executable, "-m", "lowcomm.train.synchronizer", str(config_path)]),
                            env={**env, "LOWCOMM_SYNCHRONIZER_HOST": node.hostname}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + wait_s
    while not record.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the synchronizer on {node.hostname} did not start: {proc.communicate()[0][-2000:]}")
        time.sleep(0.1)
    return proc
