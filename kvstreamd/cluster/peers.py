"""The peer connections: the TCP listener, a dialer per configured peer (retried with backoff),
connections dialled when a fetch needs a peer the directory named (closed again once idle), and
each connection and each message that is not a fetch's handed to the directory backend (the
built-in one exchanges held chunk keys over them). The FETCHes peers send are served by
serving.py."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from transport import aio
from transport.bandwidth import PeerBandwidth
from transport.messages import HANDSHAKE_TIMEOUT, WRITE_STALLED
from codec.profile import Profile

from kvstreamd.cluster.serving import Serving
from kvstreamd.config import ConfigError, PeerConfig, parse_hostport
from kvstreamd.cluster.directory import Directory
from kvstreamd.metrics import Metrics
from kvstreamd.store.store import Store

log = logging.getLogger(__name__)

@dataclass
class PeerState:
    """What /v1/peers reports about one configured or connected peer."""

    address: str | None = None  # "host:port" when configured
    node_id: str | None = None
    connected: bool = False
    since: float | None = None
    attempts: int = 0
    last_error: str | None = None
    next_retry: float | None = None  # time.time() of the next dial
    conns: set = field(default_factory=set)


class PeerManager:
    def __init__(self, node_id: str, secret: bytes, cfg: PeerConfig, store: Store, directory: Directory,
                 metrics: Metrics, caps: dict, recompute_tokens_per_s: float,
                 profile_for: Callable[[str], Profile] | None = None, idle_s: float = 30.0, tls=None) -> None:
        self.tls = tls  # a transport.tls.PeerTLS (Config.tls()), or None: plaintext peer links
        self.node_id = node_id
        self.secret = secret
        self.cfg = cfg
        self.store = store
        self.directory = directory
        self.metrics = metrics
        self.caps = caps
        self.bandwidth = PeerBandwidth()
        self.serving = Serving(store, metrics, self.bandwidth, recompute_tokens_per_s, profile_for)
        self.server: aio.Server | None = None
        self.by_node: dict[str, set[aio.PeerConnection]] = {}
        self.configured: dict[tuple[str, int], PeerState] = {}
        self._dialers: dict[tuple[str, int], asyncio.Task] = {}
        self.idle_s = idle_s  # a connection dialled for a fetch is closed after this long unused
        self.dialled: dict[str, PeerState] = {}  # node id -> the connection dialled for its fetches
        self._dialling: dict[str, asyncio.Future] = {}
        self._last_used: dict[aio.PeerConnection, float] = {}  # dialled connection -> loop time last busy
        self._reaper: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.get_running_loop()
        self._stopping = False

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        host, port = self.cfg.listen
        self.server = await aio.serve(host, port, self.node_id, self.secret, self.serving.serve,
                                      on_connect=self._accepted, caps=self.caps,
                                      max_frame_bytes=self.cfg.max_frame_bytes,
                                      handshake_timeout=self.cfg.handshake_timeout_s,
                                      ssl=self.tls.server if self.tls else None,
                                      write_stall_s=self.cfg.write_stall_s)
        if self.tls:
            log.info("peer links are TLS, mutually authenticated: both sides' certificates are checked "
                     "against the cluster CA %s", self.tls.ca_subject)
        else:
            log.warning("peer links are plaintext: frames after the handshake are neither encrypted nor "
                        "authenticated, so plaintext is for trusted networks only "
                        "(set [peer] tls_cert, tls_key and tls_ca for TLS)")
        self._reaper = asyncio.ensure_future(self._close_idle())
        self.set_peers(self.cfg.peers)

    def reconfigure(self, cfg) -> None:
        """SIGHUP: `cfg`'s peers (new ones dialled, removed ones hung up), secret (for the
        connections from now on), retry backoff, idle time of dialled connections, and the
        prefill rate TEXT chunks are priced at when a FETCH does not say its own."""
        try:
            secret = cfg.secret()
        except ConfigError as e:  # the file went away since the reload read it
            log.error("reload: keeping the running [peer] secret: %s", e)
        else:
            self.secret = secret if secret is not None else self.secret
        self.cfg = cfg.peer
        self.idle_s = cfg.directory.idle_s
        self.serving.recompute_tokens_per_s = cfg.fetch.recompute_tokens_per_s
        self.set_peers(cfg.peer.peers)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    def set_peers(self, peers) -> None:
        """Dial these "host:port" peers (SIGHUP may change the list): new ones start dialing,
        removed ones are hung up."""
        wanted = set(peers)
        for addr in list(self._dialers):
            if addr not in wanted:
                self._dialers.pop(addr).cancel()
                self.configured.pop(addr, None)
        for addr in wanted:
            if addr not in self._dialers:
                self.configured[addr] = PeerState(address=f"{addr[0]}:{addr[1]}")
                self._dialers[addr] = asyncio.ensure_future(self._dial_loop(addr))

    async def stop(self) -> None:
        self._stopping = True  # a dial loop that missed its cancel ends at its next turn
        for t in self._dialers.values():
            t.cancel()
        for t in (self._reaper, *self._dialling.values()):
            if t is not None:
                t.cancel()
        if self.server is not None:
            self.server.close()
        for conns in list(self.by_node.values()):
            for c in list(conns):
                c.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._dialers.values(), *self._tasks, return_exceptions=True)
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), 5)
            except asyncio.TimeoutError:
                log.warning("peer connections did not close within 5 s")

    # -- connections -----------------------------------------------------------------------

    def connection(self, node_id: str) -> aio.PeerConnection | None:
        for c in self.by_node.get(node_id, ()):
            if c.closed is None:
                return c
        return None

    @property
    def zone(self) -> str:
        """This node's [node] zone, as its HELLO says."""
        return str(self.caps.get("zone") or "")

    def zone_of(self, peer: str, holders=None) -> str:
        """A peer's zone: what the directory says (Redis), else its connection's HELLO."""
        zone = holders.zones.get(peer) if holders is not None else None
        if zone is None:
            conn = self.connection(peer)
            zone = (conn.peer_caps or {}).get("zone") if conn is not None else None
        return str(zone or "")

    def connected(self) -> list[str]:
        return sorted(n for n, conns in self.by_node.items() if conns)

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` as a task of the peer links: cancelled and awaited when they stop."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _accepted(self, conn: aio.PeerConnection) -> None:
        self.spawn(self._run_conn(conn, None))

    async def _connect(self, host: str, port: int) -> aio.PeerConnection:
        """Dial a peer: TCP (TLS where configured) and the handshake, within its timeout."""
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the connection when it is
        # made just as the dialler is cancelled, swallowing the cancel (a stopping node then
        # went on dialling, and its stop never ended)
        async with asyncio.timeout(self.cfg.handshake_timeout_s + 5):
            return await aio.connect(host, port, self.node_id, self.secret, handler=self.serving.serve,
                                     caps=self.caps, max_frame_bytes=self.cfg.max_frame_bytes,
                                     handshake_timeout=self.cfg.handshake_timeout_s,
                                     ssl=self.tls.client if self.tls else None,
                                     write_stall_s=self.cfg.write_stall_s)

    async def connect_to(self, peer: str, address: str | None = None, wait_s: float | None = None,
                         stall_s: float | None = None) -> aio.PeerConnection | None:
        """A ready connection to `peer`: one there is, or, where the directory gave its address
        ("host:port"), one dialled now (shared by the fetches that wait for it meanwhile) and
        closed again once unused for idle_s. None when it cannot be reached, or not within
        `wait_s` (the caller's time left; the dial goes on for the others). With `stall_s`, a
        dial that has no handshake within it names a ghost: a holder the directory names whose
        address does not answer as a peer; it cools down as a stalled peer does."""
        conn = self.connection(peer)
        if conn is not None or address is None:
            return conn
        dial = self._dialling.get(peer)
        if dial is None:
            dial = self._dialling[peer] = asyncio.ensure_future(self._dial_for_fetch(peer, address, stall_s))
            dial.add_done_callback(lambda _: self._dialling.pop(peer, None))
        try:
            async with asyncio.timeout(wait_s):
                return await asyncio.shield(dial)
        except TimeoutError:
            return None

    async def _dial_for_fetch(self, peer: str, address: str, stall_s: float | None = None) -> aio.PeerConnection | None:
        state = self.dialled.setdefault(peer, PeerState(address=address, node_id=peer))
        state.address, state.attempts = address, state.attempts + 1
        within = self.cfg.handshake_timeout_s if stall_s is None else min(stall_s, self.cfg.handshake_timeout_s)
        try:
            host, port = parse_hostport(address, f"the directory's address of {peer}")
            async with asyncio.timeout(within):
                conn = await self._connect(host, port)
        except (TimeoutError, aio.HandshakeError) as e:
            state.last_error = f"{type(e).__name__}: {e}" if str(e) else f"no handshake within {within:g} s"
            if stall_s is not None and (isinstance(e, TimeoutError) or e.code == HANDSHAKE_TIMEOUT):
                cooldown = self.directory.cool_down(peer, stall_s, "ghost")
                log.warning("peer %s at %s: no handshake within %g s (a holder the directory names that does "
                            "not answer as a peer); it is avoided for %g s", peer, address, within, cooldown)
                self.metrics.error("peer_ghost")
            else:
                log.info("peer %s at %s: cannot connect (%s)", peer, address, state.last_error)
            return None
        except (OSError, ConfigError, aio.TransportError) as e:
            state.last_error = f"{type(e).__name__}: {e}"
            log.info("peer %s at %s: cannot connect (%s)", peer, address, state.last_error)
            return None
        if conn.peer_node_id != peer:
            state.last_error = f"{address} is node {conn.peer_node_id}, not {peer}"
            log.warning("peer %s: the directory's address %s answers as node %s; not used", peer, address,
                        conn.peer_node_id)
            conn.close("normal", "not the node dialled")
            return None
        state.last_error = None
        self._last_used[conn] = self._loop.time()
        self.spawn(self._run_conn(conn, state))
        return conn

    async def _close_idle(self) -> None:
        """Hang up connections dialled for fetches once unused for idle_s: a node holds only the
        peer connections it is using."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_s / 4))
            now = self._loop.time()
            for conn, last in list(self._last_used.items()):
                if conn.closed is not None:
                    self._last_used.pop(conn, None)
                elif conn.busy:
                    self._last_used[conn] = now
                elif now - last > self.idle_s:
                    log.info("peer %s: dialled connection unused for %g s; closed", conn.peer_node_id, self.idle_s)
                    self._last_used.pop(conn, None)
                    conn.close("normal", "idle")

    async def _dial_loop(self, addr: tuple[str, int]) -> None:
        state = self.configured[addr]
        delay = self.cfg.retry_min_s
        while not self._stopping:
            state.attempts += 1
            try:
                conn = await self._connect(*addr)
            except (OSError, aio.TransportError, asyncio.TimeoutError) as e:
                state.last_error = f"{type(e).__name__}: {e}"
                if state.attempts <= 1 or state.attempts % 10 == 0:
                    log.info("peer %s: cannot connect (%s); retrying with backoff", state.address, state.last_error)
            else:
                if self._stopping:  # made as the node stops
                    conn.close("normal", "stopping")
                    return
                delay = self.cfg.retry_min_s
                state.last_error = None
                await self._run_conn(conn, state)
                if conn.closed is not None and conn.closed.code not in ("normal", "connection_lost"):
                    state.last_error = f"closed: {conn.closed.code}: {conn.closed.msg}"
            wait = delay * random.uniform(0.8, 1.2)
            state.next_retry = time.time() + wait
            await asyncio.sleep(wait)
            state.next_retry = None
            delay = min(delay * 2, self.cfg.retry_max_s)

    async def _run_conn(self, conn: aio.PeerConnection, state: PeerState | None) -> None:
        peer = conn.peer_node_id
        if peer == self.node_id:
            log.warning("peer %s is this node itself; hanging up", state.address if state else "?")
            conn.close("normal", "connected to itself")
            await conn.wait_closed()
            return
        conns = self.by_node.setdefault(peer, set())
        conns.add(conn)
        if state is not None:
            state.node_id, state.connected, state.since = peer, True, time.time()
        self.metrics.peers_connected.set(len(self.connected()))
        log.info("peer %s: connected (%s)", peer, conn.conn.role)
        try:
            await self.directory.peer_connected(conn)
            async for msg in conn:
                self.directory.peer_message(conn, msg)
        except aio.TransportError:
            pass
        finally:
            if conn.closed is not None and conn.closed.code == WRITE_STALLED:
                self.metrics.error("peer_write_stalled")  # it read none of our bytes for write_stall_s
            conns.discard(conn)
            if not conns:
                self.by_node.pop(peer, None)
            self.directory.peer_closed(conn, last=not conns)
            if state is not None:
                state.connected = False
            self.metrics.peers_connected.set(len(self.connected()))
            log.info("peer %s: disconnected", peer)

    # -- reporting -------------------------------------------------------------------------

    def info(self) -> list[dict]:
        out, seen = [], set()
        counts = self.directory.counts()
        for addr, st in self.configured.items():
            nid = st.node_id
            seen.add(nid)
            out.append(self._peer_info(nid, st.address, counts, st))
        for nid, st in self.dialled.items():
            if nid not in seen:
                seen.add(nid)
                out.append(self._peer_info(nid, st.address, counts, st, configured=False))
        for nid in self.by_node:
            if nid not in seen:
                out.append(self._peer_info(nid, None, counts, None))
        return out

    def _peer_info(self, nid, address, counts, st: PeerState | None, configured: bool | None = None) -> dict:
        est = self.bandwidth.get(nid).estimate() if nid and nid in self.bandwidth else None
        conn = self.connection(nid) if nid else None
        return {"node_id": nid, "address": address, "configured": st is not None if configured is None else configured,
                "connected": conn is not None, "keys": counts.get(nid, 0) if nid else 0,
                "bandwidth_mbit": round(est * 8 / 1e6, 2) if est else None,
                "rtt_ms": round(conn.rtt * 1000, 3) if conn is not None and conn.rtt else None,
                "last_error": st.last_error if st else None,
                "next_retry_s": round(st.next_retry - time.time(), 2) if st and st.next_retry else None,
                # seconds it is still left out of lookups after it stalled a fetch (node/fetch.py),
                # and why: "stalled", "ghost" (no handshake), "text_for_kv" (TEXT for what it advertised)
                "cooldown_s": round(c, 2) if nid and (c := self.directory.cooling(nid)) else None,
                "cooldown_why": self.directory.cooling_why(nid) if nid and c else None}

