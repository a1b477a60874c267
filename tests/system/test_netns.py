"""The shaped link the transport tests and benchmarks use: two namespaces, a veth pair, tc
tbf. A transfer across it runs at the configured rate."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvstreamd.lab import netns

ok, why = netns.available()
pytestmark = [pytest.mark.system,  # network namespaces (root)
              pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here: {why}")]

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9100)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.sendall(b"x" * int(sys.argv[1])); c.close()
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 9100), timeout=30)
t = time.perf_counter(); n = 0
while chunk := c.recv(1 << 20):
    n += len(chunk)
print(n, time.perf_counter() - t)
"""


def transfer(link: netns.Link, nbytes: int) -> float:
    """Bytes from a to b; returns Mbit/s measured by the receiver."""
    server = link.popen("a", [sys.executable, "-c", SERVER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(link.command("b", [sys.executable, "-c", CLIENT, link.addr["a"]]),
                             capture_output=True, text=True, timeout=60, check=True).stdout.split()
    finally:
        server.wait(timeout=30)
    assert int(out[0]) == nbytes
    return nbytes * 8 / float(out[1]) / 1e6


def test_shaped_link_runs_at_its_rate_and_can_be_reshaped():
    with netns.Link(rate_mbit=40) as link:
        got = transfer(link, 5_000_000)
        assert 0.8 * 40 < got < 1.1 * 40
        link.shape(120)
        got = transfer(link, 12_000_000)
        assert 0.8 * 120 < got < 1.1 * 120


def test_namespaces_are_removed_on_exit():
    with netns.Link() as link:
        names = set(link.ns.values())
        assert names <= set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not names & set(left)
