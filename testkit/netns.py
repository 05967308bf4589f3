"""Hosts of their own on one machine: a network namespace per host, joined by a bridge.

`Hosts` makes a bridge in the machine's own namespace (which holds the database's address) and, per
`add(name)`, a namespace with a veth pair onto that bridge and an address of its own; a process is
started on a host with `host.run(argv)` (nsenter into its network namespace). A partition is one
rule on one host's side of its link, one direction: `host.cut(address)` routes what that host sends
to `address` through a gateway that is nowhere (a neighbour entry naming a hardware address no port
has), so its frames are dropped silently, as a partition drops them: the sender learns nothing
until its own timeouts, for a connection it holds and for one it opens. `host.heal(address)`
removes the route. Everything made is removed by `close()`.

This machine's kernel has no packet classifiers for `tc` (u32, flower) and no netfilter, so a cut
is a route, which drops by destination address: PostgreSQL gets an address of its own for it. (A
blackhole route is not silent: a connection opened through it fails at once with EINVAL.)

It needs root, iproute2 (`ip`) and nsenter; `unavailable()` says why it cannot run, or None.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

SUBNET = "10.231"  # 10.231.<net>.<host>/24: far from the addresses a machine's own networks use


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (apt-get install iproute2)"
    if shutil.which("nsenter") is None:
        return "util-linux's nsenter is not installed (apt-get install util-linux)"
    return None


def _free_net(seed: int) -> str:
    """A 10.231.N network no bridge of this machine holds now (tests on other workers make their own)."""
    taken = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for i in range(250):
        net = f"{SUBNET}.{(seed + i) % 250 + 1}"
        if f" {net}." not in taken:
            return net
    raise OSError(f"every {SUBNET}.N network is taken on this machine")


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    nowhere: str = ""  # an address on the host's network whose hardware address no port has: cuts route there
    cuts: set[str] = field(default_factory=set)

    def run(self, argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*self.enter, *argv], **popen)

    @property
    def enter(self) -> tuple[str, ...]:
        """What runs a command on this host: into its network namespace alone. (`ip netns exec` also
        mounts a sysfs of the namespace over /sys, which hides the cgroup hierarchies a sandbox needs.)"""
        return ("nsenter", f"--net=/run/netns/{self.namespace}", "--")

    def cut(self, address: str) -> None:
        """Drop everything this host sends to `address` (one direction, silently)."""
        ip("-n", self.namespace, "route", "add", f"{address}/32", "via", self.nowhere)
        self.cuts.add(address)

    def heal(self, address: str) -> None:
        ip("-n", self.namespace, "route", "del", f"{address}/32", "via", self.nowhere)
        self.cuts.discard(address)


class Hosts:
    """A bridge and its hosts; the machine's own namespace is `gateway` on it, and holds `extra`
    addresses of its own (a database listening apart from everything else, so a cut to it cuts only it)."""

    def __init__(self, extra: int = 1) -> None:
        why = unavailable()
        if why is not None:
            raise OSError(why)
        tag = secrets.token_hex(3)
        self.bridge = f"rb{tag}"
        self.net = _free_net(int(tag, 16))
        self.hosts: dict[str, Host] = {}
        self.gateway = f"{self.net}.1"
        # An address of its own: a bridge otherwise takes the lowest of its ports' addresses, which
        # changes as hosts are added, and a host that had resolved the database's address to the old
        # one failed to resolve it again while its connections waited (seen in benchmarks/scaling.py).
        mac = "02:" + ":".join(tag[i:i + 2] for i in range(0, 6, 2)) + ":00:01"
        ip("link", "add", self.bridge, "address", mac, "type", "bridge")
        try:
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            self.extra = [f"{self.net}.{2 + i}" for i in range(extra)]
            for address in self.extra:
                ip("addr", "add", f"{address}/32", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def add(self, name: str) -> Host:
        n = len(self.hosts)
        host = Host(name, f"{self.bridge}-{name}", f"{self.net}.{10 + n}", nowhere=f"{self.net}.254")
        ip("netns", "add", host.namespace)
        self.hosts[name] = host
        outside = f"{self.bridge}v{n}"
        ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        ip("link", "set", outside, "master", self.bridge, "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "route", "add", "default", "via", self.gateway)
        # Frames to this hardware address reach no host: the bridge floods them and every port drops them.
        ip("-n", host.namespace, "neigh", "replace", host.nowhere, "lladdr", "02:00:00:00:00:fe", "dev", "eth0",
           "nud", "permanent")
        return host

    def close(self) -> None:
        for n, host in enumerate(self.hosts.values()):
            # The link first: a namespace outlives its last process while the kernel still holds sockets
            # of it (a connection a killed process left retransmitting into a cut), and its link with it.
            subprocess.run(["ip", "link", "del", f"{self.bridge}v{n}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)  # its veth ends go with the namespaces

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Host", "Hosts", "unavailable"]
