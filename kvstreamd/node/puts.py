"""A node's puts: a context's KV, handed over in shared memory, chunked, encoded at every
configured level in the codec pool, stored and (through the store) advertised."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from codec import steps
from codec.tuning import catalog, rate
from codec.errors import CodecError, NoSharedMemory
from codec.pool.parallel import WorkerLost
from codec.profile import Profile
from codec.tuning.rate import ChunkCost

from kvstreamd.coder import Coder
from kvstreamd.config import Config
from kvstreamd.handoff.shm import Reader as SegmentReader, ShmError
from kvstreamd.metrics import Metrics
from kvstreamd.node.errors import RequestError
from kvstreamd.node.pins import Pins
from kvstreamd.requests import PutRequest
from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.store.keys import chunk_bounds, chunk_keys, chunk_ranges
from kvstreamd.store.store import NO_ROOM, Store, StoreError

log = logging.getLogger(__name__)


@dataclass
class _PutOutcome:
    stored: int = 0  # chunks the store took
    held: int = 0  # chunks it held already
    disk_error: OSError | None = None  # a chunk of this put could not be written to disk
    refused: tuple[int, StoreError] | None = None  # the chunk the store refused (the put stopped there)


def _where(placement: list[str | None]) -> str:
    """Where a put's chunks are, in words: "chunks 0-2 are on disk; chunk 3 is held in memory only"."""
    n, parts = len(placement), []
    for where, words in (("disk", "on disk"), ("memory", "held in memory only and lost on a restart"),
                         (None, "not held")):
        idx = [i for i, w in enumerate(placement) if w == where]
        if idx:
            parts.append(f"chunk{'s' if len(idx) > 1 else ''} {chunk_ranges(idx)} of {n} "
                         f"{'are' if len(idx) > 1 else 'is'} {words}")
    return "; ".join(parts)


class Puts:
    def __init__(self, cfg: Config, store: Store, coder: Coder, metrics: Metrics, pins: Pins,
                 profile_for: Callable[[str], Profile]) -> None:
        self.chunk_tokens = cfg.codec.chunk_tokens
        self.levels = tuple(cfg.codec.levels)  # each chunk is stored at every one of them
        self.store = store
        self.coder = coder
        self.metrics = metrics
        self.pins = pins
        self.profile_for = profile_for  # model id -> its profile; RequestError for an unknown model

    def reconfigure(self, cfg: Config) -> None:
        self.levels = tuple(cfg.codec.levels)  # puts from now on

    async def put(self, req: PutRequest) -> dict:
        """Store a context whose KV the client left in the shared-memory segment `req.buffer`.
        With `start` (a multiple of chunk_tokens, below len(tokens)) the segment holds only the
        KV of tokens[start:], and the chunks before it must be held here already: a long context
        is put piece by piece, so that no one request needs all of its KV in memory at once.
        `pin`: pin the whole context once stored (see pin()). `chunk_costs`: what coding each
        chunk of the whole context costs the model (codec.tuning.rate), from its first chunk on; each
        chunk is then coded at its own scale at each level, else at the level's one scale.
        `token_classes`: the whole context's uint8 [L, n] step classes, raw (codec.tuning.token_steps),
        n >= len(tokens)."""
        model_id, tokens, start, shape = req.model_id, req.tokens, req.start, req.shape
        prof = self.profile_for(model_id)
        ct = self.chunk_tokens
        if req.pin:
            self.pins.room_to_pin(chunk_keys(model_id, tokens, ct)[-1])  # before any encoding
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
        scales = await asyncio.to_thread(self._scales, prof, req.chunk_costs, len(chunk_bounds(len(tokens), ct)))
        classes = _classes(prof, req.token_classes, len(tokens))
        try:  # read by copy, never mapped: the client may truncate it under us (shm trap 4)
            seg = SegmentReader.open(req.buffer, tuple(shape), req.dtype)
        except ShmError as e:
            raise RequestError(400, "bad_buffer", str(e)) from None
        t0 = time.perf_counter()
        try:
            out = await self._put(model_id, tokens, seg, prof, start, scales, classes)
        except WorkerLost as e:
            raise RequestError(503, "codec_unavailable", f"encoding failed: {e}") from None
        except NoSharedMemory as e:  # the chunks coded before it are kept
            raise RequestError(507, "shm_full", f"encoding failed: {e}") from None
        except ShmError as e:  # the client shrank the segment mid-put; the chunks read before it are kept
            raise RequestError(400, "bad_buffer", str(e)) from None
        finally:
            seg.close()
        keys = chunk_keys(model_id, tokens, self.chunk_tokens)
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
        if req.pin:
            reply["pinned"] = await self.pins.pin_keys(keys, {"put": reply})
        return reply

    def _scales(self, prof: Profile, costs: list[ChunkCost] | None, chunks: int) -> dict[str, list[float | None]]:
        """Each stored level's scale for each chunk of the request (codec.tuning.rate), None where the
        level's own; RequestError for costs that do not cover the request's chunks."""
        if costs is None:
            return {level: [None] * chunks for level in self.levels}
        self.coder.warm_for(prof)
        if len(costs) < chunks:
            raise RequestError(400, "bad_chunk_costs", f"chunk_costs lists {len(costs)} chunks, the tokens "
                                                       f"make {chunks} of {self.chunk_tokens}")
        return {level: rate.scales(level, prof, costs)[:chunks] if catalog.get(level).is_level else [None] * chunks
                for level in self.levels}

    async def _put(self, model_id: str, tokens: list[int], kv: SegmentReader, prof: Profile,
                   start: int = 0, scales: dict[str, list[float | None]] | None = None,
                   classes=None) -> _PutOutcome:
        """Chunk, encode every level (in the codec pool), store, advertise. Chunks already held
        are skipped before any encoding. A chunk the store refuses ends the put (the chunks after
        it could not be found without it). kv holds tokens[start:] (start: a chunk boundary)."""
        ct = self.chunk_tokens
        keys = chunk_keys(model_id, tokens, ct)
        bounds = chunk_bounds(len(tokens), ct)
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
            s, e = bounds[i]
            payloads = {}
            shape = (kv.shape[0], 2, e - s, *kv.shape[3:])
            with self.coder.staged(shape, kv.dtype) as chunk:  # read once, where the codec workers code it
                await asyncio.to_thread(kv.read, s - start, e - start, 2, chunk)  # kv[:, :, s:e], copied
                for level in self.levels:
                    scale = scales[level][i] if scales else None
                    payloads[level] = await asyncio.to_thread(self.coder.encode, chunk, level, prof, s, scale,
                                                              None if classes is None else classes[:, s:e])
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


def _classes(prof: Profile, raw: bytes | None, tokens: int):
    """A put's token classes as uint8 [L, tokens] (codec.tuning.token_steps), None without them;
    RequestError for classes that do not fit the model or the tokens."""
    if raw is None:
        return None
    n, rest = divmod(len(raw), prof.layers)
    if rest or n < tokens:
        raise RequestError(400, "bad_token_classes", f"token_classes hold {len(raw)} bytes: not {prof.layers} layers "
                                                     f"x at least {tokens} tokens")
    try:
        return steps.check_classes(np.frombuffer(raw, np.uint8).reshape(prof.layers, n), prof.layers, n)[:, :tokens]
    except CodecError as e:
        raise RequestError(400, "bad_token_classes", str(e)) from None
