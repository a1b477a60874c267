"""What `kvstreamd doctor` needs from the daemon that no other endpoint says (GET /v1/doctor):
errors by kind in the last hour and, of them, the chunks peers sent damaged; each stored model
with the profile it codes with; this host's measured decode rate and entropy coder build; and
(POST /v1/peers/probe) a bounded active probe of every peer: round trip, bandwidth, clock offset."""
from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from codec import rans
from codec.tuning import catalog, registry
from codec.errors import CodecError
from transport import aio
from transport.bandwidth import CLOCK_TICK, crossing_s

from kvstreamd.coder import MIN_TIMED_MB
from kvstreamd.metrics import RecentErrors, is_damaged_chunk
from kvstreamd.requests import PROBE_BYTES, PROBE_TIMEOUT_S  # a probe's padding and time (POST /v1/peers/probe)

if TYPE_CHECKING:
    import torch

    from kvstreamd.coder import Coder
    from kvstreamd.cluster.peers import PeerManager
    from kvstreamd.store.store import Store

WINDOW_S = 3600  # "in the last hour"
# A daemon that has timed no decode yet measures one now, on a stored chunk: at most this many
# decodes of it, stopping once this many seconds have gone (a diagnosis, not a benchmark).
MEASURE_DECODES = 3
MEASURE_S = 2.0
MEASURE_CONTEXTS = 8  # the newest contexts looked in for a chunk Coder times (each costs a read or two)


async def report(recent: RecentErrors, store: Store, coder: Coder, gpu: torch.device | None, gpu_why: str,
                 window_s: float = WINDOW_S) -> dict:
    """The daemon's side of the checklist: its errors, store, codec and the GPU fetches decode
    on (None: the CPU, because gpu_why)."""
    errors, complete = recent.counts(window_s)
    contexts = await asyncio.to_thread(store.contexts)
    models: dict[str, dict] = {}
    for c in contexts:
        m = models.setdefault(c.model_id, {"model_id": c.model_id, "contexts": 0, "chunks": 0, "bytes": 0})
        m["contexts"] += 1
        m["chunks"] += c.chunks
        m["bytes"] += c.nbytes
    for m in models.values():
        m.update(_profile_of(coder, m["model_id"]))
    built = await asyncio.to_thread(rans.library)  # the first call may compile it
    measured_now = await _measure_decode(store, coder, contexts) if not coder.decode_samples else None
    return {
        "window_s": window_s,
        "errors": errors,
        "errors_complete": complete,  # False: older events of the window were pushed out (a floor)
        "damaged_chunks": {k: n for k, n in errors.items() if is_damaged_chunk(k)},
        "models": list(models.values()),
        "decode": {"mbps": round(coder.decode_mbps, 1), "samples": coder.decode_samples,
                   "workers": coder.pool.workers, "expected_mbps_per_core": catalog.DECODE_MBPS_PER_CORE,
                   "floor_mbps_per_core": catalog.DECODE_FLOOR_MBPS_PER_CORE,
                   "entropy_coder": "C" if built is not None else "numpy", "measured_now": measured_now},
        "gpu": {"device": str(gpu) if gpu is not None else None, "why_not": gpu_why or None},
    }


async def _measure_decode(store: Store, coder: Coder, contexts: list) -> str | None:
    """Decode the newest stored chunk of over MIN_TIMED_MB (the last chunk of one of the
    MEASURE_CONTEXTS newest contexts, else the one before it: a last chunk may be short) at one of its entropy-coded levels through
    the codec workers, so that the rate is this host's on real chunks. Returns which chunk it
    timed, or None where none is big enough (or it does not decode)."""
    for ctx in contexts[::-1][:MEASURE_CONTEXTS]:  # (oldest first)
        key = ctx.key
        for _ in range(2):
            rec = await asyncio.to_thread(store.get, key)
            if rec is None:
                break
            level = next((lv for lv in rec.levels if catalog.is_level(lv)),
                         None)
            if level is not None and math.prod(rec.shape) * 2 / 1e6 > MIN_TIMED_MB:
                t0 = time.monotonic()
                try:
                    for _ in range(MEASURE_DECODES):
                        await asyncio.to_thread(coder.decode, level, rec.levels[level])  # observed as it goes
                        if time.monotonic() - t0 > MEASURE_S:
                            break
                except CodecError:
                    return None
                return f"chunk {rec.index} of a {rec.model_id} context, {level}"
            if rec.parent is None:
                break
            key = rec.parent
    return None


def _profile_of(coder: Coder, model_id: str) -> dict:
    try:
        prof = coder.profile_for(model_id)
    except CodecError as e:
        return {"profile": None, "profile_error": str(e)}
    configured = prof is coder.profile
    return {"profile": {"id": prof.id.hex(), "path": str(prof.path) if prof.path else None,
                        "configured": configured, "source": "configured" if configured else registry.source(prof),
                        "layers": prof.layers, "heads": prof.heads, "head_dim": prof.head_dim}}


async def probe_peers(peers: PeerManager, size: int = PROBE_BYTES, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict]:
    """Every peer /v1/peers lists, probed at once over its connection: a PING for the round
    trip and the clock offset, and a PING padded with `size` bytes for the bandwidth (this node
    to the peer), both within `timeout_s`. A peer with no connection is reported, not dialled."""
    return list(await asyncio.gather(*(_probe(peers, p, size, timeout_s) for p in peers.info())))


async def _probe(peers: PeerManager, info: dict, size: int, timeout_s: float) -> dict:
    out = {"node_id": info["node_id"], "address": info["address"], "configured": info["configured"],
           "connected": False, "rtt_ms": None, "mbit": None, "clock_offset_ms": None,
           "last_error": info["last_error"], "cooldown_s": info["cooldown_s"], "error": None}
    conn = peers.connection(info["node_id"]) if info["node_id"] else None
    if conn is None:
        out["error"] = info["last_error"] or "not connected"
        return out
    out["connected"] = True
    try:
        async with asyncio.timeout(timeout_s):
            rtt, (sent_at, acked_at) = await asyncio.gather(conn.ping(), conn.probe(size))
    except TimeoutError:
        out["error"] = f"no answer to a {size}-byte probe within {timeout_s:g} s"
        return out
    except aio.TransportError as e:
        out["error"] = f"{e.code}: {e.msg}"
        return out
    out["rtt_ms"] = round(rtt * 1000, 3)
    out["mbit"] = round(size * 8 / crossing_s(max(acked_at - sent_at, CLOCK_TICK), rtt) / 1e6, 1)
    if conn.clock_offset is not None:
        out["clock_offset_ms"] = round(conn.clock_offset * 1000, 1)
    return out
