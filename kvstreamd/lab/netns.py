"""Test hosts on one machine: network namespaces joined by veth pairs whose egress is shaped
with tc tbf, so transfers see a real bandwidth limit (DESIGN.md section 6). `Star` joins a hub
host `a` to each of several hosts by a link of its own; `Link` is its two-host case.

Needs root and iproute2. netem is not in this kernel: no added delay or loss here."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET = "192.0.2"  # TEST-NET-1: used inside the namespaces only


def available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not, why (for skip reasons)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"kvsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def remove_stale() -> None:
    """Delete the namespaces of links whose process is gone (killed before its cleanup ran)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listing:
        if name.startswith("kvs") and name[-1:].isalpha() and name[3:-1].isdigit():
            if not os.path.exists(f"/proc/{int(name[3:-1])}"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)


def tbf(mbit: float) -> list[str]:
    """tc arguments of the shaper: a token bucket at `mbit` holding ~1 ms of traffic (at least
    a few packets), so the rate holds on short transfers (a probe) too."""
    burst = max(16_000, int(mbit * 1e6 / 8 * 0.001))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms"]


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@dataclass
class Star:
    """Hub host `a` joined to each spoke host (b, c, ...) by a veth pair of its own: the k-th
    spoke is 192.0.2.(4k+2), the hub 192.0.2.(4k+1) on that link (`hub_addr`), `addr["a"]`
    its address on the first. `shape(mbit)` limits both directions of every link; call it
    again to change the rate mid-run."""

    spokes: tuple[str, ...] = ("b",)
    tag: str = field(default_factory=lambda: f"kvs{os.getpid()}")
    rate_mbit: float | None = None

    @property
    def sides(self) -> tuple[str, ...]:
        return ("a", *self.spokes)

    @property
    def ns(self) -> dict[str, str]:
        return {side: f"{self.tag}{side}" for side in self.sides}

    @property
    def dev(self) -> dict[str, str]:
        """Each spoke's end of its link; "a": the hub's end of the first link."""
        return {"a": self.hub_dev[self.spokes[0]], **{s: f"{self.tag}v{s}" for s in self.spokes}}

    @property
    def hub_dev(self) -> dict[str, str]:
        return {s: f"{self.tag}h{s}" for s in self.spokes}

    @property
    def hub_addr(self) -> dict[str, str]:
        return {s: f"{SUBNET}.{4 * k + 1}" for k, s in enumerate(self.spokes)}

    @property
    def addr(self) -> dict[str, str]:
        return {"a": self.hub_addr[self.spokes[0]], **{s: f"{SUBNET}.{4 * k + 2}" for k, s in enumerate(self.spokes)}}

    def _ends(self):
        """(namespace, device, address) of both ends of every link."""
        for s in self.spokes:
            yield self.ns["a"], self.hub_dev[s], self.hub_addr[s]
            yield self.ns[s], self.dev[s], self.addr[s]

    def up(self) -> "Star":
        remove_stale()
        for side in self.sides:
            _run("ip", "netns", "add", self.ns[side])
        try:
            for s in self.spokes:
                _run("ip", "link", "add", self.hub_dev[s], "type", "veth", "peer", "name", self.dev[s])
            for ns, dev, addr in self._ends():
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
            for side in self.sides:
                _run("ip", "-n", self.ns[side], "link", "set", "lo", "up")
            if self.rate_mbit:
                self.shape(self.rate_mbit)
        except Exception:
            self.down()
            raise
        return self

    def shape(self, mbit: float) -> None:
        """Token-bucket limit (see tbf) on both directions of every link."""
        for ns, dev, _ in self._ends():
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf(mbit))
        self.rate_mbit = mbit

    def unshape(self) -> None:
        for ns, dev, _ in self._ends():
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        self.rate_mbit = None

    def command(self, side: str, argv: list[str]) -> list[str]:
        """argv run inside host `side`'s namespace."""
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def popen(self, side: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(side, argv), **kwargs)

    def down(self) -> None:
        for side in self.sides:  # deleting a namespace destroys the veth ends inside it
            subprocess.run(["ip", "netns", "del", self.ns[side]], capture_output=True)

    def __enter__(self) -> "Star":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


@dataclass
class Link(Star):
    """Hosts `a` (192.0.2.1) and `b` (192.0.2.2), each in its own namespace, joined by a veth
    pair: the star of one spoke."""
