"""Predictive prefetch: which contexts this node's users fetch after which (`CoAccess`, one
bounded table per model, learnt from this node's own fetches), and the background worker that,
when a context is fetched, pulls its likely successors' chunks from peers into the local store
(`Prefetcher`), as the bitstreams that arrive: no decode, so it never takes the decoder.

It never slows a user's fetch: one prefetch at a time, only while no user fetch runs on this
node; a user fetch that starts cancels the prefetch's request on the wire (CANCEL) and the
prefetch resumes from its next missing chunk once the node is idle again. Its chunks that no
user has fetched yet stay within [prefetch] memory_share of [store] memory_budget: to make room
it deletes its own oldest unused prefetch first. A context it prefetched that no user then
fetched is not prefetched again until a user fetches it."""
from __future__ import annotations

import array
import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

from codec import bitstream as bs
from codec.tuning import catalog
from codec.errors import CodecError
from transport import aio
from transport.messages import Chunk, Fetch

from kvstreamd.cluster.admission import Refused, Wanted, admit
from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.coder import Coder
from kvstreamd.config import Config
from kvstreamd.features import Feature, FetchBegan
from kvstreamd.cluster.directory import Directory
from kvstreamd.metrics import Metrics, new_request_id
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.store.store import Store, StoreError

log = logging.getLogger(__name__)

QUEUED = 16  # successor contexts waiting for the worker; the oldest are dropped when more come
RECENT = 64  # receive times of the last prefetched chunks that /v1/status shows
# Chunks per FETCH a prefetch sends. One: what a user fetch that starts finds on the link ahead
# of its own chunks (the sender's window of a request in flight, and its socket buffer) is at
# most one chunk; it costs the prefetch a round trip per chunk, which nobody waits for.
REQUEST_CHUNKS = 1


@dataclass(frozen=True, eq=False)
class Context:
    """A context as a fetch found it: its chunk key chain and the tokens its chunks cover
    (what a prefetch needs to ask holders for it and to store its chunks)."""

    model_id: str
    keys: tuple[bytes, ...]
    bounds: tuple[tuple[int, int], ...]  # token [start, end) of each chunk
    tokens: array.array  # u32 token ids: 4 bytes a token, not a Python int's ~32

    @property
    def id(self) -> bytes:
        """Its last chunk's key: the chain is hashed over the model id and every token before."""
        return self.keys[-1]


class CoAccess:
    """One model's successor table: for each context fetched here (at most `max_contexts`, least
    recently fetched dropped first), how often each other context was the next one fetched
    within `window_s`, for at most `max_successors` successors (a new one replaces the least
    counted). Time is a parameter: no clock, no I/O."""

    def __init__(self, max_contexts: int, max_successors: int, window_s: float) -> None:
        self.max_contexts = max_contexts
        self.max_successors = max_successors
        self.window_s = window_s
        self.contexts: collections.OrderedDict[bytes, Context] = collections.OrderedDict()
        self.counts: dict[bytes, dict[bytes, int]] = {}
        self._last: tuple[bytes, float] | None = None  # the context fetched last, and when

    def fetched(self, ctx: Context, now: float) -> None:
        """A user fetched `ctx` at `now`: it succeeds the one fetched before it, if that was
        within window_s."""
        self.contexts[ctx.id] = ctx
        self.contexts.move_to_end(ctx.id)
        if self._last is not None:
            prev, at = self._last
            if prev != ctx.id and now - at <= self.window_s and prev in self.contexts:
                self._count(prev, ctx.id)
        self._last = (ctx.id, now)
        while len(self.contexts) > self.max_contexts:
            old, _ = self.contexts.popitem(last=False)
            self.counts.pop(old, None)

    def _count(self, prev: bytes, nxt: bytes) -> None:
        succ = self.counts.setdefault(prev, {})
        if nxt not in succ and len(succ) >= self.max_successors:
            del succ[min(succ, key=succ.get)]
        succ[nxt] = succ.get(nxt, 0) + 1

    def successors(self, ctx_id: bytes, min_count: int, n: int) -> list[Context]:
        """The at most n contexts most often fetched after `ctx_id`, each at least min_count times."""
        succ = self.counts.get(ctx_id, {})
        best = sorted((c for c in succ.items() if c[1] >= min_count and c[0] in self.contexts), key=lambda c: -c[1])
        return [self.contexts[k] for k, _ in best[:n]]


@dataclass
class _Unused:
    """A context this node prefetched that no user has fetched since."""

    sizes: dict[bytes, int] = field(default_factory=dict)  # its chunks the prefetch stored -> payload bytes
    local_before: int = 0  # its chunks held here before the prefetch


class Prefetcher(Feature):
    """The worker and its bookkeeping, a feature of the node: it learns from each fetch that
    begins, yields to the node's own work, and shows itself in /v1/status "prefetch"."""

    name = "prefetch"

    def __init__(self, cfg: Config, store: Store, directory: Directory, peers: PeerManager,
                 coder: Coder, metrics: Metrics) -> None:
        self.cfg = cfg  # reconfigure() swaps in a reloaded one
        self.store = store
        self.directory = directory
        self.peers = peers
        self.coder = coder
        self.metrics = metrics
        self.tables: dict[str, CoAccess] = {}
        self.unused: collections.OrderedDict[bytes, _Unused] = collections.OrderedDict()
        self.queue: collections.OrderedDict[bytes, Context] = collections.OrderedDict()
        self.running: Context | None = None
        self.received_at: collections.deque[float] = collections.deque(maxlen=RECENT)  # time.time()
        self._users = 0  # user fetches in flight on this node, and the storing of what they brought
        self._idle = asyncio.Event()
        self._idle.set()
        self._user_started = asyncio.Event()  # set by each user fetch that starts while one runs
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None

    # -- what the node tells it ------------------------------------------------------------

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg

    def fetch_began(self, began: FetchBegan) -> None:
        self.waits_for(began.task)  # a prefetch yields the link to it
        self.fetched(began.model_id, list(began.tokens), began.plan)  # learnt from; its likely successors queued

    def node_busy(self, task: asyncio.Future) -> None:
        self.waits_for(task)

    def status(self) -> dict:
        return self.info()

    def waits_for(self, task: asyncio.Future) -> None:
        """No prefetch runs until `task` (a user fetch, or the storing of the chunks it brought)
        is done: one in flight cancels its request now."""
        self._users += 1
        self._idle.clear()
        self._user_started.set()
        task.add_done_callback(self._user_work_done)

    def _user_work_done(self, _task) -> None:
        self._users -= 1
        if not self._users:
            self._idle.set()

    def fetched(self, model_id: str, tokens: list[int], plan) -> None:
        """A user fetch planned `plan` (node.fetch.Plan): learn from it, count a hit where it found
        prefetched chunks here, and queue its likely successors."""
        if not plan.found:
            return
        cfg = self.cfg.prefetch
        ctx = Context(model_id, tuple(plan.keys[:plan.found]), tuple(plan.bounds[:plan.found]),
                      array.array("I", tokens[:plan.found_tokens]))
        was = self.unused.pop(ctx.id, None)
        if was is not None and plan.local > was.local_before:
            self.metrics.prefetch_hits.inc()
        table = self.tables.get(model_id)
        if table is None:
            table = self.tables[model_id] = CoAccess(cfg.max_contexts, cfg.max_successors, cfg.window_s)
        table.max_successors, table.window_s = cfg.max_successors, cfg.window_s
        table.fetched(ctx, time.monotonic())
        if not cfg.enabled:
            return
        # The worker takes the newest first (the user has moved on from what older fetches
        # predicted), so the likeliest successor goes in last.
        for succ in reversed(table.successors(ctx.id, cfg.min_count, cfg.max_successors)):
            if succ.id in self.unused or (self.running is not None and self.running.id == succ.id):
                continue  # prefetched already and not used since: never again until a user fetches it
            self.queue.pop(succ.id, None)
            self.queue[succ.id] = succ
            while len(self.queue) > QUEUED:
                self.queue.popitem(last=False)
        if self.queue:
            self._ensure_worker()
            self._wake.set()

    def info(self) -> dict:
        cfg = self.cfg
        return {"enabled": cfg.prefetch.enabled, "queued": len(self.queue), "user_fetches": self._users,
                "running": self.running.id.hex() if self.running else None,
                "unused_contexts": len(self.unused), "unused_bytes": self._unused_bytes(),
                "share_bytes": self._share(cfg), "contexts_known": sum(len(t.contexts) for t in self.tables.values()),
                "received_at": list(self.received_at)}

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    # -- the worker ----------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())

    async def _work(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                await self._idle.wait()
                if not self.queue:
                    break
                _, ctx = self.queue.popitem()
                if ctx.id in self.unused:
                    continue
                self.running = ctx
                new_request_id()  # its log lines are its own, not those of the fetch that queued it
                try:
                    outcome = await self._prefetch(ctx)
                except Exception as e:  # one bad prefetch must not end the worker
                    log.warning("prefetch of %s failed: %s: %s", ctx.id.hex()[:16], type(e).__name__, e)
                    outcome = "failed"
                finally:
                    self.running = None
                self.metrics.prefetches.labels(outcome).inc()
                u = self.unused.get(ctx.id)
                if u is not None and not u.sizes and outcome in ("not_held", "failed"):
                    self.unused.pop(ctx.id)  # nothing of it stored: free to try again when it is next due
                log.info("prefetch of %s (%d chunks): %s, %d chunks stored", ctx.id.hex()[:16], len(ctx.keys),
                         outcome, len(u.sizes) if u else 0)

    async def _prefetch(self, ctx: Context) -> str:
        """Pull ctx's chunks not held here, REQUEST_CHUNKS per FETCH, yielding to every user
        fetch; returns the outcome (done, held: it was held here already, not_held, no_room,
        failed)."""
        entry, holders = None, None
        while True:
            await self._idle.wait()
            local = self.store.longest_prefix(ctx.keys)
            if local == len(ctx.keys):
                if entry is not None:
                    return "done"
                # held already: made the most recently used, so that it is still here when asked for
                await asyncio.to_thread(lambda: [self.store.get(k) for k in ctx.keys])
                return "held"
            if entry is None:
                entry = self.unused[ctx.id] = _Unused(local_before=local)
                await self._bound_unused()
            if holders is None or not holders.of(local):
                holders = (await self.directory.lookup(list(ctx.keys), local)).want(self.cfg.codec.levels)
            peer, end = holders.best(local)
            if peer is None:
                return "not_held" if not entry.sizes else "failed"
            self._user_started.clear()
            if not self._idle.is_set():
                continue  # a user fetch started during the lookup
            outcome = await self._pull(ctx, entry, peer, holders.addresses.get(peer), local,
                                       min(end, local + REQUEST_CHUNKS))
            if outcome is not None:
                return outcome
            if self._user_started.is_set():
                self.metrics.prefetch_yields.inc()
                holders = None  # who holds what may have changed while it waited
            elif self.store.longest_prefix(ctx.keys) <= local:
                return "failed"  # the peer ended the request without the chunk: not asked again now

    async def _pull(self, ctx: Context, entry: _Unused, peer: str, address: str | None, start: int,
                    end: int) -> str | None:
        """One FETCH of chunks [start, end) from `peer`, each stored as it arrives. None: go on
        (the peer sent what it was asked, or a user fetch started: its request is cancelled on
        the wire at once); else the prefetch's outcome."""
        cfg = self.cfg
        conn = await self.peers.connect_to(peer, address)
        if conn is None:
            return "failed"
        prof = self.coder.profile_for(ctx.model_id)
        levels = list(cfg.codec.levels)
        keys = list(ctx.keys[start:end])
        stream = conn.fetch(Fetch.ask(keys, cfg.prefetch.deadline_ms, levels, decode_mbps=self.coder.rate()),
                            stall_s=cfg.fetch.stall_s, limit_s=2 * cfg.prefetch.deadline_ms / 1000)
        watch = asyncio.ensure_future(self._user_started.wait())
        cancels = []  # (held: a task nobody holds may be collected before it runs)
        watch.add_done_callback(lambda _: cancels.append(asyncio.ensure_future(stream.cancel())))
        nbytes = 0
        try:
            async for msg in stream:
                if self._user_started.is_set():
                    return None  # already queued when a user fetch started: not taken, the cancel follows
                self.received_at.append(time.time())
                j = start + msg.i
                if not isinstance(msg, Chunk):
                    return "failed"  # TEXT: the holder could not send it in time; the rest would not chain
                admit(msg.payload, msg.level, Wanted.of(list(ctx.keys), list(ctx.bounds), j, prof, levels), msg.key)
                if catalog.SCHEMES[msg.level].is_level:
                    bs.unpack(msg.payload, check_crc=True)  # never decoded here: its CRC is checked instead
                nbytes += len(msg.payload)
                if not await self._room(cfg, ctx.id, len(msg.payload)):
                    return "no_room"
                s, e = ctx.bounds[j]
                rec = ChunkRecord.of_chunk(ctx.keys, j, (s, e), ctx.model_id, ctx.tokens, "float16",
                                           (prof.layers, 2, e - s, prof.heads, prof.head_dim), {msg.level: msg.payload})
                try:
                    stored = await asyncio.to_thread(self.store.put_to, rec)
                except StoreError as err:
                    log.info("prefetched chunk %d of %s not stored: %s", j, ctx.id.hex()[:16], err)
                    return "no_room"
                if stored is not None:
                    entry.sizes[rec.key] = rec.nbytes
                    self.metrics.prefetch_bytes.inc(rec.nbytes)
            return None
        except aio.FetchCancelled:
            return None if watch.done() else "failed"
        except (aio.TransportError, Refused, CodecError) as e:
            log.info("prefetch of %s from %s stopped: %s", ctx.id.hex()[:16], peer, e)
            return "failed"
        finally:
            watch.cancel()
            await stream.cancel()
            self.metrics.peer_bytes.labels(peer, "in").inc(nbytes)

    # -- the memory share ----------------------------------------------------------------------

    def _share(self, cfg: Config) -> int:
        return int(cfg.store.memory_budget * cfg.prefetch.memory_share)

    def _unused_bytes(self) -> int:
        """Payload bytes of prefetched chunks no user has fetched, that are still held."""
        return sum(n for u in self.unused.values() for k, n in u.sizes.items() if self.store.has(k))

    async def _drop(self, ctx_id: bytes) -> None:
        """Delete an unused prefetch's chunks, last first, except those a context someone put,
        fetched or pinned since still uses (a prefix of it, or pinned)."""
        u = self.unused[ctx_id]
        await asyncio.to_thread(self.store.drop_unshared, list(u.sizes))
        u.sizes.clear()

    async def _bound_unused(self) -> None:
        """At most [prefetch] max_contexts unused prefetches are remembered; the oldest go
        (chunks and all: forgotten, they would stand outside the share)."""
        while len(self.unused) > self.cfg.prefetch.max_contexts:
            ctx_id = next(iter(self.unused))
            await self._drop(ctx_id)
            self.unused.pop(ctx_id, None)

    async def _room(self, cfg: Config, current: bytes, nbytes: int) -> bool:
        """Make room for nbytes more of prefetched chunks within the share, dropping the oldest
        unused prefetches (not `current`) first; False when even that is not enough."""
        share = self._share(cfg)
        for ctx_id, u in list(self.unused.items()):
            if self._unused_bytes() + nbytes <= share:
                break
            if ctx_id == current or not u.sizes:
                continue
            await self._drop(ctx_id)
            log.info("prefetched context %s dropped unused to make room", ctx_id.hex()[:16])
        return self._unused_bytes() + nbytes <= share
