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
has), publishes everything the store holds anew. Nothing a host holds is lost to an outage.

What Redis holds is input: any client of that server can write there. Data this node cannot use
(FAULTS: a key of another type, a member that is not a node id, a host entry or levels field
that does not parse, a chunk set past HOLDERS_READ members) is skipped and counted
(kvstreamd_errors{kind="directory_<fault>"}), and fails no lookup or publish: the valid entries
beside it are used; a publish replaces a key of another type at this node's keys with its own."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from codec.tuning import catalog
from kvstreamd.config import ConfigError, DirectoryConfig, parse_hostport
from kvstreamd.cluster.directory import Directory, Held, Holders
from kvstreamd.metrics import Metrics
from transport.messages import KEY_BYTES, check_node_id

log = logging.getLogger(__name__)

# A lookup reads at most HOLDERS_READ members of one chunk set: past that (no real chunk has so
# many holders; a fetch uses 4), the holders its levels hash names, where it names at most
# HOLDERS_READ (every holder writes both), and HOLDERS_READ at random. A host entry or levels
# field longer than RECORD_BYTES is not read. What one key costs the script is bounded so.
HOLDERS_READ = 64
RECORD_BYTES = 1024

LOOKUP = """
local host, chain = ARGV[1], ARGV[2] == '1'
local most, record_max = tonumber(ARGV[3]), tonumber(ARGV[4])
local out, alive, faults = {}, {}, {}
local function failed(v) return type(v) == 'table' and v.err ~= nil end
local function members(key, lvkey, lvok)
  local n = redis.pcall('SCARD', key)
  if failed(n) then table.insert(faults, 'wrong_type'); return {} end
  if n <= most then return redis.call('SMEMBERS', key) end
  table.insert(faults, 'oversized_set')
  local picked, seen = {}, {}
  if lvok and redis.call('HLEN', lvkey) <= most then
    for _, node in ipairs(redis.call('HKEYS', lvkey)) do
      if redis.call('SISMEMBER', key, node) == 1 then seen[node] = true; table.insert(picked, node) end
    end
  end
  for _, node in ipairs(redis.call('SRANDMEMBER', key, most)) do
    if not seen[node] then seen[node] = true; table.insert(picked, node) end
  end
  return picked
end
-- a member's host entry: its record; false: no lease (or not a node id), taken off the chunk;
-- true: an entry that is not a record, skipped (its host rewrites it with its next renewal)
local function lease(node)
  local rec = alive[node]
  if rec ~= nil then return rec end
  if #node == 0 or #node > 255 then
    table.insert(faults, 'bad_holder'); rec = false
  else
    local n = redis.pcall('STRLEN', host .. node)
    if failed(n) then table.insert(faults, 'wrong_type'); rec = true
    elseif n > record_max then table.insert(faults, 'bad_host'); rec = true
    else rec = redis.call('GET', host .. node) end
  end
  alive[node] = rec
  return rec
end
for i = 1, #KEYS, 2 do
  local key, lvkey = KEYS[i], KEYS[i + 1]
  local lvtype = redis.call('TYPE', lvkey).ok
  local lvok = lvtype == 'hash' or lvtype == 'none'
  if not lvok then table.insert(faults, 'wrong_type') end
  local live, levels = {}, {}
  for _, node in ipairs(members(key, lvkey, lvok)) do
    local rec = lease(node)
    if type(rec) == 'string' then
      local lv = false
      if lvok then
        if redis.call('HSTRLEN', lvkey, node) > record_max then table.insert(faults, 'bad_levels')
        else lv = redis.call('HGET', lvkey, node) end
      end
      table.insert(live, node); table.insert(levels, lv)
    elseif rec == false then
      redis.call('SREM', key, node)
      if lvok then redis.call('HDEL', lvkey, node) end
    end
  end
  if chain and #live == 0 then break end
  out[#out + 1] = {live, levels}
end
local addrs = {}
for node, rec in pairs(alive) do
  if type(rec) == 'string' then table.insert(addrs, node); table.insert(addrs, rec) end
end
return {out, addrs, faults}
"""

TIMEOUT_S = 1.0  # a Redis call not answered by then counts as Redis unreachable
RETRY_MIN_S, RETRY_MAX_S = 0.25, 2.0  # reconnect backoff: a Redis that is back is used within ~2 s
BATCH = 5000  # keys per pipelined write
HELD_TTL_S = 7 * 86400  # a host gone for good leaves its held: set this long
KNOWN_KEYS = 200_000  # holders of recently looked-up keys kept for an outage (~100 B each)
LOG_EVERY_S = 60.0  # a kind of bad data in Redis is logged at most this often (counted every time)

# What Redis can hold at this node's keys that it cannot use: each is skipped and counted as
# kvstreamd_errors{kind="directory_<fault>"}, and never fails a lookup or a publish.
FAULTS = {
    "wrong_type": "a key of another Redis type than the layout's (e.g. a string for a set of holders)",
    "oversized_set": f"a chunk set of more than {HOLDERS_READ} holders (read in part)",
    "bad_holder": "a chunk set member that is not a node id",
    "bad_host": f"a host entry that is not a record (JSON with a host:port address) of at most {RECORD_BYTES} bytes",
    "bad_levels": f"a levels field that is not UTF-8 or is longer than {RECORD_BYTES} bytes",
    "bad_held": "a member of this node's held: set that is not a chunk key",
}


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
        self._said: dict[str, float] = {}  # fault kind -> when the log last said it

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
                old = await self._renew(lease_ms)
                self._answered()
                if old is not None and old != self._record:
                    log.warning("directory: node id %s was leased by %s, now by this node at %s: two hosts "
                                "share a node id", self.node_id, (_host(old) or (repr(old[:100]),))[0], self.address)
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

    async def _renew(self, lease_ms: int) -> bytes | None:
        """Lease this node's host entry anew; the entry there was (None: none, or not a string)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(self._key("host", self.node_id))
            pipe.set(self._key("host", self.node_id), self._record, px=lease_ms)  # (SET replaces any type)
            old, _ = await pipe.execute(raise_on_error=False)
        if isinstance(old, ResponseError):
            if not _wrong_type(old):
                raise old
            self._count(collections.Counter(wrong_type=1))
            return None
        return old

    async def _publish_all(self) -> None:
        """Make Redis say exactly what the store holds: add this node to every chunk it holds,
        and take it off every chunk it published before and holds no longer."""
        me, held_key = self.node_id.encode(), self._key("held", self.node_id)
        current = await asyncio.to_thread(self._held)
        before = await self._published(held_key)
        gone = dict.fromkeys(before - current.keys(), frozenset())
        for added, held in ((True, current), (False, gone)):
            keys = list(held)
            for i in range(0, len(keys), BATCH):
                await self._write(added, {k: held[k] for k in keys[i:i + BATCH]}, me, held_key)
        await self._redis.expire(held_key, HELD_TTL_S)
        log.info("directory: published %d chunk keys to Redis (%d withdrawn)", len(current), len(gone))

    async def _published(self, held_key: bytes) -> set[bytes]:
        """The chunk keys this node's held: set lists. One that is not a chunk key is taken out
        of it, and a held: key of another type deleted (counted, both)."""
        try:
            before = set(await self._redis.smembers(held_key))
        except ResponseError as e:
            if not _wrong_type(e):
                raise
            self._count(collections.Counter(wrong_type=1))
            await self._redis.delete(held_key)
            return set()
        bad = [k for k in before if len(k) != KEY_BYTES]
        if bad:
            self._count(collections.Counter(bad_held=len(bad)))
            await self._redis.srem(held_key, *bad)
        return before.difference(bad)

    async def _write(self, added: bool, keys: Held, me: bytes, held_key: bytes) -> None:
        """Add this node to (or take it off) these chunks. A key there of another type than the
        layout's holds nothing this node can use: it is replaced, and counted."""
        if not keys:
            return
        ops: list[tuple[str, bytes, tuple]] = []  # (command, key, its arguments)
        for k, levels in keys.items():
            if added:
                ops += [("sadd", self._chunk(k), (me,)), ("hset", self._levels(k), (me, ",".join(sorted(levels))))]
            else:
                ops += [("srem", self._chunk(k), (me,)), ("hdel", self._levels(k), (me,))]
        ops.append(("sadd" if added else "srem", held_key, tuple(keys)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for command, key, args in ops:
                getattr(pipe, command)(key, *args)
            results = await pipe.execute(raise_on_error=False)
        retry = []
        for op, result in zip(ops, results):
            if isinstance(result, ResponseError):
                if not _wrong_type(result):
                    raise result
                retry.append(op)
        if retry:
            self._count(collections.Counter(wrong_type=len(retry)))
            async with self._redis.pipeline(transaction=True) as pipe:
                for command, key, args in retry:
                    pipe.delete(key)
                    getattr(pipe, command)(key, *args)
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
                found, records, faults = await self._lookup(
                    keys=[n for k in ask for n in (self._chunk(k), self._levels(k))],
                    args=[self._key("host", ""), b"1" if chain else b"0", HOLDERS_READ, RECORD_BYTES])
            except (RedisError, OSError) as e:
                self._failed(e)
            else:
                self._answered()
                bad = collections.Counter(f.decode() for f in faults)
                hosts: dict[bytes, tuple[str, str]] = {}
                for i in range(0, len(records), 2):
                    host = _host(records[i + 1])
                    if host is None:
                        bad["bad_host"] += 1
                    elif _node(records[i]) is not None:  # (a member that is not a node id is counted below)
                        hosts[records[i]] = host
                at = [self._holders_of(nodes, levels, hosts, bad) for nodes, levels in found]
                self._count(bad)
                for k, who in zip(ask, at):
                    self._remember(k, who)
                for member, (address, zone) in hosts.items():
                    node = member.decode()
                    self._addresses[node], self._zones[node] = address, zone
                return self._holders(keys, start, at)
        at = []
        for k in ask:  # Redis is down: the holders last looked up, where this node still knows them
            who = dict(self._known.get(k, {}))
            if chain and not who:
                break
            at.append(who)
        return self._holders(keys, start, at)

    def _holders_of(self, nodes: list[bytes], levels: list[bytes | None], hosts: dict[bytes, tuple[str, str]],
                    bad: collections.Counter) -> dict[str, frozenset[str] | None]:
        """One key's holders as the script found them, with the levels each holds it at: a member
        that is not a node id, or whose host entry is not a record, is skipped (and counted)."""
        who: dict[str, frozenset[str] | None] = {}
        for member, field in zip(nodes, levels):
            node = _node(member)
            if node is None:
                bad["bad_holder"] += 1
            elif member in hosts and node != self.node_id:
                try:
                    who[node] = _levels(field)
                except ValueError:
                    bad["bad_levels"] += 1
                    who[node] = None  # as a holder that published none: asked, it answers NOT_FOUND at worst
        return who

    def _count(self, bad: collections.Counter) -> None:
        """Count what Redis held that this node cannot use (skipped), and say so in the log at
        most once a minute per kind."""
        now = time.monotonic()
        for fault, n in bad.items():
            if not n:
                continue
            kind = f"directory_{fault}"
            self.metrics.error(kind, n)
            if now - self._said.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
                self._said[kind] = now
                log.warning("directory: Redis at %s holds %s (%s); skipped, and counted in kvstreamd_errors{kind=%r}",
                            self.url, FAULTS[fault], n, kind)

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


def _host(record: bytes) -> tuple[str, str] | None:
    """(address, zone) from a host entry; None when it is not one (not UTF-8 JSON with a
    host:port address and a string zone, nor a bare host:port)."""
    try:
        text = record.decode()
        rec = json.loads(text) if text.startswith("{") else {"address": text}
        address, zone = rec["address"], rec.get("zone") or ""
        if not isinstance(address, str) or not isinstance(zone, str):
            return None
        parse_hostport(address, "a host entry")
        return address, zone
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError):
        return None


def _wrong_type(e: ResponseError) -> bool:
    return str(e).startswith("WRONGTYPE")


def _node(member: bytes) -> str | None:
    """The node id a chunk set's member names; None when it is not one."""
    try:
        return check_node_id(member.decode())
    except ValueError:  # (UnicodeDecodeError is one)
        return None


def _levels(field: bytes | None) -> frozenset[str] | None:
    """The levels a holder published for a chunk (the names this node knows); None when it
    published none (any level). ValueError when the field is not UTF-8."""
    return frozenset(lv for lv in field.decode().split(",") if lv in catalog.SCHEMES) if field else None
