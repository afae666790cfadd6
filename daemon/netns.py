"""Network-namespace topologies for benches and tests: one namespace per node on a shared bridge.

`Topology(prefix)` makes a bridge namespace; `add_node(name, up_mbit, down_mbit)` adds a node
namespace with `eth0` (10.77.0.x/24) on that bridge, shaped by `tc tbf` both ways (this kernel has
no netem, so there is bandwidth but no delay). Names carry the prefix and the pid, so runs do not
collide; `close()` deletes every namespace (and with them every veth) and is safe to call twice.
Needs root and iproute2.
"""

import os
import shutil
import subprocess
from dataclasses import dataclass


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
        errors = []
        for ns in reversed(self._namespaces):
            proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                                  check=False)
            if proc.returncode and "No such file" not in proc.stderr:
                errors.append(f"{ns}: {proc.stderr.strip()}")
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
