"""A small internet in network namespaces: public hosts on one switch, homes behind real NAT routers.

    public-0  public-1  ...        (11.77.0.2, .3, ...: reachable from everywhere on the switch)
        \\        |       /
         [ switch: a bridge in its own namespace ]
          /                 \\
    router-A (11.77.0.101)   router-B (11.77.0.102)   iptables MASQUERADE out, nothing in
        |                        |
    home-A-0, home-A-1       home-B-0                  (192.168.1.10, .11 / 192.168.2.10: private)

A home host dials out through its router (source NAT, conntrack lets the replies back); nothing on
the switch can open a connection to it, exactly as behind a home router with no port forwarded.
Everything lives in namespaces this lab made, named with a tag of its own, and goes away with
`close()`: no traffic leaves them. Needs root (CAP_NET_ADMIN), `ip` (iproute2) and `iptables`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

# libp2p offers no circuit through a relay at a private address (go-libp2p autorelay keeps only a
# relay's public addresses), so the switch uses public-looking ones; its namespace has no link out.
SWITCH_NET = "11.77.0"


def unavailable_reason() -> str | None:
    """Why a lab cannot be built on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 iptables)"
    probe = f"shoal-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        nat = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L"], capture_output=True,
                             text=True)  # fmt: skip
        if nat.returncode != 0:
            return f"iptables' nat table is not available: {nat.stderr.strip()[:200]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str
    home: str | None  # the home it sits in, None on the public switch

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace (`ip netns exec` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class NatLab:
    public: int = 2
    homes: dict[str, int] = field(default_factory=lambda: {"A": 2, "B": 1})
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: dict[str, Host] = field(default_factory=dict)
    routers: dict[str, str] = field(default_factory=dict)  # home -> its router's public address
    _namespaces: list[str] = field(default_factory=list)

    def __enter__(self) -> NatLab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, role: str) -> str:
        name = f"sh{self.tag}-{role}"
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _in(name, "ip", "link", "set", "lo", "up")
        return name

    def _veth(self, ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
        """A cable between two namespaces (created in ours under unique names, then moved and renamed)."""
        tmp_a, tmp_b = f"v{self.tag}{secrets.token_hex(2)}a", f"v{self.tag}{secrets.token_hex(2)}b"
        _ip("link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        _ip("link", "set", tmp_a, "netns", ns_a)
        _ip("link", "set", tmp_b, "netns", ns_b)
        _in(ns_a, "ip", "link", "set", tmp_a, "name", name_a)
        _in(ns_b, "ip", "link", "set", tmp_b, "name", name_b)

    def build(self) -> None:
        switch = self._ns("switch")
        _in(switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(switch, "ip", "link", "set", "br0", "up")
        port = 0

        def plug(ns: str, ip: str) -> None:
            nonlocal port
            port += 1
            self._veth(switch, f"p{port}", ns, "wan")
            _in(switch, "ip", "link", "set", f"p{port}", "master", "br0")
            _in(switch, "ip", "link", "set", f"p{port}", "up")
            _in(ns, "ip", "addr", "add", f"{ip}/24", "dev", "wan")
            _in(ns, "ip", "link", "set", "wan", "up")

        for i in range(self.public):
            ns = self._ns(f"pub{i}")
            plug(ns, f"{SWITCH_NET}.{2 + i}")
            self.hosts[f"public-{i}"] = Host(f"public-{i}", ns, f"{SWITCH_NET}.{2 + i}", None)
        for h, (home, count) in enumerate(self.homes.items(), start=1):
            router = self._ns(f"rt{home}")
            self.routers[home] = f"{SWITCH_NET}.{100 + h}"
            plug(router, self.routers[home])
            lan = f"192.168.{h}"
            _in(router, "ip", "link", "add", "lan", "type", "bridge")
            _in(router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan")
            _in(router, "ip", "link", "set", "lan", "up")
            _in(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            # the home router: out with the router's address, back only what belongs to a connection
            _in(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", "wan",
                "-j", "MASQUERADE")  # fmt: skip
            _in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate",
                "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
            _in(router, "iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP")
            for i in range(count):
                ns = self._ns(f"h{home}{i}")
                self._veth(router, f"l{i}", ns, "eth0")
                _in(router, "ip", "link", "set", f"l{i}", "master", "lan")
                _in(router, "ip", "link", "set", f"l{i}", "up")
                ip = f"{lan}.{10 + i}"
                _in(ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
                _in(ns, "ip", "link", "set", "eth0", "up")
                _in(ns, "ip", "route", "add", "default", "via", f"{lan}.1")
                self.hosts[f"home-{home}-{i}"] = Host(f"home-{home}-{i}", ns, ip, home)

    def close(self) -> None:
        """Delete every namespace this lab made (their interfaces, rules and processes' links go too)."""
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()

    def router_ip(self, home: str) -> str:
        """The address a home's hosts come from, as the public side sees them."""
        return self.routers[home]

    def wan_bytes(self, host: Host) -> int:
        """Bytes in and out of a host's link to the switch so far (`ip netns exec` mounts its own /sys)."""
        read = "cat /sys/class/net/wan/statistics/rx_bytes /sys/class/net/wan/statistics/tx_bytes"
        done = subprocess.run(host.command("sh", "-c", read), capture_output=True, text=True, check=True)
        return sum(int(n) for n in done.stdout.split())


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _in(ns: str, *argv: str) -> None:
    _run(["ip", "netns", "exec", ns, *argv])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
