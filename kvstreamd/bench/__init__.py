"""Benchmarks: each writes JSON and prints the table that docs/benchmarks.md carries."""
from __future__ import annotations

import argparse


def link_peer_parser(prog: str, roles: list[str], port: int) -> argparse.ArgumentParser:
    """The command line of a link benchmark's two ends (run inside its namespaces): role, the
    cluster secret, where to listen or dial, and the chunks to move."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("role", choices=roles)
    p.add_argument("--secret", required=True, help="hex")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--addr")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--chunks", type=int, required=True)
    p.add_argument("--chunk-bytes", type=int, required=True)
    return p
