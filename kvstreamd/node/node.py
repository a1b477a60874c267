"""What a node does for the model processes on its host, as the local API sees it (api.Node):
the facade over its puts (puts.py), fetches (fetches.py), lasting pins (pins.py) and the buffers
it lends (leases.py), plus what it holds and knows and how it is (status, health, metrics). The
daemon (daemon.py) builds the parts and owns their life cycle; features plug in through
kvstreamd/features.py and are shown here without being named."""
from __future__ import annotations

import asyncio
import os
import time
from typing import AsyncIterator

import torch

from codec.errors import CodecError
from codec.profile import Profile

from kvstreamd import __version__, events
from kvstreamd.cluster.directory import Directory
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.coder import Coder
from kvstreamd.config import Config
from kvstreamd.requests import ContextRequest, FetchRequest, PutRequest
from kvstreamd.features import Feature
from kvstreamd.handoff.buffers import FetchBuffer
from kvstreamd.metrics import Metrics
from kvstreamd.node.errors import RequestError
from kvstreamd.node.plan import plan
from kvstreamd.node.fetches import Fetches
from kvstreamd.node.leases import BufferLeases
from kvstreamd.node.pins import Pins
from kvstreamd.node.puts import Puts
from kvstreamd.ops import diagnosis
from kvstreamd.store.store import Store


class Node:
    def __init__(self, cfg: Config, store: Store, directory: Directory, coder: Coder, peers: PeerManager,
                 metrics: Metrics, gpu: torch.device | None, gpu_why: str, features: list[Feature] = ()) -> None:
        self.cfg = cfg  # reconfigure() swaps in a reloaded one
        self.store = store
        self.directory = directory
        self.coder = coder
        self.peers = peers
        self.metrics = metrics
        self.gpu = gpu
        self.gpu_why = gpu_why
        self.features = {f.name: f for f in features}
        self.started = time.time()
        self.leases = BufferLeases(cfg.api.buffer_lease_s, metrics, cfg.api.spare_buffer_bytes)
        self.lasting_pins = Pins(store, cfg.codec.chunk_tokens, self.profile_for)
        self.puts = Puts(cfg, store, coder, metrics, self.lasting_pins, self.profile_for)
        self.fetches = Fetches(cfg, store, directory, coder, peers, metrics, self.leases, list(features),
                               self.profile_for, gpu, gpu_why)

    @property
    def node_id(self) -> str:
        return self.cfg.node.id

    @property
    def stopping(self) -> bool:
        return self.fetches.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self.fetches.stopping = value  # new fetches are refused from here on

    def reconfigure(self, cfg: Config) -> None:
        """SIGHUP: the node's parts and features take the reloadable keys of `cfg`."""
        self.cfg = cfg
        for part in (self.leases, self.puts, self.fetches, *self.features.values()):
            part.reconfigure(cfg)

    async def start_features(self) -> None:
        for f in self.features.values():
            await f.start()

    def profile_for(self, model_id: str) -> Profile:
        try:
            return self.coder.profile_for(model_id)
        except CodecError as e:
            raise RequestError(400, "unknown_model", str(e)) from None

    # -- the work, in its parts ----------------------------------------------------------------

    async def put(self, req: PutRequest) -> dict:
        return await self.puts.put(req)

    def fetch(self, req: FetchRequest) -> AsyncIterator[events.Event]:
        return self.fetches.fetch(req)

    async def pin(self, req: ContextRequest) -> dict:
        return await self.lasting_pins.pin(req.model_id, req.tokens)

    async def unpin(self, key: bytes) -> None:
        await self.lasting_pins.unpin(key)

    async def pins(self) -> list[dict]:
        return await self.lasting_pins.list()

    async def cancel_fetches(self) -> None:
        """Shutdown: every fetch in flight ends (its client gets a Failed("stopping") event),
        then the features stop."""
        await self.fetches.cancel_all()
        for f in self.features.values():
            await f.stop()

    # -- buffers -----------------------------------------------------------------------------

    @property
    def buffers(self) -> dict:
        return self.leases.held

    def hold_buffer(self, buf: FetchBuffer) -> None:
        self.leases.hold(buf)

    def release_buffer(self, name: str) -> bool:
        return self.leases.release(name, spare=True)

    def release_all(self) -> None:
        self.leases.release_all()

    def expire_buffers(self, now: float) -> None:
        self.leases.expire(now)

    # -- what the node holds and knows ---------------------------------------------------------

    async def lookup(self, req: ContextRequest) -> dict:
        self.profile_for(req.model_id)
        p = await plan(self.store, self.directory, req.model_id, req.tokens, self.cfg.codec.chunk_tokens)
        tok = lambda n: p.bounds[n - 1][1] if n else 0  # noqa: E731
        return {"prompt_tokens": len(req.tokens), "chunks": len(p.keys), "local_tokens": tok(p.local),
                "peers": {peer: tok(n) for peer, n in p.peers.items()}, "found_tokens": p.found_tokens}

    async def contexts(self) -> list[dict]:
        pinned = {p.key for p in await asyncio.to_thread(self.store.pins)}
        return [{"key": c.key.hex(), "model_id": c.model_id, "tokens": c.tokens, "chunks": c.chunks,
                 "complete": c.complete, "created": c.created, "bytes": c.nbytes, "pinned": c.key in pinned}
                for c in await asyncio.to_thread(self.store.contexts)]

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
        for f in self.features.values():
            out.extend(f.degraded())
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
        return {"node_id": self.node_id, **self.features["ab"].report()}

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
        m.buffers_held.set(len(self.leases))
        m.buffer_bytes.set(self.leases.nbytes())
        m.spare_buffer_bytes.set(self.leases.spares.nbytes())
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
                "peers_connected": self.peers.connected(), "fetches_active": len(self.fetches.active),
                "buffers_held": len(self.leases), "buffers_spare": len(self.leases.spares),
                "decode_mbps": round(self.coder.decode_mbps, 1),
                "levels": list(cfg.codec.levels), "chunk_tokens": cfg.codec.chunk_tokens,
                "directory": self.directory.info(),
                "health": {"status": "stopping" if self.stopping else "degraded" if faults else "ok",
                           "degraded": faults},
                "codec": {"workers": self.coder.pool.workers, "restarts": self.coder.pool.restarts,
                          "last_loss": self.coder.pool.last_loss, "tables_warming": self.coder.pool.warming},
                "store": {k: getattr(u, k) for k in ("chunks", "memory_bytes", "memory_budget", "disk_bytes",
                                                      "disk_budget", "memory_chunks", "disk_chunks", "pinned",
                                                      "evictions", "disk_errors", "pinned_bytes",
                                                      "pin_budget")},
                **{f.name: f.status() for f in self.features.values() if f.in_status}}

