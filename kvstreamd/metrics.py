"""The daemon's Prometheus metrics (one registry per daemon, served at GET /metrics on the
Unix socket), and its structured logs: logfmt lines carrying the request id of the API call
or peer request they belong to."""
from __future__ import annotations

import collections
import contextvars
import logging
import secrets
import sys
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_LAG = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)
_SHARE = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


# What a node can be degraded by (kvstreamd_degraded{reason}; Node.degraded() says which now).
DEGRADED = ("codec_workers", "disk_full", "disk_error", "directory", "certificate")


def new_request_id() -> str:
    rid = secrets.token_hex(4)
    request_id.set(rid)
    return rid


# The errors with the time each happened, bounded, so that "how many of each kind in the last
# hour" has an answer (`kvstreamd doctor`): kvstreamd_errors{kind} counts since start, which
# cannot tell an old burst from a fresh one.
KEEP = 4096  # events kept: past it the oldest go, and a window reaching before them says so
# A chunk a peer sent that is damaged: its crc does not match on the wire (chunk_bad_crc), it is
# not the chunk asked for by its header (chunk_refused_<check>, kvstreamd/cluster/admission.py), or
# its bitstream does not decode (decode; kvstreamd/node/fetch.py names all three).
DAMAGED_CHUNK_KINDS = ("chunk_bad_crc", "decode")
DAMAGED_CHUNK_PREFIX = "chunk_refused_"


def is_damaged_chunk(kind: str) -> bool:
    return kind in DAMAGED_CHUNK_KINDS or kind.startswith(DAMAGED_CHUNK_PREFIX)


class RecentErrors:
    """(time, kind, count) of the latest KEEP errors; safe to add to from any thread."""

    def __init__(self, keep: int = KEEP, clock: Callable[[], float] = time.time) -> None:
        self._events: collections.deque[tuple[float, str, int]] = collections.deque(maxlen=keep)
        self._clock = clock
        self._lock = threading.Lock()
        self._lost_until: float | None = None  # time of the newest event pushed out

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self._lost_until = self._events[0][0]
            self._events.append((self._clock(), kind, n))

    def counts(self, window_s: float) -> tuple[dict[str, int], bool]:
        """Errors by kind in the last `window_s` seconds, and whether that is all of them
        (False: events of the window were pushed out, so the counts are a floor)."""
        since = self._clock() - window_s
        out: dict[str, int] = {}
        with self._lock:
            for t, kind, n in self._events:
                if t >= since:
                    out[kind] = out.get(kind, 0) + n
            complete = self._lost_until is None or self._lost_until < since
        return dict(sorted(out.items())), complete


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # The seed's four.
        self.fetch_seconds = Histogram(
            "kvstreamd_fetch_seconds", "Time from a fetch request to its last chunk ready in the buffer "
            "(what the model waits for before its first token)", ["arm"], registry=r, buckets=_LATENCY)
        self.decode_share = Histogram(
            "kvstreamd_fetch_decode_share", "Decode time as a share of a fetch's total time", ["arm"], registry=r,
            buckets=_SHARE)
        self.compression_ratio = Gauge(
            "kvstreamd_compression_ratio", "fp16 KV bytes over stored bytes, per level, over all chunks stored "
            "since start", ["level"], registry=r)
        self.link_utilisation = Gauge(
            "kvstreamd_link_utilisation", "Share of a peer link's estimated bandwidth that the last transfer from "
            "this node used", ["peer"], registry=r)
        # What an operator needs besides.
        self.stage_seconds = Histogram(
            "kvstreamd_fetch_stage_seconds", "Busy time of each pipeline stage per fetch", ["stage", "arm"], registry=r,
            buckets=_LATENCY)
        self.lookups = Counter("kvstreamd_lookups", "Fetch lookups by outcome (hit: the whole prompt but its "
                               "last partial chunk; partial; miss)", ["result", "arm"], registry=r)
        self.prompt_tokens = Counter("kvstreamd_prompt_tokens", "Tokens of prompts looked up, by where they came from "
                                     "(local, peer, text, prefill)", ["source", "arm"], registry=r)
        self.peer_bytes = Counter("kvstreamd_peer_bytes", "Chunk payload bytes per peer and direction", ["peer", "direction"],
                                  registry=r)
        self.chunks = Counter("kvstreamd_chunks", "Chunks moved, by level and direction (sent, received, local)",
                              ["level", "direction"], registry=r)
        self.errors = Counter("kvstreamd_errors", "Errors by kind", ["kind"], registry=r)
        self.recent_errors = RecentErrors()  # the same, with when: what the last hour held (doctor)
        self.store_bytes = Gauge("kvstreamd_store_bytes", "Store usage by tier", ["tier"], registry=r)
        self.store_budget = Gauge("kvstreamd_store_budget_bytes", "Store budget by tier", ["tier"], registry=r)
        self.store_chunks = Gauge("kvstreamd_store_chunks", "Chunks held (any tier)", registry=r)
        self.store_evictions = Gauge("kvstreamd_store_evictions", "Chunks evicted since start", registry=r)
        self.store_pinned = Gauge("kvstreamd_store_pinned_bytes", "Payload bytes of pinned contexts' chunks "
                                  "(bounded by kvstreamd_store_budget_bytes{tier=\"pin\"})", registry=r)
        self.peers_connected = Gauge("kvstreamd_peers_connected", "Peers with a ready connection", registry=r)
        self.peer_up = Gauge("kvstreamd_peer_up", "1 while a peer of [peer] peers (by address) has a ready "
                             "connection, 0 while it is unreachable", ["peer"], registry=r)
        self.fetches_active = Gauge("kvstreamd_fetches_active", "Local fetches in progress", registry=r)
        self.buffers_held = Gauge("kvstreamd_buffers_held", "Shared-memory buffers not yet released", registry=r)
        self.buffer_bytes = Gauge("kvstreamd_buffer_bytes", "Bytes in shared-memory buffers not yet released", registry=r)
        self.spare_buffer_bytes = Gauge("kvstreamd_buffer_spare_bytes", "Bytes in shared-memory buffers released "
                                        "by their clients and kept for the next fetch ([api] spare_buffer_bytes)",
                                        registry=r)
        # Predictive prefetch (prefetch.py).
        self.prefetches = Counter("kvstreamd_prefetches", "Successor contexts prefetched, by outcome (done; held: "
                                  "nothing to fetch; not_held: no peer holds it; no_room: past [prefetch] memory_share; "
                                  "failed)", ["outcome"], registry=r)
        self.prefetch_bytes = Counter("kvstreamd_prefetch_bytes", "Chunk payload bytes prefetched into the store",
                                      registry=r)
        self.prefetch_hits = Counter("kvstreamd_prefetch_hits", "User fetches that found a prefetched context's "
                                     "chunks held here", registry=r)
        self.prefetch_yields = Counter("kvstreamd_prefetch_yields", "Prefetch requests cancelled because a user "
                                       "fetch started (each resumes after it)", registry=r)
        self.puts = Counter("kvstreamd_put_chunks", "Chunks offered by local puts, by outcome (stored, already_held, "
                            "memory_only: its file could not be written, refused; fetched: kept from a fetch, to serve onward)", ["outcome"], registry=r)
        self.degraded = Gauge("kvstreamd_degraded", "1 while the node is degraded for this reason (codec_workers: "
                              "a worker died and is being replaced; disk_full; disk_error; directory: Redis unreachable; certificate: "
                              "[peer] tls_cert or tls_ca expired or not valid yet)", ["reason"], registry=r)
        for reason in DEGRADED:
            self.degraded.labels(reason).set(0)
        self.tls_expiry = Gauge("kvstreamd_tls_expiry_timestamp_seconds", "When the first of [peer] tls_cert and "
                                "tls_ca expires, in Unix seconds (0: plaintext peer links)", registry=r)
        self.codec_restarts = Counter("kvstreamd_codec_worker_restarts", "Times the codec workers were replaced "
                                      "after one died", registry=r)
        self._codec_restarts = 0
        self.encode_seconds = Histogram("kvstreamd_put_encode_seconds", "Encode time per put", registry=r,
                                        buckets=_LATENCY)
        self.loop_lag = Histogram("kvstreamd_event_loop_lag_seconds", "How late the event loop ran each of its "
                                  "50 ms ticks (a held loop delays every request; ops/loop_watch.py)", registry=r,
                                  buckets=_LAG)
        # Per fetch, by A/B arm (kvstreamd.experiment; "control" when no experiment runs): every
        # fetch metric above carries `arm` too.
        self.fetch_deadline_missed = Counter("kvstreamd_fetch_deadline_missed", "Fetches that ended after "
                                             "their deadline", ["arm"], registry=r)
        self.fetch_bytes = Counter("kvstreamd_fetch_bytes", "Wire bytes fetches received from peers", ["arm"],
                                   registry=r)
        self.fetch_chunks = Counter("kvstreamd_fetch_chunks", "Chunks of fetches by the level they landed at "
                                    "(text: recomputed)", ["arm", "level"], registry=r)
        self._ratio_raw: dict[str, float] = {}
        self._ratio_coded: dict[str, float] = {}

    def stored(self, level: str, raw_fp16_bytes: int, coded_bytes: int) -> None:
        self._ratio_raw[level] = self._ratio_raw.get(level, 0.0) + raw_fp16_bytes
        self._ratio_coded[level] = self._ratio_coded.get(level, 0.0) + coded_bytes
        self.compression_ratio.labels(level).set(self._ratio_raw[level] / max(self._ratio_coded[level], 1.0))

    def fetched(self, arm: str, levels: list[str], nbytes: int, deadline_missed: bool) -> None:
        """A fetch ended: its chunks' levels, bytes and deadline, by arm."""
        for level in levels:
            self.fetch_chunks.labels(arm, level).inc()
        self.fetch_bytes.labels(arm).inc(nbytes)
        self.fetch_deadline_missed.labels(arm).inc(int(bool(deadline_missed)))

    def set_degraded(self, reasons: set[str]) -> None:
        for reason in DEGRADED:
            self.degraded.labels(reason).set(1 if reason in reasons else 0)

    def set_codec_restarts(self, n: int) -> None:
        if n > self._codec_restarts:
            self.codec_restarts.inc(n - self._codec_restarts)
            self._codec_restarts = n

    def set_peers_up(self, up: dict[str, bool]) -> None:
        """One series per configured peer: a peer a reload took out of the config loses its own."""
        self.peer_up.clear()
        for address, connected in up.items():
            self.peer_up.labels(address).set(1 if connected else 0)

    def error(self, kind: str, n: int = 1) -> None:
        self.errors.labels(kind).inc(n)
        self.recent_errors.add(kind, n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Logfmt(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        msg = record.getMessage().replace('"', "'")
        line = f'ts={ts} level={record.levelname.lower()} logger={record.name} rid={request_id.get()} msg="{msg}"'
        if record.exc_info:
            line += ' exc="' + self.formatException(record.exc_info).replace("\n", "\\n").replace('"', "'") + '"'
        return line


def setup_logging(level: str = "info") -> None:
    """logfmt lines on stderr (journald keeps them under systemd)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_kvstreamd", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Logfmt())
    handler._kvstreamd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
