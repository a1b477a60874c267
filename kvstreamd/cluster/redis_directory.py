"""The directory in a Redis server ([directory] backend = "redis"), for a cluster past a full
mesh: every host publishes the chunk keys it holds, and looks a prompt's key chain up in one
round trip; no host swaps key sets with, or even dials, a peer it does not fetch from.

Layout, under [directory] prefix P (one per cluster):
  P host:<node id>   {"address": "host:port" its peers dial, "zone": its [node] zone} (JSON);
                     expires after [directory] lease_s unless the
                     host renews it (every lease_s / 3): a host that dies drops out of lookups
                     when its lease runs out.
  P chunk:<key hex>  the set of node ids holding that chunk.
  P levels:<key hex> node id -> the levels it holds that chunk at, comma-separated (a hash; a
                     holder missing from it, as one before levels were published, holds any).
  P held:<node id>   the set of chunk keys the host published (so that a host that comes back
                     without some of them takes itself off those chunks).
A lookup is one EVALSHA of LOOKUP below: the holders of each key whose host lease is live (a
member whose lease has run out is removed on the way) with the levels each holds it at, and
those hosts' addresses. The script
reads host keys it is not given, so it needs one Redis server (or a cluster whose keys share
a hash slot: a prefix with a {tag}).

Redis unreachable: lookups answer from the holders of recent lookups (peers already known) and
the local store; the outage is logged once and counted (kvstreamd_errors{kind=
"directory_unreachable"}, kvstreamd_degraded{reason="directory"}); the lease loop retries with
backoff and, once Redis answers again (or has lost this host's lease, as a restarted server
has), publishes everything the store holds anew. Nothing a host holds is lost to an outage."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvstreamd.config import DirectoryConfig
from kvstreamd.cluster.directory import Directory, Held, Holders
from kvstreamd.metrics import Metrics

log = logging.getLogger("kvstreamd.directory")

LOOKUP = """
local host, chain = ARGV[1], ARGV[2] == '1'
local out, alive = {}, {}
for i = 1, #KEYS, 2 do
  local key, lvkey = KEYS[i], KEYS[i + 1]
  local live = {}
  for _, node in ipairs(redis.call('SMEMBERS', key)) do
    local addr = alive[node]
    if addr == nil then
      addr = redis.call('GET', host .. node)
      alive[node] = addr
    end
    if addr then table.insert(live, node) else redis.call('SREM', key, node); redis.call('HDEL', lvkey, node) end
  end
  if chain and #live == 0 then break end
  local levels = {}
  if #live > 0 then levels = redis.call('HMGET', lvkey, unpack(live)) end
  out[#out + 1] = {live, levels}
end
local addrs = {}
for node, addr in pairs(alive) do
  if addr then table.insert(addrs, node); table.insert(addrs, addr) end
end
return {out, addrs}
"""

TIMEOUT_S = 1.0  # a Redis call not answered by then counts as Redis unreachable
RETRY_MIN_S, RETRY_MAX_S = 0.25, 2.0  # reconnect backoff: a Redis that is back is used within ~2 s
BATCH = 5000  # keys per pipelined write
HELD_TTL_S = 7 * 86400  # a host gone for good leaves its held: set this long
KNOWN_KEYS = 200_000  # holders of recently looked-up keys kept for an outage (~100 B each)


class RedisDirectory(Directory):
    def __init__(self, cfg: DirectoryConfig, metrics: Metrics, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock=clock)
        self.cfg = cfg
        self.metrics = metrics
        self.url = cfg.url
        self._redis = aioredis.from_url(cfg.url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                                        retry=Retry(NoBackoff(), 0))
        self._lookup = self._redis.register_script(LOOKUP)
        self._p = cfg.prefix.encode()
        self.node_id = ""
        self.address = ""
        self._record = b""  # this node's host entry
        self._held: Callable[[], Held] = dict
        self.up = False
        self.down_since: float | None = None  # time.time() Redis stopped answering; None while up
        self.last_error: str | None = None
        self._dirty = True  # what Redis has of this host may be out of date: publish it all
        self._deltas: asyncio.Queue[tuple[bool, Held]] = asyncio.Queue()
        # key -> its holders, with the levels each holds it at where known, as last looked up
        self._known: OrderedDict[bytes, dict[str, frozenset[str] | None]] = OrderedDict()
        self._addresses: dict[str, str] = {}
        self._zones: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease_renewed = asyncio.Event()

    def _key(self, kind: str, name: bytes | str) -> bytes:
        return self._p + kind.encode() + b":" + (name.encode() if isinstance(name, str) else name)

    def _chunk(self, key: bytes) -> bytes:
        return self._key("chunk", key.hex())

    def _levels(self, key: bytes) -> bytes:
        return self._key("levels", key.hex())

    # -- life cycle --------------------------------------------------------------------------

    async def start(self, node_id: str, address: str, held: Callable[[], Held], zone: str = "") -> None:
        self.node_id, self.address, self._held = node_id, address, held
        self._record = json.dumps({"address": address, "zone": zone}).encode()
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.ensure_future(self._keep_lease()), asyncio.ensure_future(self._write_deltas())]
        try:  # the first lease and publish, if Redis is there; start-up does not wait longer
            await asyncio.wait_for(self._lease_renewed.wait(), 3 * TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        log.info("directory: Redis at %s (prefix %r), %s; this node is %s at %s, lease %g s", self.url,
                 self.cfg.prefix, "reachable" if self.up else f"not reachable yet ({self.last_error})", node_id,
                 address, self.cfg.lease_s)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.up:  # leave lookups now, rather than when the lease runs out
            try:
                await self._redis.delete(self._key("host", self.node_id))
            except (RedisError, OSError):
                pass
        await self._redis.aclose()

    # -- Redis up and down --------------------------------------------------------------------

    def _failed(self, e: BaseException) -> None:
        self.last_error = f"{type(e).__name__}: {e}"
        self._dirty = True
        if self.up or self.down_since is None:
            self.down_since = time.time()
            self.metrics.error("directory_unreachable")
            log.warning("directory: Redis at %s is unreachable (%s): lookups use the local store and the "
                        "peers already known; reconnecting with backoff", self.url, self.last_error)
        self.up = False

    def _answered(self) -> None:
        if not self.up and self.down_since is not None:
            log.info("directory: Redis at %s answers again after %.1f s; publishing what this node holds",
                     self.url, time.time() - self.down_since)
        self.up, self.down_since, self.last_error = True, None, None

    async def _keep_lease(self) -> None:
        delay = RETRY_MIN_S
        lease_ms = int(self.cfg.lease_s * 1000)
        while True:
            try:
                old = await self._redis.set(self._key("host", self.node_id), self._record, px=lease_ms, get=True)
                self._answered()
                if old is not None and old != self._record:
                    log.warning("directory: node id %s was leased by %s, now by this node at %s: two hosts "
                                "share a node id", self.node_id, _host(old)[0], self.address)
                if old is None or self._dirty:  # a first start, a lease that ran out, a Redis restarted empty
                    self._dirty = False
                    await self._publish_all()
                self._lease_renewed.set()
                delay = RETRY_MIN_S
                await asyncio.sleep(self.cfg.lease_s / 3)
            except (RedisError, OSError) as e:
                self._failed(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def _publish_all(self) -> None:
        """Make Redis say exactly what the store holds: add this node to every chunk it holds,
        and take it off every chunk it published before and holds no longer."""
        me, held_key = self.node_id.encode(), self._key("held", self.node_id)
        current = await asyncio.to_thread(self._held)
        before = set(await self._redis.smembers(held_key))
        gone = dict.fromkeys(before - current.keys(), frozenset())
        for added, held in ((True, current), (False, gone)):
            keys = list(held)
            for i in range(0, len(keys), BATCH):
                await self._write(added, {k: held[k] for k in keys[i:i + BATCH]}, me, held_key)
        await self._redis.expire(held_key, HELD_TTL_S)
        log.info("directory: published %d chunk keys to Redis (%d withdrawn)", len(current), len(gone))

    async def _write(self, added: bool, keys: Held, me: bytes, held_key: bytes) -> None:
        if not keys:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for k, levels in keys.items():
                if added:
                    pipe.sadd(self._chunk(k), me)
                    pipe.hset(self._levels(k), me, ",".join(sorted(levels)))
                else:
                    pipe.srem(self._chunk(k), me)
                    pipe.hdel(self._levels(k), me)
            (pipe.sadd if added else pipe.srem)(held_key, *keys)
            await pipe.execute()

    def changed(self, added: bool, keys: Held) -> None:
        if self._loop is not None and keys:
            self._loop.call_soon_threadsafe(self._deltas.put_nowait, (added, dict(keys)))

    async def _write_deltas(self) -> None:
        me, held_key = self.node_id.encode(), self._key("held", self.node_id)
        while True:
            added, keys = await self._deltas.get()
            if not self.up:
                self._dirty = True  # published in full once Redis answers again
                continue
            try:
                await self._write(added, keys, me, held_key)
            except (RedisError, OSError) as e:
                self._failed(e)

    # -- lookups -------------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes], start: int = 0, chain: bool = True) -> Holders:
        ask = list(keys[start:])
        if self.up and ask:
            try:
                found, addrs = await self._lookup(keys=[n for k in ask for n in (self._chunk(k), self._levels(k))],
                                                  args=[self._key("host", ""), b"1" if chain else b"0"])
            except (RedisError, OSError) as e:
                self._failed(e)
            else:
                self._answered()
                at = [{n.decode(): _levels(lv) for n, lv in zip(nodes, levels) if n.decode() != self.node_id}
                      for nodes, levels in found]
                for k, who in zip(ask, at):
                    self._remember(k, who)
                for i in range(0, len(addrs), 2):
                    node = addrs[i].decode()
                    self._addresses[node], self._zones[node] = _host(addrs[i + 1])
                return self._holders(keys, start, at)
        at = []
        for k in ask:  # Redis is down: the holders last looked up, where this node still knows them
            who = dict(self._known.get(k, {}))
            if chain and not who:
                break
            at.append(who)
        return self._holders(keys, start, at)

    def _holders(self, keys: Sequence[bytes], start: int, at: list[dict[str, frozenset[str] | None]]) -> Holders:
        return Holders(keys, start, [set(who) for who in at], self.cooling, self._addresses, self._zones,
                       [{n: lv for n, lv in who.items() if lv is not None} for who in at])

    def _remember(self, key: bytes, who: dict[str, frozenset[str] | None]) -> None:
        if who:
            self._known[key] = who
            self._known.move_to_end(key)
            if len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)
        else:
            self._known.pop(key, None)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for who in self._known.values():
            for peer in who:
                out[peer] = out.get(peer, 0) + 1
        return out

    def fault(self) -> str | None:
        if self.up:
            return None
        return (f"the directory (Redis at {self.url}) is unreachable ({self.last_error}): lookups use the local "
                "store and the peers already known")

    def info(self) -> dict:
        return {"backend": "redis", "url": self.url, "prefix": self.cfg.prefix, "up": self.up,
                "address": self.address, "lease_s": self.cfg.lease_s, "last_error": self.last_error,
                "down_s": round(time.time() - self.down_since, 1) if self.down_since else None}


def _host(record: bytes) -> tuple[str, str]:
    """(address, zone) from a host entry."""
    try:
        rec = json.loads(record)
        return str(rec["address"]), str(rec.get("zone") or "")
    except (ValueError, KeyError, TypeError):
        return record.decode(errors="replace"), ""  # (a bare address)


def _levels(field: bytes | None) -> frozenset[str] | None:
    """The levels a holder published for a chunk; None when it published none (any level)."""
    return frozenset(field.decode().split(",")) if field else None
