"""Private network namespaces for the benchmarks that measure the wire (wire_check.py, wan.py).

Inside a fresh namespace the loopback is the only link, and everything the gloo workers send
crosses it: its counters (/sys/class/net/lo/statistics) count every byte, and a ``tc`` token
bucket filter on it is a real rate-limited link between them. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator

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
