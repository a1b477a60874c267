"""A node's fetches for its local clients: each is planned once as it arrives (the longest
prefix of its prompt here and at the peers), given a slot, run (node/fetch.py's pipeline) into a
buffer it hands over, and reported as events; what peers sent is kept to serve onward. The
node's features hear each fetch begin and end (kvstreamd/features.py)."""
from __future__ import annotations

import asyncio
import logging
import shutil
import time
from typing import AsyncIterator, Callable

import torch

from codec import layout
from codec.profile import Profile

from kvstreamd import events
from kvstreamd.cluster.directory import Directory
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.coder import Coder
from kvstreamd.config import Config
from kvstreamd.requests import FetchRequest
from kvstreamd.features import Feature, FetchBegan, FetchEnded
from kvstreamd.handoff.buffers import FetchBuffer, HostBuffer, nbytes_of
from kvstreamd.handoff.shm import SHM_DIR
from kvstreamd.metrics import Metrics
from kvstreamd.node.errors import RequestError
from kvstreamd.node.fetch import FetchJob
from kvstreamd.node.plan import Plan, plan
from kvstreamd.node.leases import BufferLeases
from kvstreamd.node.options import FetchOptions
from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.store.store import Store, StoreError

log = logging.getLogger(__name__)

EVENT_QUEUE = 2  # events between a fetch and its client: a slow reader slows the fill stage


class Fetches:
    def __init__(self, cfg: Config, store: Store, directory: Directory, coder: Coder, peers: PeerManager,
                 metrics: Metrics, leases: BufferLeases, features: list[Feature],
                 profile_for: Callable[[str], Profile], gpu: torch.device | None, gpu_why: str) -> None:
        self.cfg = cfg  # what each fetch's options are built from; reconfigure() swaps in a reloaded one
        self.store = store
        self.directory = directory
        self.coder = coder
        self.peers = peers
        self.metrics = metrics
        self.leases = leases
        self.features = features
        self.profile_for = profile_for  # model id -> its profile; RequestError for an unknown model
        self.gpu = gpu  # where fetches that ask for device "cuda" decode; None: the CPU, because gpu_why
        self.gpu_why = gpu_why
        self.stopping = False
        self._stages: dict[bytes, object] = {}  # codec.gpu stages per profile id
        self._set_slots(cfg.api.max_fetches)
        self.active: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()  # fetched chunks being stored

    def _set_slots(self, n: int) -> None:
        self.max_fetches = n  # in each pool
        self._fetch_slots = asyncio.Semaphore(n)  # fetches that need a peer
        self._local_slots = asyncio.Semaphore(n)  # fetches the local store serves whole (or nothing)

    def reconfigure(self, cfg: Config) -> None:
        if cfg.api.max_fetches != self.max_fetches:  # fetches from now on take the new slots
            self._set_slots(cfg.api.max_fetches)
        self.cfg = cfg

    def options(self, req: FetchRequest) -> FetchOptions:
        """What a fetch of `req` arriving now runs by."""
        return FetchOptions.of(req, self.cfg, time.monotonic())

    async def fetch(self, req: FetchRequest) -> AsyncIterator[events.Event]:
        """The fetch's events as they happen: Start, a Chunk per chunk, then End (or Failed).
        Closing the iterator early (the client went away) cancels the fetch and frees its buffer."""
        prof = self.profile_for(req.model_id)
        if self.stopping:
            raise RequestError(503, "stopping", "the daemon is shutting down")
        opts = self.options(req)
        queue: asyncio.Queue[events.Event] = asyncio.Queue(EVENT_QUEUE)
        task = asyncio.ensure_future(self._run(opts, prof, queue.put))
        self.active.add(task)
        task.add_done_callback(self.active.discard)
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                    continue
                get.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                break
            if task.cancelled():
                if self.stopping:
                    yield events.Failed("stopping", "the daemon is shutting down")
            elif task.exception() is not None:
                e = task.exception()
                log.error("fetch of %d tokens failed", len(req.tokens), exc_info=e)
                self.metrics.error("fetch_internal")
                yield events.Failed("internal", f"{type(e).__name__}: {e}")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _run(self, o: FetchOptions, prof: Profile, emit) -> None:
        """Plan the fetch, once, then run it in one of [api] max_fetches slots. Local work never
        queues behind a peer: a fetch the local store serves whole (or a miss) takes a slot of
        its own pool, so the slots that fetches waiting on peers hold cannot starve it. Those
        are held at most the fetch's wait plus grace whatever the peers do (fetch.py), and
        the deadline counts from its arrival, so a fetch that waited for a slot has that much
        less for its peers. What changed while it waited (a chunk evicted, a holder gone) the
        pipeline meets as it meets any: the chunk comes from another holder or as TEXT."""
        p = await plan(self.store, self.directory, o.model_id, list(o.tokens), o.chunk_tokens, list(o.levels))
        began = FetchBegan(o.model_id, o.tokens, p, asyncio.current_task())
        for f in self.features:
            f.fetch_began(began)
        async with self._local_slots if p.found == p.local else self._fetch_slots:
            await self._fetch(o, p, prof, emit)

    async def _fetch(self, o: FetchOptions, p: Plan, prof: Profile, emit) -> None:
        self.metrics.fetches_active.inc()
        t0 = time.monotonic()
        tokens = o.tokens
        shape = (prof.layers, 2, p.found_tokens, prof.heads, prof.head_dim)
        parts = layout.fetch_parts(prof.layout, p.found_tokens, o.chunk_tokens)
        flat = (layout.parts_numel(parts, p.found_tokens, prof.heads, prof.head_dim),)
        on_gpu = o.device == "cuda" and self.gpu is not None
        buf: FetchBuffer | None = None
        reserving: asyncio.Future | None = None
        if p.found:
            buf = await self._allocate(flat, o.dtype, on_gpu)
            self.leases.hold(buf)  # held from here, so that any failure below releases it
            if isinstance(buf, HostBuffer):
                # Its pages are allocated on a thread while the request goes out to the peers (~20 ms
                # for 94 MB, which held up the event loop and every fetch's first chunk); the job
                # writes nothing into the buffer before they are.
                reserving = asyncio.ensure_future(asyncio.to_thread(buf.reserve))
                reserving.add_done_callback(lambda t: t.cancelled() or t.exception())  # the job reports it
        view = None
        ok = False
        try:
            segment = None
            if buf is not None:
                whole = buf.tensor(flat, o.dtype)
                view = layout.over(whole, parts, p.found_tokens, prof.heads, prof.head_dim)
                if isinstance(buf, HostBuffer):  # the codec workers decode straight into it
                    segment = (buf.name, whole)
            place = buf.placement() if buf is not None else {"device": str(self.gpu) if on_gpu else "cpu"}
            await emit(events.Start(
                buffer=buf.name if buf else None, shape=list(shape), dtype=o.dtype, prompt_tokens=len(tokens),
                found_tokens=p.found_tokens, chunk_tokens=o.chunk_tokens,
                local_tokens=p.bounds[p.local - 1][1] if p.local else 0, lease_s=self.leases.lease_s,
                gpu_unavailable=self.gpu_why if o.device == "cuda" and not on_gpu else None,
                parts=parts if p.found else None, **place))
            stages = None
            if on_gpu and p.found and prof.layout.is_dense:  # (a hybrid model's parts fill from the CPU decoders)
                stages = await asyncio.to_thread(self._stages_for, prof)
            job = FetchJob(p, o, view, self.store, self.peers, self.coder, self.metrics, segment=segment,
                           stages=stages, reserving=reserving)
            res = await job.run(emit)
            if job.arrived and o.keep_fetched:  # off the fetch's path: its client has every chunk already
                kept = self._spawn(self._keep_arrived(o.model_id, tokens, p, prof, job.arrived))
                for f in self.features:
                    f.node_busy(kept)
            total = time.monotonic() - t0
            text_ranges = [[*p.bounds[i]] for i, lv in enumerate(res.levels) if lv == "text"]
            text_tokens = sum(e - s for s, e in text_ranges)
            kv_tokens = p.found_tokens - text_tokens
            self._account(p, tokens, kv_tokens, text_tokens, total, res, o.arm)
            ended = FetchEnded(o.model_id, o.arm, o.experiment, total, res.stage_s["decode"], res.deadline_missed,
                               res.levels, res.bytes, p.found_tokens)
            for f in self.features:
                await f.fetch_ended(ended)
            await emit(events.End(
                found_tokens=p.found_tokens, kv_tokens=kv_tokens, text_tokens=text_tokens, text_ranges=text_ranges,
                prefill_from=p.found_tokens, prefill_tokens=len(tokens) - p.found_tokens, levels=res.levels,
                bytes=res.bytes, deadline_missed=res.deadline_missed, errors=res.errors,
                timings={"total_s": round(total, 4), **{f"{k}_s": round(v, 4) for k, v in res.stage_s.items()}}))
            ok = True
        finally:
            del view
            self.metrics.fetches_active.dec()
            if not ok and buf is not None:
                self.leases.release(buf.name)  # nobody will attach to a failed fetch's buffer

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _keep_arrived(self, model_id: str, tokens, p: Plan, prof: Profile,
                            arrived: list[tuple[int, str, bytes]]) -> None:
        """Store the chunks a fetch received from peers, each at the level it came as and as
        the very bytes it came in (never coded again from the decoded, already lossy KV), so
        that this node serves them onward and the directory says so: a context spreads through
        the fleet as it is used. Chunks held here already are left as they are."""
        kept = 0
        for i, level, payload in arrived:
            key = p.keys[i]
            if self.store.has(key):
                continue
            s, e = p.bounds[i]
            rec = ChunkRecord.of_chunk(p.keys, i, (s, e), model_id, tokens, "float16",
                                       (prof.layers, 2, e - s, prof.heads, prof.head_dim), {level: payload})
            try:
                if await asyncio.to_thread(self.store.put_to, rec) is not None:
                    kept += 1
            except StoreError as e:
                log.info("fetched chunk %d (%s) not kept: %s", i, key.hex()[:16], e)
                break  # the chunks after it could not be found without it
        if kept:
            self.metrics.puts.labels("fetched").inc(kept)
            log.info("kept %d fetched chunks of %s to serve onward", kept, model_id)

    async def _allocate(self, shape, dtype: str, on_gpu: bool) -> FetchBuffer:
        if on_gpu:
            from kvstreamd.handoff.cuda_ipc import CudaBuffer
            return await asyncio.to_thread(CudaBuffer.create, shape, dtype, self.gpu.index)
        nbytes = nbytes_of(shape, dtype)
        spare = self.leases.spares.take(nbytes)
        if spare is not None:
            return spare
        gone = self.leases.spares.make_room(nbytes, shutil.disk_usage(SHM_DIR).free)
        if gone:  # their pages freed before the new buffer takes its own, off the event loop
            await asyncio.to_thread(lambda: [b.release_now() for b in gone])
        return HostBuffer.create(shape, dtype, reserve=False)  # reserved off the event loop (_fetch)

    def _account(self, p: Plan, tokens, kv_tokens, text_tokens, total, res, arm: str) -> None:
        m = self.metrics
        m.fetch_seconds.labels(arm).observe(total)
        if total > 0:
            m.decode_share.labels(arm).observe(min(res.stage_s["decode"] / total, 1.0))
        for stage, s in res.stage_s.items():
            m.stage_seconds.labels(stage, arm).observe(s)
        local_tokens = p.bounds[p.local - 1][1] if p.local else 0
        m.prompt_tokens.labels("local", arm).inc(local_tokens)
        m.prompt_tokens.labels("peer", arm).inc(max(kv_tokens - local_tokens, 0))
        m.prompt_tokens.labels("text", arm).inc(text_tokens)
        m.prompt_tokens.labels("prefill", arm).inc(len(tokens) - p.found_tokens)
        m.lookups.labels("hit" if p.found >= len(p.keys) - 1 and p.found else "partial" if p.found else "miss",
                         arm).inc()
        m.fetched(arm, res.levels, res.bytes, res.deadline_missed)

    def _stages_for(self, prof: Profile):
        """The GPU pipeline's streams and decoder tables for a profile, built once."""
        from codec.gpu import CudaStages
        st = self._stages.get(prof.id)
        if st is None:
            st = self._stages[prof.id] = CudaStages(prof, self.gpu)
        return st

    async def cancel_all(self) -> None:
        """Shutdown: every fetch in flight ends (its client gets a Failed("stopping") event), and
        the storing of what fetches brought finishes (before the store closes)."""
        self.stopping = True
        log.info("stopping: %d fetches in flight are cancelled", len(self.active))
        for t in list(self.active):
            t.cancel()
        await asyncio.gather(*self.active, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
