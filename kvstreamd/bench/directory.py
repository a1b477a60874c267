"""`kvstreamd bench directory`: the Redis directory's figures with DAEMONS real daemon processes
on one real redis-server (started on a free port in a temp folder, stopped at the end), every
daemon `[directory] backend = "redis"` and peered with no one. The KV is small synthetic KV
(bench gpu's SyntheticKV in a 3-layer shape): what is measured is the directory, not the codec.

In order, each figure polled every POLL_S through the daemons' own lookups:
- connections: every node's peer connections before any fetch (floor: none);
- found: PUTS contexts, each put on a different node; from each put's reply, the seconds until
  each other node's lookup finds it (the reply of the first lookup that does; floor <= 1 s);
- calls: EVALSHAs the server runs per lookup (floor: 1, a prompt's key chain in one round trip);
- connections after one fetch (one node fetches the first context from its holder): only the
  fetcher and the holder are connected, to each other;
- gone: that holder SIGKILLed; seconds until a lookup no longer lists it (the reply of the first
  that does not). Its lease ran out between the send of the last lookup that listed it and that
  reply; the floor: no lookup sent later than lease_s after the kill lists it;
- back: redis-server stopped for OUTAGE_S (a context is put meanwhile, stored locally) and
  started again, empty; from its restart, the seconds until every live node's lookup finds the
  outage's context (which no node but its holder had looked up, so no node's memory of earlier
  lookups can answer it), and until Redis lists every holder of every context again (floor:
  both <= 5 s)."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from codec import profile as profiles

from . import write_json
from ..lab import redisserver
from ..lab.daemons import DaemonProcess, seconds_until
from ..lab.redisserver import RedisServer
from .gpu import SOURCE_PROFILE, SyntheticKV
from .scale import fitted_profile

SHAPE = (3, 2, 8)  # layers, KV heads, head dim: KV small enough that a put costs next to nothing
CHUNK_TOKENS = 256
TOKENS = 512  # per context: two chunks, a key chain of two
PREFIX = "kvs-bench:"
POLL_S = 0.02
IDLE_S = 600.0  # the fetch's connection stays up until it is counted
FOUND_FLOOR_S = 1.0
BACK_FLOOR_S = 5.0
DEADLINE_MS = 30_000
CALL_LOOKUPS = 20  # lookups the EVALSHA count is taken over


def run(daemons: int = 16, puts: int = 5, lease_s: float = 10.0, outage_s: float = 10.0,
        json_path: str | None = None, log=print) -> dict:
    if daemons < 3:
        raise ValueError(f"--daemons {daemons}: at least 3 (a holder, a fetcher and a node that looks on)")
    if not 1 <= puts <= daemons:
        raise ValueError(f"--puts {puts}: between 1 and --daemons ({daemons}), each on a different node")
    ok, why = redisserver.available()
    if not ok:
        raise RuntimeError(f"bench directory needs redis-server: {why}")
    synth = SyntheticKV(profiles.Profile.load(SOURCE_PROFILE), *SHAPE, seed=0)
    profile_path, profile, _, _ = fitted_profile(synth, TOKENS, CHUNK_TOKENS, seed=0, log=log)
    model = profile.model_id
    report: dict = {"daemons": daemons, "puts": puts, "lease_s": lease_s, "outage_s": outage_s, "poll_s": POLL_S,
                    "tokens": TOKENS, "chunk_tokens": CHUNK_TOKENS, "model": model,
                    "machine": {"cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]}}
    with tempfile.TemporaryDirectory(prefix="kvstreamd-directory-") as tmp:
        root = Path(tmp)
        server = RedisServer(root / "redis").start()
        directory = {"backend": "redis", "url": server.url, "prefix": PREFIX, "lease_s": lease_s, "idle_s": IDLE_S}
        codec = {"chunk_tokens": CHUNK_TOKENS, "workers": 1, "profile": str(profile_path)}
        nodes = [DaemonProcess(f"n{i:02d}", root / f"n{i:02d}", extra={"codec": codec, "directory": directory})
                 for i in range(daemons)]
        try:
            log(f"starting {daemons} daemons on redis-server at {server.url}")
            for n in nodes:
                n.start(wait=0)
            for n in nodes:
                n.wait_healthy(240)
            report["connections_before"] = _connections(nodes)

            contexts = []  # (holder, tokens, chunk keys)
            found: list[float | None] = []
            for p in range(puts):
                holder = nodes[p * daemons // puts]
                tokens = list(range(10_000 * (p + 1), 10_000 * (p + 1) + TOKENS))
                keys = holder.client().put(model, tokens, synth.kv(0, TOKENS, seed=p))["keys"]
                t0 = time.monotonic()
                found += _each_finds([n for n in nodes if n is not holder], model, tokens, holder.name, t0, 10.0)
                contexts.append((holder, tokens, keys))
                got = [f for f in found[-(daemons - 1):] if f is not None]
                log(f"put {p + 1}/{puts} on {holder.name}: found by {len(got)} of the other {daemons - 1}, "
                    f"the last after {max(got, default=float('nan')):.3f} s")
            report["found"] = _figures(found)

            watcher = next(n for n in nodes if n is not contexts[0][0])
            c0 = server.calls("evalsha")
            for _ in range(CALL_LOOKUPS):
                watcher.client().lookup(model, contexts[0][1])
            report["evalsha_per_lookup"] = (server.calls("evalsha") - c0) / CALL_LOOKUPS

            victim, tokens0, keys0 = contexts[0]
            fetcher = nodes[(nodes.index(victim) + 1) % daemons]
            with fetcher.client().fetch(model, tokens0, deadline_ms=DEADLINE_MS) as f:
                sources = sorted({ev.source for ev in f if ev.kind == "kv"})
            report["fetch"] = {"fetcher": fetcher.name, "holder": victim.name, "sources": sources}
            report["connections_after"] = _connections(nodes)
            watcher = next(n for n in nodes if n not in (victim, fetcher))
            # The fetcher keeps what it fetched and publishes it: it is a holder too by now.
            kept = seconds_until(lambda: watcher.client().lookup(model, tokens0)["peers"].get(fetcher.name) == TOKENS,
                                 timeout=10.0, what=f"{fetcher.name} publishing the chunks it fetched")
            report["fetcher_published_s"] = kept

            log(f"SIGKILL {victim.name}; lease {lease_s:g} s")
            report["gone"] = _gone(victim, watcher, model, tokens0, lease_s)
            live = [n for n in nodes if n is not victim]

            log(f"stopping redis-server for {outage_s:g} s")
            server.stop()
            t_out = time.monotonic()
            outage_node = live[-1]
            tokens_out = list(range(1_000, 1_000 + TOKENS))
            keys_out = outage_node.client().put(model, tokens_out, synth.kv(0, TOKENS, seed=puts))["keys"]
            time.sleep(max(0.0, outage_s - (time.monotonic() - t_out)))
            server.start()
            t0 = time.monotonic()
            held = [(h.name, keys) for h, _, keys in contexts if h is not victim]
            held += [(fetcher.name, keys0), (outage_node.name, keys_out)]
            in_redis = _seconds_or_none(lambda: all(server.holds(PREFIX, name, keys) for name, keys in held),
                                        t0, 30.0)
            back = _each_finds([n for n in live if n is not outage_node], model, tokens_out, outage_node.name, t0, 30.0)
            report["back"] = {**_figures(back), "all_keys_in_redis_s": in_redis}
        finally:
            for n in nodes:
                n.kill()
            server.stop()
    report["floors"] = _floors(report, fetcher.name, victim.name)
    write_json(report, json_path)
    return report


def _connections(nodes: list[DaemonProcess]) -> dict[str, list[str]]:
    return {n.name: sorted(n.client(timeout=30).status()["peers_connected"]) for n in nodes}


def _seconds_or_none(predicate, since: float, timeout: float) -> float | None:
    try:
        return seconds_until(predicate, timeout=timeout, interval=POLL_S, since=since)
    except TimeoutError:
        return None


def _each_finds(nodes: list[DaemonProcess], model: str, tokens: list[int], holder: str, since: float,
                timeout: float) -> list[float | None]:
    """Per node, seconds from `since` until its lookup lists `holder` with every token (None: not
    within `timeout`), every node polled at once."""
    def one(n: DaemonProcess) -> float | None:
        c = n.client(timeout=timeout)
        return _seconds_or_none(lambda: c.lookup(model, tokens)["peers"].get(holder) == len(tokens), since, timeout)

    with ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(one, nodes))


def _gone(victim: DaemonProcess, watcher: DaemonProcess, model: str, tokens: list[int], lease_s: float) -> dict:
    """SIGKILL `victim`, then `watcher`'s lookups until one does not list it (module docstring)."""
    c = watcher.client(timeout=30)
    t0 = time.monotonic()
    victim.kill()
    last_listed_sent = None
    while time.monotonic() - t0 < 3 * lease_s + 10:
        sent = time.monotonic() - t0
        if victim.name not in c.lookup(model, tokens)["peers"]:
            return {"seconds": time.monotonic() - t0, "last_listed_sent_s": last_listed_sent}
        last_listed_sent = sent
        time.sleep(POLL_S)
    return {"seconds": None, "last_listed_sent_s": last_listed_sent}


def _figures(samples: list[float | None]) -> dict:
    got = [s for s in samples if s is not None]
    return {"median_s": statistics.median(got) if got else None, "max_s": max(got) if got else None,
            "samples": len(samples), "missed": len(samples) - len(got), "seconds": samples}


def _floors(report: dict, fetcher: str, holder: str) -> dict:
    g, b = report["gone"], report["back"]
    return {
        "found": report["found"]["missed"] == 0 and report["found"]["max_s"] <= FOUND_FLOOR_S,
        "gone": g["seconds"] is not None and (g["last_listed_sent_s"] or 0.0) <= report["lease_s"],
        "back": (b["missed"] == 0 and b["max_s"] <= BACK_FLOOR_S and b["all_keys_in_redis_s"] is not None
                 and b["all_keys_in_redis_s"] <= BACK_FLOOR_S),
        "no_connection_before_a_fetch": not any(report["connections_before"].values()),
        "only_fetcher_and_holder_connected": report["connections_after"] == {
            n: ([holder] if n == fetcher else [fetcher] if n == holder else []) for n in report["connections_after"]},
        "one_evalsha_per_lookup": report["evalsha_per_lookup"] == 1.0,
    }


def _s(x: float | None) -> str:
    return "missed" if x is None else f"{x:.3f} s"


def table(report: dict) -> str:
    f, g, b, fl = report["found"], report["gone"], report["back"], report["floors"]
    ok = {True: "ok", False: "MISSED"}
    after = {n: c for n, c in report["connections_after"].items() if c}
    m = report["machine"]
    return "\n".join([
        f"{report['daemons']} daemons on one redis-server, lease {report['lease_s']:g} s, {report['puts']} puts of "
        f"{report['tokens']} tokens, lookups polled every {report['poll_s'] * 1000:g} ms "
        f"({m['cpus']} cpus, load {m['load_avg'][0]:g} at the start)",
        f"  found (put's reply -> each other node's lookup): median {_s(f['median_s'])}, max {_s(f['max_s'])} "
        f"over {f['samples']} ({f['missed']} missed; floor <= {FOUND_FLOOR_S:g} s: {ok[fl['found']]})",
        f"  gone (SIGKILL -> a lookup without it):           {_s(g['seconds'])}, last listed by a lookup sent at "
        f"{_s(g['last_listed_sent_s'])} (floor <= lease {report['lease_s']:g} s: {ok[fl['gone']]})",
        f"  back (restart after {report['outage_s']:g} s outage -> each node finds): median {_s(b['median_s'])}, "
        f"max {_s(b['max_s'])}; every key in Redis after {_s(b['all_keys_in_redis_s'])} "
        f"(floor <= {BACK_FLOOR_S:g} s: {ok[fl['back']]})",
        f"  connections before any fetch: {sum(map(len, report['connections_before'].values()))} "
        f"({ok[fl['no_connection_before_a_fetch']]}); after one fetch: {after} "
        f"({ok[fl['only_fetcher_and_holder_connected']]})",
        f"  EVALSHA per lookup: {report['evalsha_per_lookup']:g} ({ok[fl['one_evalsha_per_lookup']]})"])
