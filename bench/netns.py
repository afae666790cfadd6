"""Network-namespace topologies for benches and tests: one namespace per node on a shared bridge.

`Topology(prefix)` makes a bridge namespace; `add_node(name, up_mbit, down_mbit)` adds a node
namespace with `eth0` (10.77.0.x/24) on that bridge, shaped by `tc tbf` both ways (this kernel has
no netem, so there is bandwidth but no delay). Names carry the prefix and the pid, so runs do not
collide; `close()` deletes every namespace (and with them every veth) and is safe to call twice.
Needs root and iproute2.
"""

import ctypes
import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass


def _delete_namespaces(names: Iterable[str]) -> list[str]:
    """Delete each namespace (its veth ends go with it); the errors, one per namespace that
    could not be deleted and still exists."""
    errors = []
    for ns in names:
        proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                              check=False)
        if proc.returncode and "No such file" not in proc.stderr:
            errors.append(f"{ns}: {proc.stderr.strip()}")
    return errors


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no iproute2, or the kernel refuses)."""


@dataclass(frozen=True)
class Node:
    name: str
    ns: str
    ip: str
    up_mbit: float
    down_mbit: float

    def argv(self, *cmd: str) -> list[str]:
        """The command line that runs cmd inside this node's namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None if a probe namespace with tbf works."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or under sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    topo = Topology(prefix="dsprobe")
    try:
        topo.add_node("probe", 10, 10)
    except (NetnsUnavailable, OSError) as exc:
        return f"cannot build a namespace with a shaped veth: {exc}"
    finally:
        topo.close()
    return None


class Topology:
    def __init__(self, prefix: str = "ds", subnet: str = "10.77.0") -> None:
        self.prefix = f"{prefix}{os.getpid()}"
        self.subnet = subnet
        self.bridge = f"{self.prefix}br"
        self.nodes: dict[str, Node] = {}
        self._namespaces: list[str] = []
        self._bridge_up = False

    def add_node(self, name: str, up_mbit: float, down_mbit: float) -> Node:
        """A namespace whose eth0 sends at most up_mbit and receives at most down_mbit."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} already exists")
        if not self._bridge_up:
            self._add_ns(self.bridge)
            self._ip(self.bridge, "link", "add", "br0", "type", "bridge")
            self._ip(self.bridge, "link", "set", "br0", "up")
            self._bridge_up = True
        index = len(self.nodes) + 1
        if index > 250:
            raise ValueError("at most 250 nodes fit in one /24")
        ns, port = f"{self.prefix}n{index}", f"v{index}"
        self._add_ns(ns)
        _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth",
              "peer", "name", port, "netns", self.bridge])
        self._ip(self.bridge, "link", "set", port, "master", "br0")
        self._ip(self.bridge, "link", "set", port, "up")
        ip = f"{self.subnet}.{index}"
        self._ip(ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        self._ip(ns, "link", "set", "eth0", "up")
        _tbf(ns, "eth0", up_mbit)
        _tbf(self.bridge, port, down_mbit)
        node = Node(name, ns, ip, up_mbit, down_mbit)
        self.nodes[name] = node
        return node

    def tx_bytes(self, node: Node) -> int:
        """Bytes node's eth0 has sent (wire bytes: payload plus TCP/IP and protocol overhead)."""
        out = _run(node.argv("cat", "/sys/class/net/eth0/statistics/tx_bytes"))
        return int(out)

    def close(self) -> None:
        errors = _delete_namespaces(reversed(self._namespaces))
        self._namespaces.clear()
        self.nodes.clear()
        self._bridge_up = False
        if errors:
            raise NetnsUnavailable("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        self._ip(ns, "link", "set", "lo", "up")

    def _ip(self, ns: str, *args: str) -> None:
        _run(["ip", "-n", ns, *args])


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise NetnsUnavailable(f"setns into {what}: errno {ctypes.get_errno()}")


def _tbf(ns: str, dev: str, mbit: float) -> None:
    rate_bytes = mbit * 1e6 / 8
    burst = max(32 * 1024, int(rate_bytes / 100))
    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
          "burst", str(burst), "latency", "50ms"])


def _run(argv: list[str]) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except FileNotFoundError as exc:
        raise NetnsUnavailable(f"{argv[0]} not found") from exc
    if proc.returncode:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc.stdout


@dataclass(frozen=True)
class Link:
    """Counters of one shaped link, read from the kernel (`ip -s -j link`)."""
    ns: str
    dev: str


class RegionNet:
    """Regions as they are: each region a router namespace holding a LAN bridge (`lan`, fast
    tbf-shaped node ports) and a `wan` veth to a core bridge, shaped both ways (tbf on the router
    side for traffic leaving the region, on the core side for traffic entering it); the trainer
    on one region's LAN behind its own shaped uplink; a monitor namespace with a leg on every LAN
    (not through any shaped link, no forwarding) for the orchestrator's control requests.

    Region r uses 10.(60+r).0.0/24 (router .1, trainer .2, nodes .10+, monitor .250); routers sit
    on 10.200.0.0/24. Every namespace carries the prefix and the pid; `close()` deletes them all.
    """

    def __init__(self, prefix: str = "dsr") -> None:
        self.prefix = f"{prefix}{os.getpid()}"
        self.core = f"{self.prefix}core"
        self.monitor = f"{self.prefix}mon"
        self.regions: list[str] = []
        self.routers: dict[str, str] = {}
        self.nodes: dict[str, Node] = {}
        self.ports: dict[str, Link] = {}
        """node name → its port on the region's bridge (tx there = bytes the node received)."""
        self.region_of: dict[str, str] = {}
        self._namespaces: list[str] = []
        self._next_host: dict[str, int] = {}
        self._next_ns = 0

    def subnet(self, region: str) -> str:
        return f"10.{60 + self.regions.index(region)}.0"

    def build(self, regions: list[tuple[str, float, float]], lan_mbit: float) -> None:
        """regions: (name, mbit leaving the region, mbit entering it)."""
        if len(regions) > 100:
            raise ValueError("at most 100 regions")
        self.lan_mbit = lan_mbit
        self._add_ns(self.core)
        _run(["ip", "-n", self.core, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.core, "link", "set", "br0", "up"])
        self._add_ns(self.monitor)
        for i, (name, up, down) in enumerate(regions):
            self.regions.append(name)
            rt = f"{self.prefix}rt{i}"
            self.routers[name] = rt
            self._add_ns(rt)
            _run(["ip", "netns", "exec", rt, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            _run(["ip", "-n", rt, "link", "add", "lan", "type", "bridge"])
            _run(["ip", "-n", rt, "addr", "add", f"{self.subnet(name)}.1/24", "dev", "lan"])
            _run(["ip", "-n", rt, "link", "set", "lan", "up"])
            _run(["ip", "link", "add", "wan", "netns", rt, "type", "veth", "peer", "name",
                  f"r{i}", "netns", self.core])
            _run(["ip", "-n", rt, "addr", "add", f"10.200.0.{i + 1}/24", "dev", "wan"])
            _run(["ip", "-n", rt, "link", "set", "wan", "up"])
            _run(["ip", "-n", self.core, "link", "set", f"r{i}", "master", "br0"])
            _run(["ip", "-n", self.core, "link", "set", f"r{i}", "up"])
            _tbf(rt, "wan", up)
            _tbf(self.core, f"r{i}", down)
            _run(["ip", "link", "add", f"m{i}", "netns", self.monitor, "type", "veth", "peer",
                  "name", "mon", "netns", rt])
            _run(["ip", "-n", rt, "link", "set", "mon", "master", "lan"])
            _run(["ip", "-n", rt, "link", "set", "mon", "up"])
            _run(["ip", "-n", self.monitor, "addr", "add", f"{self.subnet(name)}.250/24", "dev",
                  f"m{i}"])
            _run(["ip", "-n", self.monitor, "link", "set", f"m{i}", "up"])
            self._next_host[name] = 10
        for i, name in enumerate(self.regions):
            for j, other in enumerate(self.regions):
                if i != j:
                    _run(["ip", "-n", self.routers[name], "route", "add",
                          f"{self.subnet(other)}.0/24", "via", f"10.200.0.{j + 1}"])

    def add_node(self, name: str, region: str, up_mbit: float | None = None,
                 down_mbit: float | None = None, host: int | None = None) -> Node:
        """A namespace on region's LAN; up/down default to the LAN rate (the trainer's uplink is
        given explicitly). Works while the others run (churn)."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} already exists")
        rt = self.routers[region]
        if host is None:
            host = self._next_host[region]
            self._next_host[region] += 1
            if host >= 250:
                raise ValueError(f"region {region} is full")
        self._next_ns += 1
        ns, port = f"{self.prefix}n{self._next_ns}", f"p{self._next_ns}"
        self._add_ns(ns)
        _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
              "netns", rt])
        _run(["ip", "-n", rt, "link", "set", port, "master", "lan"])
        _run(["ip", "-n", rt, "link", "set", port, "up"])
        ip = f"{self.subnet(region)}.{host}"
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", f"{self.subnet(region)}.1"])
        up, down = up_mbit or self.lan_mbit, down_mbit or self.lan_mbit
        _tbf(ns, "eth0", up)
        _tbf(rt, port, down)
        node = Node(name, ns, ip, up, down)
        self.nodes[name], self.ports[name], self.region_of[name] = node, Link(rt, port), region
        return node

    def wan(self, region: str) -> Link:
        return Link(self.routers[region], "wan")

    def counters(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(namespace, device) → (rx bytes, tx bytes) of every link in the routers and nodes."""
        out = {}
        for ns in [*self.routers.values(), *(n.ns for n in self.nodes.values())]:
            proc = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show"],
                                  capture_output=True, text=True, check=False, timeout=30)
            if proc.returncode:
                continue
            for link in json.loads(proc.stdout):
                st = link.get("stats64") or link.get("stats") or {}
                out[(ns, link["ifname"])] = (int(st.get("rx", {}).get("bytes", 0)),
                                             int(st.get("tx", {}).get("bytes", 0)))
        return out

    _home: int | None = None
    """An open fd of the namespace the process started in (to come back from the monitor)."""

    def enter_monitor(self) -> None:
        """Move the calling thread (and the threads and processes it starts later) into the
        monitor namespace, from which every node's control plane is reachable. Call it from the
        main thread; `leave_monitor()` returns."""
        if RegionNet._home is None:
            RegionNet._home = os.open("/proc/self/ns/net", os.O_RDONLY)
        fd = os.open(f"/run/netns/{self.monitor}", os.O_RDONLY)
        try:
            _setns(fd, self.monitor)
        finally:
            os.close(fd)

    @staticmethod
    def leave_monitor() -> None:
        if RegionNet._home is not None:
            _setns(RegionNet._home, "the starting namespace")

    def close(self) -> None:
        errors = _delete_namespaces(reversed(self._namespaces))
        self._namespaces.clear()
        self.nodes.clear()
        if errors:
            raise NetnsUnavailable("could not delete namespaces: " + "; ".join(errors))

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
