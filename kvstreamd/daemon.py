"""The daemon: wires the store, the peer manager, the codec pool, the fetch pipeline and the
local API together, and owns the life cycle (start-up, SIGHUP reload, SIGTERM shutdown, and
systemd's READY/STOPPING notifications)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import torch
from aiohttp import web

from codec.parallel import SEG_PREFIX as CODEC_SEG_PREFIX

from . import __version__, sdnotify
from . import config as config_mod
from .api import make_app
from .coder import Coder
from .cuda_ipc import CudaBuffer
from .config import Config, ConfigError
from .directory import Directory
from .metrics import Metrics, set_level, setup_logging
from .peers import PeerManager
from .pipeline import FetchJob, allocate, plan
from .shm import Segment, sweep_stale
from .chunkfile import ChunkRecord
from .keys import chunk_keys
from .store import Store

log = logging.getLogger("kvstreamd.daemon")


class StartupError(Exception):
    """The daemon cannot start (socket in use, store not writable, ...); the message says why."""


def resolve_device(setting: str) -> tuple[torch.device | None, str]:
    """[codec] device -> the GPU that fetches asking for device "cuda" decode on, or None and
    why not. "auto" falls back to the CPU quietly; "cuda" that cannot be had is a start error."""
    if setting == "cpu":
        return None, '[codec] device = "cpu"'
    from codec import gpu
    ok, why = gpu.available()
    if ok and setting.startswith("cuda:") and int(setting[5:]) >= torch.cuda.device_count():
        ok, why = False, f"there are {torch.cuda.device_count()} CUDA devices"
    if not ok:
        if setting == "auto":
            return None, why
        raise StartupError(f'[codec] device = "{setting}": {why}')
    dev = torch.device(setting if setting != "auto" else "cuda")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device()), ""


@dataclass
class _Buffer:
    segment: Segment
    expires: float  # time.monotonic()


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.node_id = cfg.node.id
        self.metrics = Metrics()
        self.directory = Directory()
        self.store: Store | None = None
        self.coder: Coder | None = None
        self.gpu: torch.device | None = None  # where fetches that ask for device "cuda" decode
        self.gpu_why = ""  # why not, when gpu is None
        self._stages: dict[bytes, object] = {}  # codec.gpu.StreamStages per profile id
        self.peers: PeerManager | None = None
        self.stopping = False
        self.started = time.time()
        self.buffers: dict[str, _Buffer] = {}
        self._fetch_slots = asyncio.Semaphore(cfg.api.max_fetches)
        self._active: set[asyncio.Task] = set()
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task | None = None
        self._stop = asyncio.Event()

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        self.gpu, self.gpu_why = resolve_device(cfg.codec.device)
        swept = sweep_stale() + sweep_stale(CODEC_SEG_PREFIX)  # fetch buffers; the codec pool's segments
        if swept:
            log.info("removed %d shared-memory segments left by dead processes", len(swept))
        self.store = Store(cfg.store.dir, cfg.store.memory_budget, cfg.store.disk_budget,
                           on_add=lambda keys: self.peers and self.peers.keys_added(keys),
                           on_remove=lambda keys: self.peers and self.peers.keys_removed(keys))
        try:
            report = await asyncio.to_thread(self.store.open)
        except OSError as e:
            raise StartupError(f"[store] dir {cfg.store.dir}: {e}") from None
        log.info("store %s: %d chunks (%d bytes) on disk, %d corrupt files skipped", cfg.store.dir,
                 report.loaded, report.bytes, len(report.corrupt))
        for path, why in report.corrupt:
            log.warning("store: skipped corrupt file %s: %s", path, why)
            self.metrics.error("store_corrupt")
        self.coder = await asyncio.to_thread(Coder, cfg.workers(), cfg.codec.profile, cfg.codec.levels)
        log.info("fetched chunks decode on %s", f"{self.gpu} (CUDA streams, IPC hand-off)" if self.gpu
                 else f"the CPU ({self.gpu_why})")
        secret = cfg.secret()
        if secret is None:
            log.warning("no [peer] secret configured: using a random one, so no peer can join this node")
            secret = secrets.token_bytes(32)
        caps = {"levels": list(cfg.codec.levels), "decode_mbps": self.coder.decode_mbps,
                "recompute_tokens_per_s": cfg.stream.recompute_tokens_per_s, "version": __version__}
        self.peers = PeerManager(self.node_id, secret, cfg.peer, self.store, self.directory, self.metrics, caps,
                                 cfg.stream.recompute_tokens_per_s)
        try:
            await self.peers.start()
        except OSError as e:
            raise StartupError(f"[peer] listen {cfg.peer.listen[0]}:{cfg.peer.listen[1]}: {e.strerror or e}") from None
        await self._start_api()
        self._reaper = asyncio.ensure_future(self._reap_buffers())
        log.info("kvstreamd %s node %s: peers on %s:%d, API on %s", __version__, self.node_id, cfg.peer.listen[0],
                 self.peers.port, cfg.api.socket)
        sdnotify.ready(f"serving; peers on port {self.peers.port}")

    async def _start_api(self) -> None:
        path = Path(self.cfg.api.socket)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise StartupError(f"[api] socket {path}: exists and is not a socket")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(str(path))
                except OSError:
                    path.unlink()  # left by a daemon that died
                else:
                    raise StartupError(f"[api] socket {path}: another daemon is listening there")
        self._runner = web.AppRunner(make_app(self), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.UnixSite(self._runner, str(path))
        try:
            await site.start()
        except OSError as e:
            raise StartupError(f"[api] socket {path}: {e}") from None
        os.chmod(path, self.cfg.api.socket_mode)

    async def stop(self) -> None:
        """Stop accepting, cancel transfers, flush the store index, release every buffer."""
        if self.stopping:
            return
        self.stopping = True
        sdnotify.stopping()
        log.info("stopping: %d fetches in flight are cancelled", len(self._active))
        if self.peers is not None:
            await self.peers.stop()
        for t in list(self._active):
            t.cancel()
        await asyncio.gather(*self._active, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            with contextlib.suppress(FileNotFoundError):
                Path(self.cfg.api.socket).unlink()
        if self._reaper is not None:
            self._reaper.cancel()
        for name in list(self.buffers):
            self.release_buffer(name)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
        if self.coder is not None:
            await asyncio.to_thread(self.coder.close)
        log.info("stopped")

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        try:
            await self._stop.wait()
        finally:
            await self.stop()

    async def reload(self) -> None:
        """SIGHUP: re-read the config file; apply what can change at run time."""
        sdnotify.reloading()
        try:
            new = config_mod.load(self.cfg.source) if self.cfg.source else self.cfg
            changed, restart = config_mod.reloadable_changes(self.cfg, new)
            secret = new.secret()
        except ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            self.metrics.error("reload")
            sdnotify.ready("serving (last reload failed)")
            return
        for key in restart:
            log.warning("reload: %s changed but needs a restart; keeping the running value", key)
        old = self.cfg
        self.cfg = _keep_restart_keys(old, new)
        if secret is not None and secret != self.peers.secret:
            self.peers.secret = secret
        self.peers.cfg = self.cfg.peer
        self.peers.set_peers(self.cfg.peer.peers)
        self.peers.recompute_tokens_per_s = self.cfg.stream.recompute_tokens_per_s
        await asyncio.to_thread(self.store.set_budgets, self.cfg.store.memory_budget, self.cfg.store.disk_budget)
        if self.cfg.api.max_fetches != old.api.max_fetches:
            self._fetch_slots = asyncio.Semaphore(self.cfg.api.max_fetches)
        set_level(self.cfg.node.log_level)
        log.info("reloaded %s: %s", self.cfg.source, ", ".join(changed) or "nothing changed")
        sdnotify.ready("serving")

    # -- the work --------------------------------------------------------------------------

    async def put(self, model_id: str, tokens: list[int], kv: torch.Tensor, prof) -> tuple[int, int]:
        """Chunk, encode every level (in the codec pool), store, advertise. Chunks already held
        are skipped before any encoding. Returns (chunks stored, chunks already held)."""
        ct = self.cfg.codec.chunk_tokens
        keys = chunk_keys(model_id, tokens, ct)
        dtype = str(kv.dtype).removeprefix("torch.")
        stored = held = 0
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            if self.store.has(key):
                held += 1
                self.metrics.puts.labels("already_held").inc()
                continue
            s, e = i * ct, min((i + 1) * ct, len(tokens))
            chunk = kv[:, :, s:e].contiguous()
            payloads = {}
            for level in self.cfg.codec.levels:
                payloads[level] = await asyncio.to_thread(self.coder.encode, chunk, level, prof, s)
                self.metrics.stored(level, chunk.numel() * 2, len(payloads[level]))
            rec = ChunkRecord(key, keys[i - 1] if i else None, i, s, model_id, tuple(tokens[s:e]), dtype,
                              tuple(chunk.shape), payloads, time.time())
            del chunk
            if await asyncio.to_thread(self.store.put, rec):
                stored += 1
                self.metrics.puts.labels("stored").inc()
            else:
                held += 1
        self.metrics.encode_seconds.observe(time.perf_counter() - t0)
        log.info("put %s: %d tokens, %d chunks stored, %d already held, %.2f s", model_id, len(tokens), stored,
                 held, time.perf_counter() - t0)
        return stored, held

    async def fetch(self, model_id: str, tokens: list[int], deadline_ms: int, dtype: str, prof,
                    emit: Callable[[dict], Awaitable[None]], levels: list[str] | None = None,
                    recompute_tps: float | None = None, device: str = "cpu") -> None:
        task = asyncio.current_task()
        self._active.add(task)
        try:
            async with self._fetch_slots:
                await self._fetch(model_id, tokens, deadline_ms, dtype, prof, emit, levels, recompute_tps, device)
        finally:
            self._active.discard(task)

    async def _fetch(self, model_id, tokens, deadline_ms, dtype, prof, emit, levels, recompute_tps, device) -> None:
        self.metrics.fetches_active.inc()
        t0 = time.monotonic()
        p = plan(self.store, self.directory, model_id, tokens, self.cfg.codec.chunk_tokens)
        shape = (prof.layers, 2, p.found_tokens, prof.heads, prof.head_dim)
        on_gpu = device == "cuda" and self.gpu is not None
        place = {"device": str(self.gpu) if on_gpu else "cpu"}
        if on_gpu:
            seg = await asyncio.to_thread(CudaBuffer.create, shape, dtype, self.gpu.index) if p.found else None
        else:
            seg = allocate(shape, dtype) if p.found else None
            if device == "cuda":  # asked for, not there: the CPU path, and the reason
                place["gpu_unavailable"] = self.gpu_why
        if seg is not None:  # held from here, so that any failure below releases it
            self.buffers[seg.name] = _Buffer(seg, time.monotonic() + self.cfg.api.buffer_lease_s)
        buffer = None
        ok = False
        try:
            if seg is not None:
                buffer = seg.tensor(shape, dtype)
                if on_gpu:
                    place["cuda_ipc"] = seg.handle()
            await emit({"event": "start", "buffer": seg.name if seg else None, "shape": list(shape), "dtype": dtype,
                        **place, "prompt_tokens": len(tokens), "found_tokens": p.found_tokens,
                        "chunk_tokens": self.cfg.codec.chunk_tokens,
                        "local_tokens": p.bounds[p.local - 1][1] if p.local else 0,
                        "lease_s": self.cfg.api.buffer_lease_s})
            job = FetchJob(p, model_id, tokens, deadline_ms, buffer, self.store, self.peers, self.coder, self.metrics,
                           list(levels or self.cfg.codec.levels))
            job.recompute_tps = recompute_tps or self.cfg.stream.recompute_tokens_per_s
            if on_gpu and p.found:
                job.stages = await asyncio.to_thread(self._stages_for, prof)
            try:
                res = await job.run(emit)
            except asyncio.CancelledError:
                if self.stopping:  # tell the client why, if it can still hear it
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(emit({"event": "error", "code": "stopping",
                                                     "message": "the daemon is shutting down"}), 1.0)
                raise
            job.buffer = None
            total = time.monotonic() - t0
            text_ranges = [[*p.bounds[i]] for i, lv in enumerate(res.levels) if lv == "text"]
            text_tokens = sum(e - s for s, e in text_ranges)
            kv_tokens = p.found_tokens - text_tokens
            self._account(p, tokens, kv_tokens, text_tokens, total, res)
            await emit({"event": "end", "found_tokens": p.found_tokens, "kv_tokens": kv_tokens,
                        "text_tokens": text_tokens, "text_ranges": text_ranges, "prefill_from": p.found_tokens,
                        "prefill_tokens": len(tokens) - p.found_tokens, "levels": res.levels, "bytes": res.bytes,
                        "deadline_missed": res.deadline_missed, "errors": res.errors,
                        "timings": {"total_s": round(total, 4),
                                    **{f"{k}_s": round(v, 4) for k, v in res.stage_s.items()}}})
            ok = True
        finally:
            del buffer
            self.metrics.fetches_active.dec()
            if not ok and seg is not None:
                self.release_buffer(seg.name)  # nobody will attach to a failed fetch's buffer

    def _account(self, p, tokens, kv_tokens, text_tokens, total, res) -> None:
        m = self.metrics
        m.fetch_seconds.observe(total)
        if total > 0:
            m.decode_share.observe(min(res.stage_s["decode"] / total, 1.0))
        for stage, s in res.stage_s.items():
            m.stage_seconds.labels(stage).observe(s)
        local_tokens = p.bounds[p.local - 1][1] if p.local else 0
        m.prompt_tokens.labels("local").inc(local_tokens)
        m.prompt_tokens.labels("peer").inc(max(kv_tokens - local_tokens, 0))
        m.prompt_tokens.labels("text").inc(text_tokens)
        m.prompt_tokens.labels("prefill").inc(len(tokens) - p.found_tokens)
        m.lookups.labels("hit" if p.found >= len(p.keys) - 1 and p.found else "partial" if p.found else "miss").inc()

    def _stages_for(self, prof):
        """The GPU pipeline's streams and decoder tables for a profile, built once."""
        from codec.gpu import StreamStages
        st = self._stages.get(prof.id)
        if st is None:
            st = self._stages[prof.id] = StreamStages(prof, self.gpu)
        return st

    # -- buffers -----------------------------------------------------------------------------

    def release_buffer(self, name: str) -> bool:
        b = self.buffers.pop(name, None)
        if b is None:
            return False
        b.segment.unlink()
        try:
            b.segment.close()
        except Exception as e:  # a view still alive in this process: leave the mapping to GC
            log.warning("buffer %s: %s", name, e)
        return True

    async def _reap_buffers(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for name, b in list(self.buffers.items()):
                if b.expires < now:
                    log.info("buffer %s: lease expired unreleased; unlinked", name)
                    self.metrics.error("buffer_lease_expired")
                    self.release_buffer(name)

    # -- reporting ---------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        u = self.store.usage()
        m = self.metrics
        m.store_bytes.labels("memory").set(u.memory_bytes)
        m.store_bytes.labels("disk").set(u.disk_bytes)
        m.store_budget.labels("memory").set(u.memory_budget)
        m.store_budget.labels("disk").set(u.disk_budget)
        m.store_chunks.set(u.chunks)
        m.store_evictions.set(u.evictions)
        m.buffers_held.set(len(self.buffers))
        m.buffer_bytes.set(sum(b.segment.size for b in self.buffers.values()))

    def status(self) -> dict:
        u = self.store.usage()
        return {"node_id": self.node_id, "version": __version__, "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started, 1), "config": str(self.cfg.source) if self.cfg.source else None,
                "api_socket": str(self.cfg.api.socket), "peer_port": self.peers.port,
                "peers_connected": self.peers.connected(), "fetches_active": len(self._active),
                "buffers_held": len(self.buffers), "decode_mbps": round(self.coder.decode_mbps, 1),
                "levels": list(self.cfg.codec.levels), "chunk_tokens": self.cfg.codec.chunk_tokens,
                "store": {k: getattr(u, k) for k in ("chunks", "memory_bytes", "memory_budget", "disk_bytes",
                                                      "disk_budget", "memory_chunks", "disk_chunks", "pinned",
                                                      "evictions", "disk_errors")}}


def _keep_restart_keys(old: Config, new: Config) -> Config:
    """`new`, except that keys a running daemon cannot change keep their running values."""
    sections = {}
    for f in dataclasses.fields(Config):
        if f.name == "source":
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        keep = {k.name: getattr(a, k.name) for k in dataclasses.fields(a) if not k.metadata.get("reload")}
        sections[f.name] = dataclasses.replace(b, **keep)
    return Config(**sections, source=new.source)


async def _main(cfg: Config) -> int:
    daemon = Daemon(cfg)
    try:
        await daemon.start()
    except StartupError as e:
        log.error("cannot start: %s", e)
        await daemon.stop()
        return 1
    await daemon.serve_forever()
    return 0


def run(config_path: str | None) -> int:
    """`kvstreamd run`: 0 after a clean SIGTERM, 1 if it cannot start, 2 for a bad config."""
    setup_logging("info")
    try:
        cfg = config_mod.load(config_path)
    except ConfigError as e:
        log.error("bad configuration: %s", e)
        return 2
    setup_logging(cfg.node.log_level)
    torch.set_num_threads(1)  # the event loop's process only copies; the pool's workers decode
    from transport import aio
    return aio.run(_main(cfg))
