"""What a node does for the model processes on its host, as the local API sees it: put a
context, fetch a prompt's longest cached prefix (an async iterator of `events`), look a prompt
up, list, pin and delete contexts, hold and release fetch buffers, report status. The daemon
(daemon.py) builds the parts and owns their life cycle; this holds the work.

The file is long (~600 lines) because the Node still holds puts, fetches, pins and status in one
class; splitting it into node/puts.py, fetches.py and pins.py is the next step of the rooms issue."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator

import torch

from codec import layout
from codec.errors import CodecError
from codec.parallel import WorkerLost
from codec.profile import Profile

from kvstreamd import __version__, events

from kvstreamd.ops import diagnosis, health
from kvstreamd.handoff.buffers import FetchBuffer, HostBuffer
from kvstreamd.config import Config
from kvstreamd.coder import Coder
from kvstreamd.cluster.directory import Directory
from kvstreamd.events import FetchRequest
from kvstreamd.experiment import CANDIDATE, CONTROL, Experiment
from kvstreamd.ops.outcomes import FILE_NAME as OUTCOMES_FILE, FetchOutcomes, Outcome
from kvstreamd.metrics import Metrics
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.node.fetch import FetchJob, plan
from kvstreamd.cluster.prefetch import Prefetcher
from kvstreamd.handoff.shm import Reader as SegmentReader, ShmError
from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.store.keys import chunk_keys
from kvstreamd.store.pins import PinRefused
from kvstreamd.store.store import NO_ROOM, Store, StoreError

log = logging.getLogger("kvstreamd.node")

EVENT_QUEUE = 2  # events between a fetch and its client: a slow reader slows the fill stage


class RequestError(Exception):
    """A request the node cannot serve as asked; the API answers it with `status` and
    {"error": {"code", "message", **detail}}."""

    def __init__(self, status: int, code: str, message: str, detail: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.detail = detail or {}


@dataclass
class _PutOutcome:
    stored: int = 0  # chunks the store took
    held: int = 0  # chunks it held already
    disk_error: OSError | None = None  # a chunk of this put could not be written to disk
    refused: tuple[int, StoreError] | None = None  # the chunk the store refused (the put stopped there)


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _where(placement: list[str | None]) -> str:
    """Where a put's chunks are, in words: "chunks 0-2 are on disk; chunk 3 is held in memory only"."""
    n, parts = len(placement), []
    for where, words in (("disk", "on disk"), ("memory", "held in memory only and lost on a restart"),
                         (None, "not held")):
        idx = [i for i, w in enumerate(placement) if w == where]
        if idx:
            parts.append(f"chunk{'s' if len(idx) > 1 else ''} {_ranges(idx)} of {n} "
                         f"{'are' if len(idx) > 1 else 'is'} {words}")
    return "; ".join(parts)


@dataclass
class _Held:
    buffer: FetchBuffer
    expires: float  # time.monotonic()


class Node:
    def __init__(self, cfg: Config, store: Store, directory: Directory, coder: Coder, peers: PeerManager,
                 metrics: Metrics, gpu: torch.device | None, gpu_why: str) -> None:
        self.cfg = cfg  # the daemon swaps in a reloaded one
        self.store = store
        self.directory = directory
        self.coder = coder
        self.peers = peers
        self.metrics = metrics
        self.gpu = gpu  # where fetches that ask for device "cuda" decode; None: the CPU, because gpu_why
        self.gpu_why = gpu_why
        self.prefetch = Prefetcher(lambda: self.cfg, store, directory, peers, coder, metrics)
        self.stopping = False
        self.started = time.time()
        self.recent_fetches = health.RecentFetches()  # what /v1/status judges the fetch thresholds over
        self.preload = None  # the daemon's preload_child.PreloadChild, when [store] preload names documents
        self.buffers: dict[str, _Held] = {}
        self._stages: dict[bytes, object] = {}  # codec.gpu stages per profile id
        self._fetch_slots = asyncio.Semaphore(cfg.api.max_fetches)  # fetches that need a peer
        self._local_slots = asyncio.Semaphore(cfg.api.max_fetches)  # fetches the local store serves whole
        self._active: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()  # fetched chunks being stored
        # what each fetch came to, for `kvstreamd ab report` (GET /v1/ab); kept beside the store
        self.outcomes = FetchOutcomes(cfg.store.dir / OUTCOMES_FILE if cfg.store.dir else None)

    @property
    def node_id(self) -> str:
        return self.cfg.node.id

    def set_max_fetches(self, n: int) -> None:
        self._fetch_slots = asyncio.Semaphore(n)
        self._local_slots = asyncio.Semaphore(n)

    def profile_for(self, model_id: str) -> Profile:
        try:
            return self.coder.profile_for(model_id)
        except CodecError as e:
            raise RequestError(400, "unknown_model", str(e)) from None

    # -- put ---------------------------------------------------------------------------------

    async def put(self, model_id: str, tokens: list[int], buffer: str, shape: tuple[int, ...], dtype: str,
                  start: int = 0, pin: bool = False) -> dict:
        """Store a context whose KV the client left in the shared-memory segment `buffer`. With
        `start` (a multiple of chunk_tokens, below len(tokens)) the segment holds only the KV of
        tokens[start:], and the chunks before it must be held here already: a long context is
        put piece by piece, so that no one request needs all of its KV in memory at once. `pin`:
        pin the whole context once stored (see pin())."""
        prof = self.profile_for(model_id)
        ct = self.cfg.codec.chunk_tokens
        if pin:
            self._room_to_pin(chunk_keys(model_id, tokens, ct)[-1])  # before any encoding
        if start % ct or not 0 <= start < len(tokens):
            raise RequestError(400, "bad_start", f"start {start} must be a multiple of chunk_tokens ({ct}) "
                                                 f"below the {len(tokens)} tokens")
        want = (prof.layers, 2, len(tokens) - start, prof.heads, prof.head_dim)
        if tuple(shape) != want:
            raise RequestError(400, "bad_shape", f"KV shape {list(shape)} is not [L, 2, T, H, D] = {list(want)} "
                                                 f"for {model_id} and tokens {start}..{len(tokens)}")
        if start:
            prefix = chunk_keys(model_id, tokens[:start], ct)
            missing = next((i for i, k in enumerate(prefix) if not self.store.has(k)), None)
            if missing is not None:
                raise RequestError(409, "missing_prefix", f"chunk {missing} of the {len(prefix)} before start "
                                                          f"{start} is not held here: put them first")
        try:  # read by copy, never mapped: the client may truncate it under us (shm trap 4)
            seg = SegmentReader.open(buffer, tuple(shape), dtype)
        except ShmError as e:
            raise RequestError(400, "bad_buffer", str(e)) from None
        t0 = time.perf_counter()
        try:
            out = await self._put(model_id, tokens, seg, prof, start)
        except WorkerLost as e:
            raise RequestError(503, "codec_unavailable", f"encoding failed: {e}") from None
        except ShmError as e:  # the client shrank the segment mid-put; the chunks read before it are kept
            raise RequestError(400, "bad_buffer", str(e)) from None
        finally:
            seg.close()
        keys = chunk_keys(model_id, tokens, self.cfg.codec.chunk_tokens)
        # Where each chunk is as the put ends (a later chunk may have evicted an earlier one), so
        # that nothing it answers "stored" is lost unsaid: "memory" chunks go with a restart.
        placement = self.store.placement(keys)
        reply = {"keys": [k.hex() for k in keys], "stored_chunks": out.stored, "already_held": out.held,
                 "placement": placement, "seconds": round(time.perf_counter() - t0, 4)}
        if out.refused is not None:
            i, e = out.refused
            code = "store_full" if e.os_error is None else "disk_full" if e.os_error.errno in NO_ROOM else "disk_error"
            raise RequestError(507, code, f"chunk {i} of {len(keys)} is refused, and the chunks after it: {e}. "
                                          f"{_where(placement)}", {"put": reply})
        if out.disk_error is not None:
            full = out.disk_error.errno in NO_ROOM
            raise RequestError(507, "disk_full" if full else "disk_error",
                               f"the store's disk {'is full' if full else 'fails'} ({out.disk_error}): "
                               f"{_where(placement)}", {"put": reply})
        if pin:
            reply["pinned"] = await self._pin(keys, {"put": reply})
        return reply

    async def _put(self, model_id: str, tokens: list[int], kv: SegmentReader, prof: Profile,
                   start: int = 0) -> _PutOutcome:
        """Chunk, encode every level (in the codec pool), store, advertise. Chunks already held
        are skipped before any encoding. A chunk the store refuses ends the put (the chunks after
        it could not be found without it). kv holds tokens[start:] (start: a chunk boundary)."""
        ct = self.cfg.codec.chunk_tokens
        keys = chunk_keys(model_id, tokens, ct)
        dtype = str(kv.dtype).removeprefix("torch.")
        out = _PutOutcome()
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            if i * ct < start:
                continue
            if self.store.has(key):
                out.held += 1
                self.metrics.puts.labels("already_held").inc()
                if self.store.placement([key]) == ["memory"]:  # its write failed before: again, now
                    again = await asyncio.to_thread(self.store.persist, key)
                    out.disk_error = out.disk_error or (again.disk_error if again is not None else None)
                continue
            s, e = i * ct, min((i + 1) * ct, len(tokens))
            payloads = {}
            shape = (kv.shape[0], 2, e - s, *kv.shape[3:])
            with self.coder.staged(shape, kv.dtype) as chunk:  # read once, where the codec workers code it
                await asyncio.to_thread(kv.read, s - start, e - start, 2, chunk)  # kv[:, :, s:e], copied
                for level in self.cfg.codec.levels:
                    payloads[level] = await asyncio.to_thread(self.coder.encode, chunk, level, prof, s)
                    self.metrics.stored(level, chunk.numel() * 2, len(payloads[level]))
                del chunk
            rec = ChunkRecord.of_chunk(keys, i, (s, e), model_id, tokens, dtype, shape, payloads, time.time())
            try:
                put = await asyncio.to_thread(self.store.put_to, rec)
            except StoreError as e:
                out.refused = (i, e)
                self.metrics.puts.labels("refused").inc()
                break
            if put is not None:
                out.stored += 1
                out.disk_error = out.disk_error or put.disk_error
                self.metrics.puts.labels("stored" if put.on_disk else "memory_only").inc()
            else:
                out.held += 1
        self.metrics.encode_seconds.observe(time.perf_counter() - t0)
        log.info("put %s: %d tokens from %d, %d chunks stored, %d already held%s, %.2f s", model_id, len(tokens),
                 start, out.stored, out.held, f", chunk {out.refused[0]} refused" if out.refused else "", time.perf_counter() - t0)
        return out

    # -- fetch -------------------------------------------------------------------------------

    async def fetch(self, req: FetchRequest) -> AsyncIterator[events.Event]:
        """The fetch's events as they happen: Start, a Chunk per chunk, then End (or Failed).
        Closing the iterator early (the client went away) cancels the fetch and frees its buffer."""
        prof = self.profile_for(req.model_id)
        if self.stopping:
            raise RequestError(503, "stopping", "the daemon is shutting down")
        queue: asyncio.Queue[events.Event] = asyncio.Queue(EVENT_QUEUE)
        task = asyncio.ensure_future(self._run_fetch(req, prof, queue.put))
        self.prefetch.waits_for(task)  # a prefetch yields the link to it
        self._active.add(task)
        task.add_done_callback(self._active.discard)
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

    async def _run_fetch(self, req: FetchRequest, prof: Profile, emit) -> None:
        """Run a fetch in one of [api] max_fetches slots. Local work never queues behind a
        peer: a fetch the local store serves whole (or a miss) takes a slot of its own pool,
        so the slots that fetches waiting on peers hold cannot starve it. Those are held at
        most the fetch's deadline plus grace whatever the peers do (pipeline.py), and the
        deadline counts from here, so a fetch that waited for a slot has that much less for
        its peers."""
        arrived = time.monotonic()
        exp = self.cfg.policy.experiment  # one for the whole fetch, whatever a reload does meanwhile
        arm = exp.arm(req.model_id, req.tokens)
        p = await plan(self.store, self.directory, req.model_id, req.tokens, self.cfg.codec.chunk_tokens,
                       self._levels(req, exp, arm))
        async with self._local_slots if p.found == p.local else self._fetch_slots:
            await self._fetch(req, prof, emit, arrived, exp, arm)

    async def _fetch(self, req: FetchRequest, prof: Profile, emit, arrived: float | None = None,
                     exp: Experiment = Experiment(), arm: str = CONTROL) -> None:
        self.metrics.fetches_active.inc()
        t0 = time.monotonic()
        cfg = self.cfg
        tokens, dtype = req.tokens, req.dtype
        # planned again now that it has a slot: what is held may have changed while it waited
        p = await plan(self.store, self.directory, req.model_id, tokens, cfg.codec.chunk_tokens,
                       self._levels(req, exp, arm))
        shape = (prof.layers, 2, p.found_tokens, prof.heads, prof.head_dim)
        parts = layout.fetch_parts(prof.layout, p.found_tokens, cfg.codec.chunk_tokens)
        flat = (layout.parts_numel(parts, p.found_tokens, prof.heads, prof.head_dim),)
        on_gpu = req.device == "cuda" and self.gpu is not None
        self.prefetch.fetched(req.model_id, tokens, p)  # learnt from; its likely successors queued
        buf: FetchBuffer | None = None
        if p.found:
            buf = await self._allocate(flat, dtype, on_gpu)
            self.hold_buffer(buf)  # held from here, so that any failure below releases it
        view = None
        ok = False
        try:
            if buf is not None:
                whole = buf.tensor(flat, dtype)
                view = layout.over(whole, parts, p.found_tokens, prof.heads, prof.head_dim)
            place = buf.placement() if buf is not None else {"device": str(self.gpu) if on_gpu else "cpu"}
            await emit(events.Start(
                buffer=buf.name if buf else None, shape=list(shape), dtype=dtype, prompt_tokens=len(tokens),
                found_tokens=p.found_tokens, chunk_tokens=cfg.codec.chunk_tokens,
                local_tokens=p.bounds[p.local - 1][1] if p.local else 0, lease_s=cfg.api.buffer_lease_s,
                gpu_unavailable=self.gpu_why if req.device == "cuda" and not on_gpu else None,
                parts=parts if p.found else None, **place))
            job = FetchJob(p, req.model_id, tokens, req.deadline_ms or cfg.fetch.deadline_ms, view, self.store,
                           self.peers, self.coder, self.metrics, self._levels(req, exp, arm))
            job.recompute_tps = req.recompute_tokens_per_s or cfg.fetch.recompute_tokens_per_s
            job.rule = (exp.rule or None) if arm == CANDIDATE else None
            job.stall_s, job.started_at = cfg.fetch.stall_s, arrived
            if isinstance(buf, HostBuffer):  # the codec workers decode straight into it
                job.segment = (buf.name, whole)
            if on_gpu and p.found and prof.layout.is_dense:  # (a hybrid model's parts fill from the CPU decoders)
                job.stages = await asyncio.to_thread(self._stages_for, prof)
            res = await job.run(emit)
            job.buffer = job.segment = None
            if job.arrived and cfg.store.keep_fetched:  # off the fetch's path: its client has every chunk already
                self.prefetch.waits_for(self._spawn(self._keep_arrived(req.model_id, tokens, p, prof, job.arrived)))
            total = time.monotonic() - t0
            self.recent_fetches.add(total, res.stage_s["decode"])
            text_ranges = [[*p.bounds[i]] for i, lv in enumerate(res.levels) if lv == "text"]
            text_tokens = sum(e - s for s, e in text_ranges)
            kv_tokens = p.found_tokens - text_tokens
            self._account(p, tokens, kv_tokens, text_tokens, total, res, arm)
            if p.found:
                await asyncio.to_thread(self.outcomes.add, Outcome.of(
                    time.time(), arm, exp.label, total, res.deadline_missed, res.levels, res.bytes, p.found_tokens))
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
                self.release_buffer(buf.name)  # nobody will attach to a failed fetch's buffer

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _keep_arrived(self, model_id: str, tokens: list[int], p, prof: Profile,
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

    def _levels(self, req: FetchRequest, exp: Experiment, arm: str) -> list[str]:
        """The levels a fetch takes chunks at (TEXT aside): those it asked for, else the
        candidate's ladder in an experiment's candidate arm, else the node's."""
        if not req.levels and arm == CANDIDATE and exp.levels:
            return list(exp.levels)
        return list(req.levels or self.cfg.codec.levels)

    async def _allocate(self, shape, dtype: str, on_gpu: bool) -> FetchBuffer:
        if on_gpu:
            from kvstreamd.handoff.cuda_ipc import CudaBuffer
            return await asyncio.to_thread(CudaBuffer.create, shape, dtype, self.gpu.index)
        return HostBuffer.create(shape, dtype)

    def _account(self, p, tokens, kv_tokens, text_tokens, total, res, arm: str) -> None:
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

    async def cancel_fetches(self) -> None:
        """Shutdown: every fetch in flight ends (its client gets a Failed("stopping") event)."""
        self.stopping = True
        log.info("stopping: %d fetches in flight are cancelled", len(self._active))
        for t in list(self._active):
            t.cancel()
        await asyncio.gather(*self._active, return_exceptions=True)
        await self.prefetch.stop()
        await asyncio.gather(*self._background, return_exceptions=True)  # before the store closes

    # -- buffers -----------------------------------------------------------------------------

    def hold_buffer(self, buf: FetchBuffer) -> None:
        self.buffers[buf.name] = _Held(buf, time.monotonic() + self.cfg.api.buffer_lease_s)

    def release_buffer(self, name: str) -> bool:
        held = self.buffers.pop(name, None)
        if held is None:
            return False
        try:
            held.buffer.release()
        except Exception as e:  # a view still alive in this process: leave the mapping to GC
            log.warning("buffer %s: %s", name, e)
        return True

    def release_all(self) -> None:
        for name in list(self.buffers):
            self.release_buffer(name)

    def expire_buffers(self, now: float) -> None:
        for name, held in list(self.buffers.items()):
            if held.expires < now:
                log.info("buffer %s: lease expired unreleased; unlinked", name)
                self.metrics.error("buffer_lease_expired")
                self.release_buffer(name)

    # -- what the node holds and knows ---------------------------------------------------------

    async def lookup(self, model_id: str, tokens: list[int]) -> dict:
        self.profile_for(model_id)
        p = await plan(self.store, self.directory, model_id, tokens, self.cfg.codec.chunk_tokens)
        tok = lambda n: p.bounds[n - 1][1] if n else 0  # noqa: E731
        return {"prompt_tokens": len(tokens), "chunks": len(p.keys), "local_tokens": tok(p.local),
                "peers": {peer: tok(n) for peer, n in p.peers.items()}, "found_tokens": p.found_tokens}

    async def contexts(self) -> list[dict]:
        pinned = {p.key for p in await asyncio.to_thread(self.store.pins)}
        return [{"key": c.key.hex(), "model_id": c.model_id, "tokens": c.tokens, "chunks": c.chunks,
                 "complete": c.complete, "created": c.created, "bytes": c.nbytes, "pinned": c.key in pinned}
                for c in await asyncio.to_thread(self.store.contexts)]

    # -- lasting pins ------------------------------------------------------------------------

    async def pin(self, model_id: str, tokens: list[int]) -> dict:
        """Pin the context held here whole for these tokens: eviction passes its chunks over
        until it is unpinned or deleted. 409 pin_refused when a chunk is not held or the pin
        would go over [store] pin_budget."""
        self.profile_for(model_id)
        keys = chunk_keys(model_id, tokens, self.cfg.codec.chunk_tokens)
        new = await self._pin(keys)
        u = self.store.usage()
        return {"key": keys[-1].hex(), "chunks": len(keys), "pinned": new, "pinned_bytes": u.pinned_bytes,
                "pin_budget": u.pin_budget}

    async def _pin(self, keys: list[bytes], detail: dict | None = None) -> int:
        try:
            return await asyncio.to_thread(self.store.pin_context, keys)
        except PinRefused as e:
            raise RequestError(409, "pin_refused", f"pin refused: {e}"
                               + ("; the context is stored, unpinned" if detail else ""), detail) from None

    def _room_to_pin(self, key: bytes) -> None:
        """A put to pin is refused before any encoding when the pin budget is spent already."""
        u = self.store.usage()
        if u.pinned_bytes >= u.pin_budget and not self.store.is_pinned(key):
            raise RequestError(409, "pin_refused", f"pin refused: {u.pinned_bytes} bytes are pinned and "
                                                   f"[store] pin_budget is {u.pin_budget} bytes")

    async def unpin(self, key: bytes) -> None:
        if not await asyncio.to_thread(self.store.unpin_context, key):
            raise RequestError(404, "not_found", f"no pinned context ends at chunk {key.hex()}")

    async def pins(self) -> list[dict]:
        return [{"key": p.key.hex(), "chunks": p.chunks, "bytes": p.nbytes}
                for p in await asyncio.to_thread(self.store.pins)]

    async def delete_context(self, key: bytes) -> int:
        if not self.store.has(key):
            raise RequestError(404, "not_found", f"no context ends at chunk {key.hex()}")
        return await asyncio.to_thread(self.store.delete_context, key)

    async def doctor(self) -> dict:
        return await diagnosis.report(self.metrics.recent_errors, self.store, self.coder, self.gpu, self.gpu_why)

    async def probe_peers(self, size: int, timeout_s: float) -> list[dict]:
        return await diagnosis.probe_peers(self.peers, size, timeout_s)

    def peer_info(self) -> list[dict]:
        return self.peers.info()

    def degraded(self) -> list[dict]:
        """What the node cannot do in full now, one {"reason", "message"} per fault (reasons:
        metrics.DEGRADED); each clears by itself when its fault goes away."""
        out = []
        why = self.coder.pool.fault()
        if why is not None:
            out.append({"reason": "codec_workers", "message": f"{why}; new workers are being started"})
        disk = self.store.disk_fault()
        if disk is not None:
            out.append({"reason": disk.reason, "message": disk.message})
        why = self.directory.fault()
        if why is not None:
            out.append({"reason": "directory", "message": why})
        return out

    def health(self) -> dict:
        """{"status": "ok" | "degraded" | "stopping", "node_id"}, and "degraded" (the faults) when
        degraded. Still alive and serving when degraded."""
        if self.stopping:
            return {"status": "stopping", "node_id": self.node_id}
        faults = self.degraded()
        if faults:
            return {"status": "degraded", "node_id": self.node_id, "degraded": faults}
        return {"status": "ok", "node_id": self.node_id}

    def ab(self) -> dict:
        """GET /v1/ab: the experiment in force and the latest fetch outcomes, oldest first."""
        return {"node_id": self.node_id, "experiment": self.cfg.policy.experiment.describe(),
                "outcomes": self.outcomes.as_json()}

    def record_error(self, kind: str) -> None:
        self.metrics.error(kind)

    def metrics_text(self) -> bytes:
        u = self.store.usage()
        m = self.metrics
        m.store_bytes.labels("memory").set(u.memory_bytes)
        m.store_bytes.labels("disk").set(u.disk_bytes)
        m.store_budget.labels("memory").set(u.memory_budget)
        m.store_budget.labels("disk").set(u.disk_budget)
        m.store_chunks.set(u.chunks)
        m.store_evictions.set(u.evictions)
        m.store_pinned.set(u.pinned_bytes)
        m.store_budget.labels("pin").set(u.pin_budget)
        m.buffers_held.set(len(self.buffers))
        m.buffer_bytes.set(sum(h.buffer.nbytes for h in self.buffers.values()))
        m.set_degraded({f["reason"] for f in self.degraded()})
        m.set_codec_restarts(self.coder.pool.restarts)
        m.set_peers_up({p["address"]: p["connected"] for p in self.peers.info() if p["configured"]})
        return m.render()

    def status(self) -> dict:
        u = self.store.usage()
        cfg = self.cfg
        faults = self.degraded()
        return {"node_id": self.node_id, "version": __version__, "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started, 1), "config": str(cfg.source) if cfg.source else None,
                "api_socket": str(cfg.api.socket), "peer_port": self.peers.port,
                "peers_connected": self.peers.connected(), "fetches_active": len(self._active),
                "buffers_held": len(self.buffers), "decode_mbps": round(self.coder.decode_mbps, 1),
                "levels": list(cfg.codec.levels), "chunk_tokens": cfg.codec.chunk_tokens,
                "directory": self.directory.info(), "prefetch": self.prefetch.info(),
                "health": {"status": "stopping" if self.stopping else "degraded" if faults else "ok",
                           "degraded": faults},
                "thresholds": health.report(self.recent_fetches, self.metrics.compression_ratio,
                                            self.metrics.link_utilisation),
                "codec": {"workers": self.coder.pool.workers, "restarts": self.coder.pool.restarts,
                          "last_loss": self.coder.pool.last_loss},
                "store": {k: getattr(u, k) for k in ("chunks", "memory_bytes", "memory_budget", "disk_bytes",
                                                      "disk_budget", "memory_chunks", "disk_chunks", "pinned",
                                                      "evictions", "disk_errors", "pinned_bytes",
                                                      "pin_budget")},
                "preload": self.preload.info() if self.preload is not None else None}

