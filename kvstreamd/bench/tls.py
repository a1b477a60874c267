"""`kvstreamd bench tls`: peer-link throughput with and without TLS, side by side, over a
tbf-shaped veth link between two network namespaces (kvstreamd/lab/netns.py; 1 Gbit/s by
default). Each run is two processes, one per test host: `serve` answers one FETCH with the
daemon's own send loop (transport.send.send_chunks, one fixed level, two chunks on the wire,
ACK-paced), `fetch` dials it with transport.aio on uvloop, as the daemon does, and times the
chunks' arrival. Plaintext and TLS runs alternate, so a busy machine slows both alike; the
report keeps each mode's median and the ratio TLS / plaintext."""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transport import aio, tls
from transport.messages import Fetch
from transport.bandwidth import BandwidthEstimator
from transport.policy import fixed_rule
from transport.send import send_chunks

from . import link_peer_parser, write_json
from ..lab import netns

PORT = 9410
LEVEL = "high"  # the level name the chunks carry; the payload is random bytes (it does not compress)


def _contexts(args) -> tls.PeerTLS | None:
    return tls.contexts(args.cert, args.key, args.ca) if args.cert else None


async def _serve(args) -> None:
    payload = os.urandom(args.chunk_bytes)
    t = _contexts(args)
    done = asyncio.get_running_loop().create_future()

    async def handler(served: aio.ServedFetch, fetch) -> None:
        n = len(fetch.keys)
        est = BandwidthEstimator()
        await send_chunks(served, {LEVEL: [len(payload)] * n}, lambda i, lv: payload, lambda i: [],
                          fixed_rule(LEVEL), est, {LEVEL: 0.0}, {LEVEL: 0.0})
        if not done.done():
            done.set_result(None)

    server = await aio.serve(args.host, args.port, "bench-sender", bytes.fromhex(args.secret), handler,
                             ssl=t.server if t else None)
    print("ready", flush=True)
    cpu0 = time.process_time()  # from the ready line: the transfer, not the imports
    await done
    cpu = time.process_time() - cpu0
    await asyncio.sleep(0.2)  # the END on its way
    print(json.dumps({"cpu_s": cpu}), flush=True)
    server.close()


async def _fetch(args) -> None:
    t = _contexts(args)
    loop = asyncio.get_running_loop()
    peer = await aio.connect(args.addr, args.port, "bench-receiver", bytes.fromhex(args.secret),
                             ssl=t.client if t else None)
    keys = [i.to_bytes(32, "big") for i in range(args.chunks)]
    t0, cpu0 = loop.time(), time.process_time()
    nbytes = 0
    async for msg in peer.fetch(Fetch.ask(keys, 600_000, [LEVEL])):
        nbytes += len(msg.payload)
    seconds, cpu = loop.time() - t0, time.process_time() - cpu0
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "mbit_s": nbytes * 8 / seconds / 1e6, "receiver_cpu_s": cpu,
                      "tls": peer.tls, "cipher": (peer._transport.get_extra_info("cipher") or [None])[0]}),  # noqa: SLF001
          flush=True)
    peer.close()
    await peer.wait_closed()


def one_run(link: netns.Link, certs: dict | None, chunks: int, chunk_bytes: int, timeout: float = 300) -> dict:
    secret = os.urandom(16).hex()
    me = [sys.executable, "-m", "kvstreamd.bench.tls"]
    common = ["--secret", secret, "--port", str(PORT), "--chunks", str(chunks), "--chunk-bytes", str(chunk_bytes)]
    tls_a = ["--cert", str(certs["a"].cert), "--key", str(certs["a"].key), "--ca", str(certs["a"].ca)] if certs else []
    tls_b = ["--cert", str(certs["b"].cert), "--key", str(certs["b"].key), "--ca", str(certs["b"].ca)] if certs else []
    server = link.popen("a", me + ["serve", *common, *tls_a], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the sender did not start")
        out = subprocess.run(link.command("b", me + ["fetch", *common, *tls_b, "--addr", link.addr["a"]]),
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"the receiver failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        tail = server.stdout.readline().strip()
        result["sender_cpu_s"] = json.loads(tail)["cpu_s"] if tail else None
        return result
    finally:
        server.kill()
        server.wait()


def run(bandwidth_mbit: float = 1000, runs: int = 5, mib: int = 256, chunk_mib: int = 4,
        json_path: str | None = None, log=print) -> dict:
    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"bench tls needs network namespaces: {why}")
    from ..lab.certs import CA

    chunk_bytes = chunk_mib * 2**20
    chunks = max(1, mib // chunk_mib)
    results: dict[str, list[dict]] = {"plaintext": [], "tls": []}
    with tempfile.TemporaryDirectory() as d, netns.Link(rate_mbit=bandwidth_mbit) as link:
        ca = CA(Path(d), cn="kvstreamd bench CA")
        certs = {"a": ca.host("a", (link.addr["a"],)), "b": ca.host("b", (link.addr["b"],))}
        one_run(link, certs, 2, chunk_bytes)  # warm-up (page cache, first imports), not kept
        for r in range(runs):
            for mode in ("plaintext", "tls") if r % 2 == 0 else ("tls", "plaintext"):
                got = one_run(link, certs if mode == "tls" else None, chunks, chunk_bytes)
                results[mode].append(got)
                log(f"  run {r + 1}/{runs} {mode:9s} {got['mbit_s']:7.1f} Mbit/s  {got['seconds']:.2f} s  CPU s "
                    f"sender {got['sender_cpu_s']:.2f} receiver {got['receiver_cpu_s']:.2f}  {got['tls'] or ''}")
    med = {m: statistics.median(x["mbit_s"] for x in rs) for m, rs in results.items()}
    report = {"bandwidth_mbit": bandwidth_mbit, "bytes_per_run": chunks * chunk_bytes, "chunk_bytes": chunk_bytes,
              "runs": runs, "cpus": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
              "median_mbit_s": {m: round(v, 1) for m, v in med.items()},
              "tls_over_plaintext": round(med["tls"] / med["plaintext"], 3),
              # CPU seconds per GiB moved, each end (what TLS costs where the link is not the limit)
              "cpu_s_per_gib": {m: {end: round(statistics.median(x[f"{end}_cpu_s"] for x in rs) * 2**30
                                              / (chunks * chunk_bytes), 2) for end in ("sender", "receiver")}
                                for m, rs in results.items()},
              "tls_version": results["tls"][0]["tls"], "cipher": results["tls"][0]["cipher"],
              "runs_mbit_s": {m: [round(x["mbit_s"], 1) for x in rs] for m, rs in results.items()}}
    report["within_10_percent"] = report["tls_over_plaintext"] >= 0.9
    write_json(report, json_path)
    return report


def summary(report: dict) -> str:
    m, c = report["median_mbit_s"], report["cpu_s_per_gib"]
    return (f"{report['bandwidth_mbit']:g} Mbit/s link, {report['bytes_per_run'] / 2**20:.0f} MiB per run in "
            f"{report['chunk_bytes'] / 2**20:.0f} MiB chunks, median of {report['runs']}:\n"
            f"  plaintext {m['plaintext']:.1f} Mbit/s\n"
            f"  TLS       {m['tls']:.1f} Mbit/s ({report['tls_version']}, {report['cipher']})\n"
            f"  CPU s per GiB (sender, receiver): plaintext {c['plaintext']['sender']}, {c['plaintext']['receiver']}; "
            f"TLS {c['tls']['sender']}, {c['tls']['receiver']}\n"
            f"  TLS / plaintext = {report['tls_over_plaintext']:.3f} "
            f"({'within' if report['within_10_percent'] else 'NOT within'} 10%)")


def main(argv: list[str] | None = None) -> int:
    p = link_peer_parser("python -m kvstreamd.bench.tls", ["serve", "fetch"], PORT)
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--ca")
    args = p.parse_args(argv)
    aio.run(_serve(args) if args.role == "serve" else _fetch(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
