"""Test hosts on one machine: two network namespaces joined by a veth pair whose egress is
shaped with tc tbf, so transfers see a real bandwidth limit (DESIGN.md section 6).

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
        if name.startswith("kvs") and name[-1:] in ("a", "b") and name[3:-1].isdigit():
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
class Link:
    """Hosts `a` (192.0.2.1) and `b` (192.0.2.2), each in its own namespace, joined by a veth
    pair. `shape(mbit)` limits both directions; call it again to change the rate mid-run."""

    tag: str = field(default_factory=lambda: f"kvs{os.getpid()}")
    rate_mbit: float | None = None

    @property
    def ns(self) -> dict[str, str]:
        return {"a": f"{self.tag}a", "b": f"{self.tag}b"}

    @property
    def dev(self) -> dict[str, str]:
        return {"a": f"{self.tag}va", "b": f"{self.tag}vb"}

    @property
    def addr(self) -> dict[str, str]:
        return {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}

    def up(self) -> "Link":
        remove_stale()
        for side in "ab":
            _run("ip", "netns", "add", self.ns[side])
        try:
            _run("ip", "link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
            for side in "ab":
                ns, dev = self.ns[side], self.dev[side]
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate_mbit:
                self.shape(self.rate_mbit)
        except Exception:
            self.down()
            raise
        return self

    def shape(self, mbit: float) -> None:
        """Token-bucket limit (see tbf) on both directions."""
        for side in "ab":
            _run("tc", "-n", self.ns[side], "qdisc", "replace", "dev", self.dev[side], "root", *tbf(mbit))
        self.rate_mbit = mbit

    def unshape(self) -> None:
        for side in "ab":
            subprocess.run(["tc", "-n", self.ns[side], "qdisc", "del", "dev", self.dev[side], "root"],
                           capture_output=True)
        self.rate_mbit = None

    def command(self, side: str, argv: list[str]) -> list[str]:
        """argv run inside host `side`'s namespace."""
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def popen(self, side: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(side, argv), **kwargs)

    def down(self) -> None:
        for side in "ab":  # deleting a namespace destroys the veth end inside it
            subprocess.run(["ip", "netns", "del", self.ns[side]], capture_output=True)

    def __enter__(self) -> "Link":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
