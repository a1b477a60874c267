"""`kvstreamd bench prefetch`: what a user fetch pays while a prefetch runs on its node. Two
hosts, two network namespaces joined by a tbf-shaped veth pair, a real daemon process in each:
a holds three contexts, b fetches them. The real model prefills a WikiText-2 document: z, the
user's context. y, the context b prefetches, is longer (PREFETCH_TIMES z's length, its KV z's
repeated under tokens of its own: only its bytes on the link matter here, and its keys, at
positions they were not made at, code ~2.5x larger than z's: a harder case, a bigger chunk on
the link ahead of the user's when it starts); x, one chunk, is what
b's user fetched before y once, so that b learns y follows x.

Runs alternate: a fetch of z alone, then one that starts while y's prefetch is in flight (b has
just fetched x; the prefetch has taken a chunk; y cannot be done before z's fetch ends). Both
fetch z at exactly one level with a long deadline, so both move the same bytes, and b keeps
nothing a user fetch brings (each one crosses the link). Reported: each kind's median seconds
and their ratio; the floor: <= 1.10. Between runs y is deleted from b and fetched there once
(a user used it), so that b prefetches it again."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from . import prefilled_document, profile_keys, timed_fetch, write_json
from kvstreamd.store.keys import chunk_keys
from ..lab import netns
from ..lab.daemons import DaemonProcess, wait_for

RATIO_FLOOR = 1.10
CHUNK_TOKENS = 256
PREFETCH_TIMES = 4  # y is this many times z's tokens: its prefetch outlasts z's fetch
WINDOW_S = 0.5  # [prefetch] window_s on b: z, fetched later than this after x, is not learnt as x's successor


def _prefetch(d: DaemonProcess) -> dict:
    return d.client().status()["prefetch"]


def _metric(d: DaemonProcess, name: str) -> float:
    for line in d.client().metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run(tokens: int = 4096, bandwidth_mbit: float = 100.0, runs: int = 5, level: str = "high",
        model: str | None = None, json_path: str | None = None, log=print, profile: str | None = None) -> dict:
    ok, why = netns.available()
    if not ok:
        raise RuntimeError(f"bench prefetch needs network namespaces: {why}")
    lm, z, kv = prefilled_document(model, tokens, log)
    profiled = profile_keys(lm.model_id, profile)
    y = [1_000_000 + i for i in range(PREFETCH_TIMES * len(z))]
    y_kv = kv.repeat(1, 1, PREFETCH_TIMES, 1, 1)
    x = [2_000_000 + i for i in range(CHUNK_TOKENS)]
    x_kv = kv[:, :, :CHUNK_TOKENS]
    y_last = chunk_keys(lm.model_id, y, CHUNK_TOKENS)[-1].hex()
    link = netns.Link(rate_mbit=bandwidth_mbit).up()
    codec = {"chunk_tokens": CHUNK_TOKENS, "levels": [level], **profiled}
    report: dict = {"model": lm.model_id, "tokens": tokens, "prefetch_tokens": len(y), "bandwidth_mbit": bandwidth_mbit,
                    "level": level, "chunk_tokens": CHUNK_TOKENS, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="kvstreamd-prefetch-") as tmp:
        root = Path(tmp)
        a = DaemonProcess("a", root / "a", host=link.addr["a"], netns=link.command("a", []), extra={"codec": codec})
        b = DaemonProcess("b", root / "b", host=link.addr["b"], netns=link.command("b", []),
                          extra={"codec": codec, "store": {"keep_fetched": False},
                                 "prefetch": {"enabled": True, "min_count": 1, "max_successors": 1,
                                              "window_s": WINDOW_S}})
        a.peers, b.peers = [b.addr], [a.addr]
        try:
            for n in (a, b):
                n.start(wait=0)
            for n in (a, b):
                n.wait_healthy(240)
            log("putting x, y and z on a")
            for tok, k in ((x, x_kv), (y, y_kv), (z, kv)):
                a.client().put(lm.model_id, tok, k)
            wait_for(lambda: b.client().lookup(lm.model_id, y)["peers"].get("a") == len(y), timeout=60,
                     what="b to learn a's keys")
            timed_fetch(b, lm.model_id, x, level)  # y follows x, once
            timed_fetch(b, lm.model_id, y, level)
            timed_fetch(b, lm.model_id, z, level)  # warm-up: the link probed, the codec tables built
            rows: dict[str, list] = {"alone": [], "prefetching": []}
            for r in range(runs):
                time.sleep(WINDOW_S + 0.2)
                rows["alone"].append(timed_fetch(b, lm.model_id, z, level))
                before = _metric(b, "kvstreamd_prefetch_bytes_total")
                time.sleep(WINDOW_S + 0.2)
                timed_fetch(b, lm.model_id, x, level)  # y's prefetch starts
                wait_for(lambda: _metric(b, "kvstreamd_prefetch_bytes_total") > before, timeout=30, interval=0.01,
                         what="y's prefetch to take a chunk")
                time.sleep(WINDOW_S + 0.1)
                row = timed_fetch(b, lm.model_id, z, level)
                row["prefetch_in_flight_after"] = _prefetch(b)["running"] is not None
                rows["prefetching"].append(row)
                wait_for(lambda: (p := _prefetch(b))["running"] is None and p["queued"] == 0, timeout=300,
                         what="y's prefetch to finish")
                time.sleep(WINDOW_S + 0.2)
                timed_fetch(b, lm.model_id, y, level)  # used (local now): b may prefetch it again
                b.client().delete_context(y_last)
                log(f"run {r + 1}/{runs}: z alone {rows['alone'][-1]['seconds']:.3f} s, while y is prefetched "
                    f"{row['seconds']:.3f} s (prefetch still in flight after it: {row['prefetch_in_flight_after']})")
            med = {k: statistics.median(v["seconds"] for v in rows_) for k, rows_ in rows.items()}
            report.update(rows=rows, median_s=med, ratio=med["prefetching"] / med["alone"],
                          prefetch_bytes=_metric(b, "kvstreamd_prefetch_bytes_total"),
                          prefetch_yields=_metric(b, "kvstreamd_prefetch_yields_total"),
                          overlapped=all(v["prefetch_in_flight_after"] for v in rows["prefetching"]))
        finally:
            for n in (a, b):
                n.kill()
            link.down()
    report["floors"] = {"ratio": report["ratio"] <= RATIO_FLOOR, "overlapped": report["overlapped"]}
    write_json(report, json_path)
    return report


def table(report: dict) -> str:
    m = report["median_s"]
    return "\n".join([
        f"user fetch of {report['tokens']} tokens of {report['model']} at {report['level']}, "
        f"{report['chunk_tokens']}-token chunks, over {report['bandwidth_mbit']:g} Mbit/s; median of {report['runs']}",
        f"  alone:                         {m['alone']:.3f} s",
        f"  while {report['prefetch_tokens']} tokens are prefetched: {m['prefetching']:.3f} s   ratio "
        f"{report['ratio']:.3f} (floor <= {RATIO_FLOOR}: {'ok' if report['floors']['ratio'] else 'MISSED'})",
        f"  prefetch in flight across every such fetch: {report['overlapped']}; yields {report['prefetch_yields']:g}, "
        f"{report['prefetch_bytes'] / 1e6:.1f} MB prefetched"])
