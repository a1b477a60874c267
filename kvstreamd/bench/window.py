"""`kvstreamd bench window`: a long, fat link, with the old fixed window of two chunks in
flight and with the window sized from the bandwidth-delay product, side by side.

Two test hosts (network namespaces, kvstreamd/lab/netns.py) joined by a tbf-shaped veth link
(1 Gbit/s by default); in host a a delaying relay (kvstreamd/lab/relay.py, 50 ms each way by
default) stands in front of the sender's port, so the fetcher in host b reaches the sender
over the shaped link and a 100 ms round trip. Each run is two processes: `serve` answers
FETCHes with the daemon's own send loop (transport.send.send_chunks: one fixed level,
random payloads, so every run moves the same bytes), `fetch` dials it with transport.aio on
uvloop, as the daemon does, and times two fetches of the same chunks on one connection:
`cold` (a link the sender never measured: a probe first) and `warm` (the sender has the
link's history, as a daemon's PeerBandwidth keeps it). The two windows alternate run by run,
so a busy machine slows both alike; the report keeps the medians.

Fetch time runs from just before the FETCH is written (loop time on the fetcher) to the
arrival of the last CHUNK (when the transport hands it to the fetcher's loop); link
utilisation = payload bytes x 8 / (fetch time x link rate). A raw byte transfer through the
relay (`raw-serve`/`raw-fetch`) measures what the relay and link carry by themselves."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from transport import aio
from transport.messages import Fetch
from transport.bandwidth import BandwidthEstimator
from transport.policy import fixed_rule
from transport.send import MIN_WINDOW, send_chunks

from . import link_peer_parser, write_json
from ..lab import netns

PORT = 9420  # the sender, on host a's loopback: reachable only through the relay
RELAY_PORT = 9421  # the relay, on host a's link address
LEVEL = "high"  # the level name the chunks carry; the payload is random bytes (it does not compress)


# -- the two ends of a run (each a process in its own namespace) -------------------------------

async def _serve(args) -> None:
    payload = os.urandom(args.chunk_bytes)
    estimator = BandwidthEstimator()  # one peer: kept across its fetches, as PeerBandwidth does
    fetches = 0
    done = asyncio.get_running_loop().create_future()

    async def handler(served: aio.ServedFetch, fetch) -> None:
        nonlocal fetches
        n = len(fetch.keys)
        sent = await send_chunks(served, {LEVEL: [len(payload)] * n}, lambda i, lv: payload, lambda i: [],
                                 fixed_rule(LEVEL), estimator, {LEVEL: 0.0}, {LEVEL: 0.0},
                                 window=args.window or None)
        est = estimator.estimate()
        print(json.dumps({"max_inflight": sent.max_inflight, "windows": list(sent.windows),
                          "estimate_mbit": round(est * 8 / 1e6, 1) if est else None,
                          "rtt_ms": round(served.peer.rtt * 1000, 2) if served.peer.rtt else None}), flush=True)
        fetches += 1
        if fetches == args.fetches and not done.done():
            done.set_result(None)

    server = await aio.serve(args.host, args.port, "bench-sender", bytes.fromhex(args.secret), handler)
    print("ready", flush=True)
    await done
    await asyncio.sleep(0.3)  # the END on its way through the relay
    server.close()


async def _fetch(args) -> None:
    loop = asyncio.get_running_loop()
    peer = await aio.connect(args.addr, args.port, "bench-receiver", bytes.fromhex(args.secret))
    out = {}
    for name in ("cold", "warm"):
        keys = [(name + str(i)).encode().ljust(32, b".") for i in range(args.chunks)]
        nbytes = 0
        t0 = loop.time()
        last = t0
        arrivals = []
        async for msg in peer.fetch(Fetch.ask(keys, 600_000, [LEVEL])):
            nbytes += len(msg.payload)
            last = loop.time()
            arrivals.append(round((last - t0) * 1000, 1))
        out[name] = {"seconds": last - t0, "bytes": nbytes, "arrivals_ms": arrivals}
    print(json.dumps(out), flush=True)
    peer.close()
    await peer.wait_closed()


def _raw_serve(args) -> None:
    """Answer one connection: read the 8-byte count, send that many random bytes, close."""
    block = os.urandom(1 << 20)
    with socket.create_server((args.host, args.port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            want = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
            view = memoryview(block)
            while want > 0:
                n = min(want, len(block))
                conn.sendall(view[:n])
                want -= n


def _raw_fetch(args) -> None:
    total = args.chunks * args.chunk_bytes
    with socket.create_connection((args.addr, args.port)) as s:
        t0 = time.monotonic()
        s.sendall(total.to_bytes(8, "big"))
        got, first = 0, None
        buf = bytearray(1 << 20)
        while got < total:
            n = s.recv_into(buf)
            if not n:
                break
            if first is None:
                first = time.monotonic()
            got += n
        last = time.monotonic()
    print(json.dumps({"bytes": got, "first_byte_s": first - t0, "seconds": last - t0,
                      "mbit_s": got * 8 / (last - first) / 1e6}), flush=True)


# -- a run, and the report ----------------------------------------------------------------------

def _me() -> list[str]:
    return [sys.executable, "-m", "kvstreamd.bench.window"]


def start_relay(link: netns.Link, delay_ms: float) -> subprocess.Popen:
    relay = link.popen("a", [sys.executable, "-m", "kvstreamd.lab.relay", "--listen", f"{link.addr['a']}:{RELAY_PORT}",
                             "--to", f"127.0.0.1:{PORT}", "--delay-ms", str(delay_ms)],
                       stdout=subprocess.PIPE, text=True)
    if relay.stdout.readline().strip() != "ready":
        relay.kill()
        raise RuntimeError("the relay did not start")
    return relay


def one_run(link: netns.Link, window: int, chunks: int, chunk_bytes: int, timeout: float = 120) -> dict:
    """One sender and one fetcher through the running relay: a cold fetch, then a warm one.
    `window` 0: the bandwidth-delay product's; else that many chunks in flight."""
    secret = os.urandom(16).hex()
    common = ["--secret", secret, "--chunks", str(chunks), "--chunk-bytes", str(chunk_bytes)]
    server = link.popen("a", _me() + ["serve", *common, "--host", "127.0.0.1", "--port", str(PORT),
                                      "--window", str(window), "--fetches", "2"], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the sender did not start")
        out = subprocess.run(link.command("b", _me() + ["fetch", *common, "--addr", link.addr["a"],
                                                        "--port", str(RELAY_PORT)]),
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"the fetcher failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        for name in ("cold", "warm"):
            line = server.stdout.readline().strip()
            result[name]["sender"] = json.loads(line) if line else None
        return result
    finally:
        server.kill()
        server.wait()


def raw_run(link: netns.Link, chunks: int, chunk_bytes: int, timeout: float = 120) -> dict:
    """The same bytes as one fetch, as a bare TCP stream through the relay and the link."""
    common = ["--secret", "00", "--chunks", str(chunks), "--chunk-bytes", str(chunk_bytes)]
    server = link.popen("a", _me() + ["raw-serve", *common, "--host", "127.0.0.1", "--port", str(PORT)],
                        stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the raw sender did not start")
        out = subprocess.run(link.command("b", _me() + ["raw-fetch", *common, "--addr", link.addr["a"],
                                                        "--port", str(RELAY_PORT)]),
                             capture_output=True, text=True, timeout=timeout, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.kill()
        server.wait()


def _utilisation(r: dict, mbit: float) -> float:
    return r["bytes"] * 8 / (r["seconds"] * mbit * 1e6)


def run(bandwidth_mbit: float = 1000, delay_ms: float = 50, chunks: int = 16, chunk_mib: float = 4,
        runs: int = 5, json_path: str | None = None, log=print) -> dict:
    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"bench window needs network namespaces: {why}")
    chunk_bytes = int(chunk_mib * 2**20)
    modes = {f"fixed {MIN_WINDOW}": MIN_WINDOW, "bdp": 0}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    raw = []
    with netns.Link(rate_mbit=bandwidth_mbit) as link:
        relay = start_relay(link, delay_ms)
        try:
            for r in range(3):
                raw.append(raw_run(link, chunks, chunk_bytes))
                log(f"  raw through the relay: {raw[-1]['mbit_s']:7.1f} Mbit/s, first byte after "
                    f"{raw[-1]['first_byte_s'] * 1000:.1f} ms")
            one_run(link, 0, 2, chunk_bytes)  # warm-up (page cache, first imports), not kept
            for r in range(runs):
                for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                    got = one_run(link, modes[mode], chunks, chunk_bytes)
                    results[mode].append(got)
                    log(f"  run {r + 1}/{runs} {mode:8s} cold {got['cold']['seconds']:.3f} s "
                        f"({_utilisation(got['cold'], bandwidth_mbit):.0%})  warm {got['warm']['seconds']:.3f} s "
                        f"({_utilisation(got['warm'], bandwidth_mbit):.0%})  windows {got['warm']['sender']['windows']}")
        finally:
            relay.kill()
            relay.wait()
    link_s = chunks * chunk_bytes * 8 / (bandwidth_mbit * 1e6)
    rtt_s = 2 * delay_ms / 1000
    report = {"bandwidth_mbit": bandwidth_mbit, "delay_ms_each_way": delay_ms, "chunks": chunks,
              "chunk_bytes": chunk_bytes, "bytes_per_fetch": chunks * chunk_bytes, "runs": runs,
              "cpus": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
              "measured": "fetch time: fetcher loop time from just before the FETCH is written to the last CHUNK's "
                          "arrival; utilisation = payload bytes x 8 / (fetch time x link rate)",
              "ideal_seconds": {"cold": round(2 * rtt_s + link_s, 3), "warm": round(rtt_s + link_s, 3)},
              "raw_relay": {"median_mbit_s": round(statistics.median(x["mbit_s"] for x in raw), 1),
                            "min_first_byte_ms": round(min(x["first_byte_s"] for x in raw) * 1000, 1),
                            "runs_mbit_s": [round(x["mbit_s"], 1) for x in raw]},
              "windows": {}}
    for mode, rs in results.items():
        entry = {}
        for name in ("cold", "warm"):
            secs = statistics.median(x[name]["seconds"] for x in rs)
            util = statistics.median(_utilisation(x[name], bandwidth_mbit) for x in rs)
            entry[name] = {"median_seconds": round(secs, 3), "median_utilisation": round(util, 3),
                           "round_trips": round(secs / rtt_s, 1),  # fetch time in round trips (link time included)
                           "max_inflight": max(x[name]["sender"]["max_inflight"] for x in rs),
                           "windows": rs[len(rs) // 2][name]["sender"]["windows"],
                           "sender_estimate_mbit": rs[len(rs) // 2][name]["sender"]["estimate_mbit"],
                           "sender_rtt_ms": rs[len(rs) // 2][name]["sender"]["rtt_ms"],
                           "runs_seconds": [round(x[name]["seconds"], 3) for x in rs]}
        report["windows"][mode] = entry
    report["floor_80_percent_warm"] = report["windows"]["bdp"]["warm"]["median_utilisation"] >= 0.8
    write_json(report, json_path)
    return report


def summary(report: dict) -> str:
    rows = [f"{report['bandwidth_mbit']:g} Mbit/s link, {report['delay_ms_each_way']:g} ms added each way, "
            f"{report['chunks']} chunks of {report['chunk_bytes'] / 2**20:g} MiB, median of {report['runs']}; "
            f"raw TCP through the relay {report['raw_relay']['median_mbit_s']} Mbit/s",
            "| window | fetch | seconds | link utilisation | fetch time in RTTs | most chunks in flight |",
            "|---|---|---|---|---|---|"]
    for mode, entry in report["windows"].items():
        for name in ("cold", "warm"):
            e = entry[name]
            rows.append(f"| {mode} | {name} | {e['median_seconds']:.3f} | {e['median_utilisation']:.1%} | "
                        f"{e['round_trips']} | {e['max_inflight']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = link_peer_parser("python -m kvstreamd.bench.window", ["serve", "fetch", "raw-serve", "raw-fetch"], PORT)
    p.add_argument("--window", type=int, default=0, help="chunks in flight; 0: from the bandwidth-delay product")
    p.add_argument("--fetches", type=int, default=2, help="serve: exit after this many")
    args = p.parse_args(argv)
    if args.role == "raw-serve":
        _raw_serve(args)
    elif args.role == "raw-fetch":
        _raw_fetch(args)
    else:
        aio.run(_serve(args) if args.role == "serve" else _fetch(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
