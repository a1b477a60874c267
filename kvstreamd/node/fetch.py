"""One local fetch, planned (node/plan.py): receive -> decode -> fill as three asyncio stages
joined by bounded queues, so that while chunk i decodes (in the codec process pool), chunk i+1
arrives and chunk i-1 is copied into the client's shared-memory buffer. Chunks from peers
(node/from_peers.py) go to decode as they arrive, in any order (a chunk held up at one peer holds
up no other's decode); the fill stage hands them to the client in order. Each chunk that lands
becomes an event for the client: KV ready at these token positions, or TEXT the model must
recompute. A peer that fails mid-stream costs only its remaining chunks: they come from another
peer holding them, or as TEXT (node/from_peers.py says how long peers are waited for)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Awaitable, Callable

import torch

from codec import select_layers
from codec.tuning import catalog
from codec.errors import CodecError
from codec.layout import PrefixKV
from transport import aio
from transport.policy import TEXT, text_seconds

from kvstreamd import events
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.coder import Coder, DecodeTally
from kvstreamd.metrics import Metrics
from kvstreamd.node.from_peers import FromPeers
from kvstreamd.node.options import FetchOptions
from kvstreamd.node.plan import Plan
from kvstreamd.node.stages import Busy, FetchResult, Item
from kvstreamd.store.store import Store

log = logging.getLogger(__name__)

QUEUE_DEPTH = 2  # chunks between stages: enough to overlap, little enough to bound memory
DECODE_DEPTH = 2  # chunks decoding at once
# The weight of one fetch's decodes in the decode rate told to senders (Coder.observe)
FETCH_RATE_WEIGHT = 0.5

grace_s = aio.grace_s  # a fetch ends within its wait + max(1 s, 10% of the deadline), whatever its peers do


class FetchJob:
    """Runs one fetch into `buffer` (the prefix's KV laid out as its model's layers hold it:
    codec.layout), calling `emit(event)` for each chunk as it is ready. Of each chunk only the
    layers that read the prefix are moved, decoded and filled: all of them for a model whose
    layers hold every token; for a hybrid one, its sliding layers only in their window."""

    def __init__(self, plan: Plan, options: FetchOptions, buffer: PrefixKV | None, store: Store,
                 peers: PeerManager | None, coder: Coder, metrics: Metrics, *,
                 segment: tuple[str, torch.Tensor] | None = None, stages=None,
                 reserving: Awaitable | None = None) -> None:
        self.plan = plan
        self.options = options
        self.buffer = buffer
        self.store = store
        self.peers = peers
        self.coder = coder
        self.metrics = metrics
        self.levels = list(options.levels)
        self.result = FetchResult()
        # codec.gpu.CudaStages when the buffer is on a GPU: chunks of the entropy-coded levels
        # then upload, decode and fill on three CUDA streams; others decode on the CPU workers.
        self.stages = stages
        # (name, the whole segment as one tensor) when the buffer is host shared memory: the
        # codec workers then decode a chunk that lies in one part of it straight into it.
        self.segment = segment
        # the buffer's pages being allocated (HostBuffer.reserve): awaited before the first write into it
        self.reserving = reserving
        # (chunk, level, payload) of each whole chunk a peer sent that decoded: kept here as the
        # bitstream it arrived as, so that this node serves it onward (node/fetches.py stores them)
        self.arrived: list[tuple[int, str, bytes]] = []
        self._texted = False  # a TEXT chunk's event went to the client (text_last: no KV after it)
        self.t0 = options.arrived
        self._levels: dict[int, str] = {}  # chunk -> the level it was filled at (FetchResult.levels, in order)
        self.tally = DecodeTally()  # its coded chunks' decodes on the CPU: one sample of the told rate

    def remaining_ms(self) -> int:
        return int(self.options.deadline_ms - (time.monotonic() - self.t0) * 1000)

    @property
    def wait_s(self) -> float:
        """Seconds from the request's arrival that peers' chunks are waited for (grace aside):
        the deadline, or as long as recomputing what the peers are to send would take here."""
        o, p = self.options, self.plan
        recompute_s = sum(text_seconds(e - s, s, o.recompute_tokens_per_s, o.recompute_doubling_tokens)
                          for s, e in p.bounds[p.local:p.found])
        return aio.wait_s(o.deadline_ms, recompute_s)

    @property
    def peers_until(self) -> float:
        """time.monotonic() after which no peer is waited for: the wait plus half the grace."""
        return self.t0 + self.wait_s + grace_s(self.options.deadline_ms) / 2

    async def run(self, emit: Callable[[events.Event], Awaitable[None]]) -> FetchResult:
        received: asyncio.Queue[Item | None] = asyncio.Queue(QUEUE_DEPTH)
        decoded: asyncio.Queue[Item | None] = asyncio.Queue(QUEUE_DEPTH)
        stages = [asyncio.ensure_future(self._receive(received)),
                  asyncio.ensure_future(self._decode(received, decoded)),
                  asyncio.ensure_future(self._fill(decoded, emit))]
        try:
            await asyncio.gather(*stages)
            # A fetch whose chunks all came as TEXT wrote nothing into the buffer, but its client
            # may still read it: it ends only once the pages are there (or fails, saying why).
            await self._reserved()
            self.coder.observe(self.tally.mb, self.tally.seconds, alpha=FETCH_RATE_WEIGHT)
        finally:
            for s in stages:
                s.cancel()
            await asyncio.gather(*stages, return_exceptions=True)
            self.buffer = self.segment = None  # nothing of the client's buffer outlives the run
        self.result.deadline_missed = self.result.deadline_missed or self.remaining_ms() < 0
        return self.result

    # -- stage 1: receive -------------------------------------------------------------------

    async def _receive(self, out: asyncio.Queue) -> None:
        p = self.plan
        busy = 0.0
        for i in range(p.local):
            t = time.perf_counter()
            rec = await asyncio.to_thread(self.store.get, p.keys[i])
            busy += time.perf_counter() - t
            level = next((lv for lv in self.levels if rec is not None and lv in rec.levels), None)
            if rec is None or level is None:  # evicted, or found damaged, since the plan: recompute it
                why = self.store.dropped(p.keys[i]) if rec is None else None
                await out.put(Item(i, "text", TEXT, "fallback",
                                    error=f"corrupt locally: {why}" if why else "evicted locally"))
                continue
            self.metrics.chunks.labels(level, "local").inc()
            payload = rec.levels[level]
            if len(self.layers(i)) != rec.shape[0]:  # a hybrid model's chunk outside a sliding window
                payload = await asyncio.to_thread(select_layers, payload, self.layers(i))
            item = Item(i, "kv", level, "local", payload, time.monotonic(), nbytes=len(payload))
            await self.upload(item)
            await out.put(item)
        if p.found > p.local:
            busy += await FromPeers(self).receive(out)
        self.result.stage_s["receive"] = busy
        await out.put(None)

    async def upload(self, item: Item) -> None:
        """On a GPU: parse the chunk into pinned memory and start its upload on the receive
        stream as it arrives, so that it overlaps the decode of the chunk before it. A chunk
        that does not parse is left for the decode stage, which turns it into TEXT."""
        if self.stages is None or item.kind != "kv" or not catalog.is_level(item.level):
            return
        try:
            item.staged = await asyncio.to_thread(self.stages.receive, item.payload)
        except CodecError:
            item.staged = None

    # -- stage 2: decode ---------------------------------------------------------------------

    async def _decode(self, inp: asyncio.Queue, out: asyncio.Queue) -> None:
        """Up to DECODE_DEPTH coded chunks decode at once (the workers take a chunk's streams
        between them, so one chunk alone leaves them idle while the daemon hands it over and
        collects it), in the order they arrive; each is handed to the fill stage as it is done,
        which puts them back in order (or, for a fetch that takes KV as it lands, emits it at
        once). A chunk of a baseline scheme (int8, fp16: one pass in a thread of this process)
        takes no slot: it decodes as it lands, beside the coded chunks before it, rather than
        wait behind them -- nor behind one waiting for a slot: coded chunks queue for their
        slots on their own, and this stage goes on taking what arrives (at 1000 Mbit/s the int8
        chunks of a mixed plan arrived while the codec workers were still on the `high` ones, and
        waited until the last `high` had a slot)."""
        slots = asyncio.Semaphore(1 if self.stages is not None else DECODE_DEPTH)  # CUDA stages: one at a time
        busy = Busy()
        tasks: list[asyncio.Task] = []
        try:
            while (item := await inp.get()) is not None:
                coded = item.kind == "kv" and not catalog.decoded_as_it_lands(item.level)
                task = asyncio.ensure_future(self._decode_one(item, slots if coded else None, busy))
                tasks += [task, asyncio.ensure_future(self._hand_on(task, out))]
                tasks = [t for t in tasks if not t.done()]
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        self.result.stage_s["decode"] = busy.total
        await out.put(None)

    @staticmethod
    async def _hand_on(task: asyncio.Task, out: asyncio.Queue) -> None:
        """`task` to the fill stage once it is done (which reads its result, or its error)."""
        await asyncio.wait({task})
        await out.put(task)

    async def _decode_one(self, item: Item, slots: asyncio.Semaphore | None, busy: Busy) -> Item:
        """Decode one chunk (a TEXT one passes through); `slots`: the semaphore it takes a slot
        of (in the order chunks arrive), released when done (None: it takes none)."""
        if slots is not None:
            await slots.acquire()
        try:
            if item.kind == "kv":
                await self._reserved()
                with busy:
                    try:
                        if self.stages is not None and catalog.is_level(item.level):
                            item.on_device = await asyncio.to_thread(self._decode_on_device, item)
                        elif (dest := self._destination(item.i)) is not None:
                            await asyncio.to_thread(self.coder.decode_into, item.level, item.payload, dest,
                                                    *self.segment, self.tally)
                            item.filled = True
                        else:
                            item.kv = await asyncio.to_thread(self.coder.decode, item.level, item.payload, self.tally)
                            self._check_shape(item)
                        if item.source not in ("local", "fallback") and self._whole(item.i):
                            self.arrived.append((item.i, item.level, item.payload))
                    except CodecError as e:
                        why = f"chunk {item.i} from {item.source} does not decode ({e}); recompute it"
                        log.warning(why)
                        self.result.errors.append(why)
                        self.metrics.error("decode")
                        item.kind, item.level, item.error, item.kv, item.on_device = "text", TEXT, str(e), None, None
                item.payload = None
            return item
        finally:
            if slots is not None:
                slots.release()

    async def _reserved(self) -> None:
        """Once the buffer's pages are allocated (at once where nothing was reserving them):
        nothing writes into it before. ShmError where /dev/shm cannot hold it: the fetch fails."""
        if self.reserving is not None:
            await self.reserving

    def _destination(self, i: int) -> torch.Tensor | None:
        """Where in the buffer chunk i can be decoded to directly: the token range of the one
        part that reads it, where the chunk's layers are that part's (every chunk of a model
        whose layers hold every token; a hybrid model's chunks outside the window). None where
        the chunk's layers go to several parts (the window's chunk), or off host memory."""
        if self.segment is None:
            return None
        s, e = self.plan.bounds[i]
        reading = [part for part in self.buffer.parts if part.start < e]
        if len(reading) != 1 or tuple(reading[0].layers) != tuple(self.layers(i)):
            return None
        part = reading[0]
        return part.kv[:, :, s - part.start:e - part.start]

    def _decode_on_device(self, item: Item) -> object:
        t0 = time.perf_counter()
        staged = self.stages.decode(item.staged or self.stages.receive(item.payload))
        item.staged = None
        self.coder.observe(staged.kv.numel() * 2 / 1e6, time.perf_counter() - t0, gpu=True)
        return staged

    @property
    def prefix_tokens(self) -> int | None:
        """What a peer is told of the prefix (so that it sends only the layers that read it);
        None for a model whose layers all hold every token."""
        return None if self.layout is None or self.layout.is_dense else self.plan.found_tokens

    @functools.cached_property
    def layout(self):
        return self.coder.profile_for(self.options.model_id).layout if self.buffer is not None else None

    @functools.cached_property
    def _chunk_layers(self) -> list[tuple[int, ...]]:
        n = self.plan.found_tokens
        return [self.layout.chunk_layers(s, e, n) for s, e in self.plan.bounds[:self.plan.found]]

    def _whole(self, i: int) -> bool:
        """Chunk i is moved with all its layers (not a hybrid model's cut outside the window)."""
        return self.layout is None or len(self.layers(i)) == self.layout.layers

    def layers(self, i: int) -> tuple[int, ...]:
        """The layers of chunk i this fetch moves (worked out once per fetch)."""
        return self._chunk_layers[i]

    def _check_shape(self, item: Item) -> None:
        s, e = self.plan.bounds[item.i]
        H, D = self.buffer.parts[0].kv.shape[3:]
        want = (len(self.layers(item.i)), 2, e - s, H, D)
        shape = tuple(item.kv.shape)
        if shape != want:
            raise CodecError(f"decoded shape {shape} is not the chunk's {want}")

    def _fill_cpu(self, i: int, kv: torch.Tensor) -> None:
        """Chunk i's decoded layers into the parts of the buffer that hold them."""
        s, e = self.plan.bounds[i]
        row = {layer: r for r, layer in enumerate(self.layers(i))}
        for part in self.buffer.parts:
            if part.start >= e:
                continue  # these layers do not read this chunk of the prefix
            rows = [row[layer] for layer in part.layers]
            src = kv[rows[0]:rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else kv[rows]
            part.kv[:, :, s - part.start:e - part.start].copy_(src)

    # -- stage 3: fill -----------------------------------------------------------------------

    async def _fill(self, inp: asyncio.Queue, emit: Callable[[events.Event], Awaitable[None]]) -> None:
        """Chunks in order, whatever order they decoded in: one decoded ahead of a chunk not yet
        in waits here (decoded straight into the buffer, as on host memory, it holds nothing).
        For a fetch that takes KV as it lands (order "landed"), a KV chunk ahead of its turn is
        filled and its event sent at once; TEXT still waits for every chunk before it."""
        landed = self.options.order == "landed"
        busy = 0.0
        early: dict[int, Item] = {}
        ahead: set[int] = set()  # chunks filled and told ahead of their turn
        nxt = 0
        while (task := await inp.get()) is not None:
            item = await task
            if landed and item.kind == "kv" and item.i > nxt:
                busy += await self._fill_one(item, emit)
                ahead.add(item.i)
            else:
                early[item.i] = item
            while nxt in early or nxt in ahead:
                if nxt in early:
                    busy += await self._fill_one(early.pop(nxt), emit)
                ahead.discard(nxt)
                nxt += 1
        for i in sorted(early):  # none when every chunk came (each does, as KV or TEXT)
            busy += await self._fill_one(early.pop(i), emit)
        self.result.levels = [self._levels[i] for i in sorted(self._levels)]
        self.result.stage_s["fill"] = busy

    async def _fill_one(self, item: Item, emit: Callable[[events.Event], Awaitable[None]]) -> float:
        """Chunk `item` into the buffer and its event to the client; returns the seconds copying."""
        busy = 0.0
        s, e = self.plan.bounds[item.i]
        if item.kind == "kv" and self._texted and self.options.text_last:
            # whoever sent it (a peer that ignored the FETCH's text_last, a local chunk after an
            # evicted one), KV after a hole is what a text_last client cannot load: it recomputes it
            why = f"chunk {item.i} came as KV after a TEXT chunk, and the fetch takes TEXT only after every KV chunk"
            log.warning("%s: recompute it", why)
            self.result.errors.append(f"{why}: recompute it")
            self.metrics.error("kv_after_text")
            item.kind, item.level, item.error, item.kv, item.on_device = "text", TEXT, why, None, None
        self._texted = self._texted or item.kind == "text"
        if item.kind == "kv" and not item.filled:
            t = time.perf_counter()
            if item.on_device is not None:  # copied on the fill stream
                done = self.stages.fill(item.on_device, self.buffer.dense()[:, :, s:e])  # (GPU stages: dense layouts)
                if done is not None:
                    await asyncio.to_thread(done.synchronize)
            else:
                await asyncio.to_thread(self._fill_cpu, item.i, item.kv)
            busy += time.perf_counter() - t
            item.kv = item.on_device = None
        self._levels[item.i] = item.level
        self.result.events += 1
        await emit(events.Chunk(
            item.i, s, e, item.kind, item.level, item.source, t_ms=round((time.monotonic() - self.t0) * 1000, 2),
            bytes=item.nbytes, arrived_ms=round((item.arrived - self.t0) * 1000, 2) if item.arrived else None,
            error=item.error or None))
        return busy
