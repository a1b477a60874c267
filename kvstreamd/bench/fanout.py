"""`kvstreamd bench fanout`: one context pulled from several holders at once. A hub host and
HOLDERS holder hosts, each holder joined to the hub by a tbf-shaped link of its own
(netns.Star), every host a real daemon process in its own namespace. The real model prefills
a WikiText-2 document; its KV is put on every holder at one level. In the hub two fetching
daemons run side by side, one peered with a single holder and one with all of them (their
stores have no budget, so neither keeps what it fetched and every run moves the whole
context); they fetch the context alternately at exactly that level (the sender's level choice
would otherwise spend the extra bandwidth on quality, not time). Reported: the median fetch
time of each, and their ratio (the floor: <= 0.4 with three holders). Then a fetch from all
holders during which one of them is SIGKILLed halfway: every chunk must still arrive as KV."""
from __future__ import annotations

import statistics
import tempfile
import threading
from pathlib import Path

from . import prefilled_document, profile_keys, timed_fetch, write_json
from ..lab import netns
from ..lab.daemons import DaemonProcess, wait_for

HOLDERS = 3
RATIO_FLOOR = 0.4
CHUNK_TOKENS = 256  # 16 chunks of a 4096-token context: shares of a sixteenth each


def run(tokens: int = 4096, bandwidth_mbit: float = 100.0, runs: int = 5, level: str = "high",
        holders: int = HOLDERS, model: str | None = None, json_path: str | None = None, log=print,
        profile: str | None = None) -> dict:
    ok, why = netns.available()
    if not ok:
        raise RuntimeError(f"bench fanout needs network namespaces: {why}")
    lm, doc, kv = prefilled_document(model, tokens, log)
    profiled = profile_keys(lm.model_id, profile)
    spokes = tuple("bcdefgh"[:holders])
    star = netns.Star(spokes=spokes, rate_mbit=bandwidth_mbit).up()
    extra = {"codec": {"chunk_tokens": CHUNK_TOKENS, "levels": [level], **profiled}}
    fetcher_extra = {**extra, "store": {"memory_budget": 0, "disk_budget": 0}}
    report: dict = {"model": lm.model_id, "tokens": tokens, "bandwidth_mbit": bandwidth_mbit, "level": level,
                    "holders": holders, "chunk_tokens": CHUNK_TOKENS, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="kvstreamd-fanout-") as tmp:
        root = Path(tmp)
        hs = [DaemonProcess(f"holder-{s}", root / s, host=star.addr[s], netns=star.command(s, []), extra=extra)
              for s in spokes]
        one = DaemonProcess("fetch-one", root / "one", host="0.0.0.0", netns=star.command("a", []),
                            peers=[hs[0].addr], extra=fetcher_extra)
        every = DaemonProcess("fetch-all", root / "all", host="0.0.0.0", netns=star.command("a", []),
                              peers=[h.addr for h in hs], extra=fetcher_extra)
        nodes = [*hs, one, every]
        try:
            for n in nodes:
                n.start(wait=0)
            for n in nodes:
                n.wait_healthy(240)
            for h in hs:
                log(f"putting the context on {h.name}")
                h.client().put(lm.model_id, doc, kv)
            chunks = -(-tokens // CHUNK_TOKENS)
            wait_for(lambda: every.client().lookup(lm.model_id, doc)["peers"] == {h.name: tokens for h in hs}
                     and one.client().lookup(lm.model_id, doc)["peers"] == {hs[0].name: tokens},
                     timeout=60, what="the fetchers to learn the holders' keys")
            timed_fetch(one, lm.model_id, doc, level)  # warm-up: each link probed once, codec tables built
            timed_fetch(every, lm.model_id, doc, level)
            rows = {"one": [], "all": []}
            for r in range(runs):
                rows["one"].append(timed_fetch(one, lm.model_id, doc, level))
                rows["all"].append(timed_fetch(every, lm.model_id, doc, level))
                log(f"run {r + 1}/{runs}: one holder {rows['one'][-1]['seconds']:.3f} s, "
                    f"{holders} holders {rows['all'][-1]['seconds']:.3f} s {rows['all'][-1]['by_source']}")
            med = {k: statistics.median(x["seconds"] for x in v) for k, v in rows.items()}
            report.update(rows=rows, median_s=med, ratio=med["all"] / med["one"],
                          complete=all(x["kv_chunks"] == chunks for v in rows.values() for x in v))
            victim = hs[1]
            timer = threading.Timer(med["all"] / 2, victim.kill)
            timer.start()
            killed = timed_fetch(every, lm.model_id, doc, level)
            timer.join()
            report["kill"] = {**killed, "killed": victim.name, "after_s": med["all"] / 2,
                              "lost_chunks": chunks - killed["kv_chunks"]}
            log(f"{victim.name} SIGKILLed after {med['all'] / 2:.3f} s: {killed['kv_chunks']}/{chunks} chunks as KV "
                f"in {killed['seconds']:.3f} s {killed['by_source']}")
        finally:
            for n in nodes:
                n.kill()
            star.down()
    report["floors"] = {"ratio": report["ratio"] <= RATIO_FLOOR, "complete": report["complete"],
                        "kill_costs_no_chunk": report["kill"]["lost_chunks"] == 0}
    write_json(report, json_path)
    return report


def table(report: dict) -> str:
    m = report["median_s"]
    k = report["kill"]
    return "\n".join([
        f"{report['tokens']} tokens of {report['model']} at {report['level']}, {report['chunk_tokens']}-token chunks, "
        f"each holder behind {report['bandwidth_mbit']:g} Mbit/s; median of {report['runs']}",
        f"  one holder:   {m['one']:.3f} s",
        f"  {report['holders']} holders:    {m['all']:.3f} s   ratio {report['ratio']:.3f} "
        f"(floor <= {RATIO_FLOOR}: {'ok' if report['floors']['ratio'] else 'MISSED'})",
        f"  {k['killed']} SIGKILLed after {k['after_s']:.3f} s: {k['lost_chunks']} chunks lost, "
        f"{k['seconds']:.3f} s, by source {k['by_source']}"])
