"""One local fetch: find the longest prefix of a prompt (local store first, then peers), then
receive -> decode -> fill as three asyncio stages joined by bounded queues, so that while
chunk i decodes (in the codec process pool), chunk i+1 arrives and chunk i-1 is copied into
the client's shared-memory buffer. Chunks from peers go to decode as they arrive, in any order
(a chunk held up at one peer holds up no other's decode); the fill stage hands them to the
client in order. Each chunk that lands becomes an event for the client: KV ready at these
token positions, or TEXT the model must recompute. A peer that fails mid-stream costs only its
remaining chunks: they come from another peer holding them, or as TEXT.

Whatever the peers do, a fetch ends within its wait plus grace_s(deadline): its deadline, or,
where recomputing the chunks it takes from peers would take longer than the deadline allows
(a slow link: the deadline is lost from the start), that long (aio.wait_s: a chunk that arrives
sooner than it could be recomputed is still worth waiting for). Peers are waited for until the
wait plus half the grace (the FETCH tells them, Fetch.wait_ms), the other half is for what was
received to decode and fill. A peer that delivers no whole chunk for `stall_s` while it is waited for has
stalled (progress is chunks, not bytes: PINGs or a trickled frame do not count): its FETCH is
cancelled on the wire, its chunks come from another holder (while time is left) or as TEXT,
and the directory leaves it out of lookups for a cooldown. Before that, a holder with nothing
left to send takes the chunks of one that has gone silent (shares.py), and a holder dialled
for the fetch is waited for only within the fetch's time (one with no handshake within stall_s
is a ghost and cools down too, cluster/peers.py). A holder that answers TEXT for a chunk another
holder has, while the deadline is ahead, has it asked of that other for KV; if that one sends
KV, the first cools down (it advertised what it would not send).

The file is long (~650 lines) because plan, the three stages and the hand-off of a stalled
holder's chunks share one FetchJob's state; each stage reads the same queues and counters."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from codec import catalog, select_layers
from codec.errors import CodecError
from codec.layout import PrefixKV
from transport import aio
from transport.frames import text_wire_bytes
from transport.messages import BAD_CRC, NOT_FOUND
from transport.policy import TEXT, text_seconds

from kvstreamd import events
from kvstreamd.cluster.admission import Refused, Wanted, admit
from kvstreamd.coder import Coder, DecodeTally
from kvstreamd.cluster.directory import Directory, Holders
from kvstreamd.metrics import Metrics
from kvstreamd.node.options import FetchOptions
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.store.keys import chunk_bounds, chunk_keys, chunk_ranges, prefix_keys
from kvstreamd.cluster.shares import Shares, level_tier, needed_level
from kvstreamd.store.store import Store

log = logging.getLogger(__name__)

QUEUE_DEPTH = 2  # chunks between stages: enough to overlap, little enough to bound memory
DECODE_DEPTH = 2  # chunks decoding at once
# The weight of one fetch's decodes in the decode rate told to senders (Coder.observe)
FETCH_RATE_WEIGHT = 0.5

grace_s = aio.grace_s  # a fetch ends within its wait + max(1 s, 10% of the deadline), whatever its peers do


@dataclass
class Plan:
    """Where each chunk of a prompt will come from."""

    keys: list[bytes]
    bounds: list[tuple[int, int]]  # token [start, end) of each chunk
    local: int  # chunks [0, local) are in the local store
    found: int  # chunks [0, found) are held somewhere (locally or by a peer)
    peers: dict[str, int]  # peer -> end of its run of chunks from `local`
    holders: Holders  # who holds each chunk from `local` on, as the directory answered

    @property
    def found_tokens(self) -> int:
        return self.bounds[self.found - 1][1] if self.found else 0


async def plan(store: Store, directory: Directory, model_id: str, tokens: list[int], chunk_tokens: int,
               levels: list[str] | None = None) -> Plan:
    """One lookup of the prompt's key chain (and, where it stops inside a chunk, one of that
    chunk's shorter lengths). A chunk held here only at levels other than `levels` (the
    fetch's; None: any) is looked for at a peer, and a peer known to hold a chunk only at other
    levels does not count as its holder."""
    keys = chunk_keys(model_id, tokens, chunk_tokens)
    bounds = chunk_bounds(len(tokens), chunk_tokens)
    local = store.longest_prefix(keys, levels)
    held = (await directory.lookup(keys, local)).want(levels)
    peers = held.longest_prefix(local)
    found = max([local, *peers.values()])
    if found < len(keys):
        # A stored context whose last chunk is partial is a prefix of a longer prompt too: try
        # that chunk at every length shorter than the prompt's, longest first (~1 ms of hashing).
        s, e = bounds[found]
        candidates = prefix_keys(keys[found - 1] if found else None, model_id, tokens[s:e - 1])
        shorter = (await directory.lookup(candidates, 0, chain=False)).want(levels)
        for k in range(len(candidates), 0, -1):
            key = candidates[k - 1]
            if (store.has(key, levels) and local == found) or shorter.holders(k - 1):
                keys, bounds = keys[:found] + [key], bounds[:found] + [(s, s + k)]
                local = store.longest_prefix(keys, levels)
                at = [held.levels_at(i) for i in range(local, found)] + [shorter.levels_at(k - 1)]
                run = [held.of(i) for i in range(local, found)] + [shorter.of(k - 1)] if local <= found else []
                held = Holders(keys, local, run, directory.cooling, {**held.addresses, **shorter.addresses},
                               {**held.zones, **shorter.zones}, at[:len(run)]).want(levels)
                peers = held.longest_prefix(local)
                found = max([local, *peers.values()])
                break
    return Plan(keys, bounds, local, found, peers, held)


class _Busy:
    """The seconds during which at least one of a stage's overlapping jobs ran (`with busy:`)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._active = 0
        self._since = 0.0

    def __enter__(self) -> None:
        if not self._active:
            self._since = time.perf_counter()
        self._active += 1

    def __exit__(self, *exc) -> None:
        self._active -= 1
        if not self._active:
            self.total += time.perf_counter() - self._since


@dataclass
class _Item:
    i: int
    kind: str  # "kv" or "text"
    level: str
    source: str  # "local", a peer's node id, or "fallback"
    payload: bytes | None = None
    arrived: float = 0.0
    error: str | None = None
    kv: torch.Tensor | None = None  # decoded: [layers the chunk holds, 2, T, H, D]
    nbytes: int = 0  # wire bytes of the chunk (payload, or the TEXT's whole frame: frames.text_wire_bytes)
    staged: object = None  # codec.gpu.Staged: parsed and uploaded on the receive stream
    filled: bool = False  # decoded straight into the buffer: nothing for the fill stage to copy


@dataclass
class FetchResult:
    events: int = 0
    levels: list[str] = field(default_factory=list)  # of each chunk, in prompt order
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    deadline_missed: bool = False
    stage_s: dict[str, float] = field(default_factory=lambda: {"receive": 0.0, "decode": 0.0, "fill": 0.0})


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
        self._t0 = options.arrived
        self._texted: dict[int, set[str]] = {}  # chunk -> peers that answered it TEXT, asked elsewhere for KV
        self._distrusted: set[str] = set()  # peers cooled down in this fetch for TEXT another sent as KV
        self._open: set[str] = set()  # peers with a FETCH of this fetch out (not ended)
        self._quiet: set[str] = set()  # of those, the ones that have delivered nothing yet
        self._levels: dict[int, str] = {}  # chunk -> the level it was filled at (FetchResult.levels, in order)
        self.tally = DecodeTally()  # its coded chunks' decodes on the CPU: one sample of the told rate

    def _remaining_ms(self) -> int:
        return int(self.options.deadline_ms - (time.monotonic() - self._t0) * 1000)

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
        return self._t0 + self.wait_s + grace_s(self.options.deadline_ms) / 2

    async def run(self, emit: Callable[[events.Event], Awaitable[None]]) -> FetchResult:
        received: asyncio.Queue[_Item | None] = asyncio.Queue(QUEUE_DEPTH)
        decoded: asyncio.Queue[_Item | None] = asyncio.Queue(QUEUE_DEPTH)
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
        self.result.deadline_missed = self.result.deadline_missed or self._remaining_ms() < 0
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
                await out.put(_Item(i, "text", TEXT, "fallback",
                                    error=f"corrupt locally: {why}" if why else "evicted locally"))
                continue
            self.metrics.chunks.labels(level, "local").inc()
            payload = rec.levels[level]
            if len(self._layers(i)) != rec.shape[0]:  # a hybrid model's chunk outside a sliding window
                payload = await asyncio.to_thread(select_layers, payload, self._layers(i))
            item = _Item(i, "kv", level, "local", payload, time.monotonic(), nbytes=len(payload))
            await self._upload(item)
            await out.put(item)
        if p.found > p.local:
            busy += await self._receive_from_peers(out)
        self.result.stage_s["receive"] = busy
        await out.put(None)

    async def _receive_from_peers(self, out: asyncio.Queue) -> float:
        """Chunks [local, found) from every peer holding them at once (shares.py says who sends
        which), handed on to decode as they come (the fill stage puts them back in order);
        those no peer sent come as TEXT. Where a peer failed and left chunks no other holder of
        the plan has, the directory is asked once more (a holder may have got them since).
        Returns the seconds in which some peer was streaming."""
        p = self.plan
        ready: dict[int, _Item] = {}
        busy = _Busy()
        failed: set[str] = set()
        chunks = list(range(p.local, p.found))
        handed: set[int] = set()

        def holders(i: int) -> list[str]:
            return [q for q in p.holders.holders(i) if q not in failed]

        while True:
            needed = self._needed_level(chunks, {q for i in chunks for q in holders(i)})
            shares = Shares(chunks, holders, self._rate, near=self._near,
                            tier=lambda q, i: level_tier(p.holders.levels_of(q, i), needed, self.levels))
            await self._round(shares, ready, out, handed, busy)
            chunks = shares.missing()
            if not chunks or not shares.failed or time.monotonic() >= self.peers_until:
                break
            failed |= shares.failed
            fresh = (await self.peers.directory.lookup(p.keys, chunks[0])).want(self.levels)
            if not any(q not in failed for i in chunks for q in fresh.holders(i)):
                break
            p.holders = fresh
        missing = [j for j in range(p.local, p.found) if j not in handed]
        late = None  # why the chunks left come as TEXT: the time for peers ran out
        if missing and time.monotonic() >= self.peers_until:
            ms = self.options.deadline_ms
            wait = f"the deadline ({ms} ms)" if self.wait_s * 1000 <= ms else \
                f"the time recomputing them takes ({self.wait_s:.1f} s, past the deadline of {ms} ms)"
            late = f"not received within {wait} + {grace_s(ms) / 2:g} s"
            self.result.errors.append(f"chunks {chunk_ranges(missing)} {late}: recompute them")
            self.result.deadline_missed = True
        for j in missing:
            await out.put(ready.pop(j, None) or _Item(j, "text", TEXT, "fallback", error=late))
        return busy.total

    async def _round(self, shares: Shares, ready: dict[int, _Item], out: asyncio.Queue, handed: set[int],
                     busy: _Busy) -> None:
        """Stream from every source of `shares` at once, handing each chunk on as it comes (a
        chunk held up at one peer holds up no other's decode); `handed` gains those handed on."""
        p = self.plan
        changed = asyncio.Condition()
        streams = [asyncio.ensure_future(self._from_peer(peer, shares, ready, changed, busy))
                   for peer in shares.sources]
        lingering: set[asyncio.Task] = set()
        try:
            while len(handed) < p.found - p.local:
                for j in sorted(ready):
                    handed.add(j)
                    await out.put(ready.pop(j))
                if len(handed) >= p.found - p.local or all(t.done() for t in streams):
                    break
                async with changed:
                    await changed.wait_for(lambda: ready or all(t.done() for t in streams))
            # Every chunk is in, and the fetch ends now. Two kinds of request still open run on
            # in the background (_linger): one that owes nothing (its END follows its last ACK:
            # the sender finishes the request, its accounting and its log, rather than seeing a
            # CANCEL), and one that has delivered nothing yet, to its stall verdict (a chunk: it
            # was only slow; none for stall_s: it stalled and cools down), so that a silent
            # holder is named, and not asked next time, though others sent its chunks. A request
            # still sending chunks others sent first is cancelled.
            lingering = {t for peer, t in zip(shares.sources, streams) if not t.done() and peer in self._open
                         and (peer in self._quiet or not shares.pending(peer))}
        finally:
            ended = [t for t in streams if t not in lingering]
            for t in ended:
                t.cancel()
            done = await asyncio.gather(*ended, return_exceptions=True)
            for t in lingering:
                self.peers.spawn(self._linger(t))
        for j in sorted(ready):  # came as the last stream ended
            handed.add(j)
            await out.put(ready.pop(j))
        for e in done:
            if isinstance(e, Exception):
                raise e

    async def _linger(self, stream: asyncio.Task) -> None:
        """A request left running when its fetch ended (_round): waited for until its END or
        its stall verdict, within the fetch's time for peers, then ended."""
        try:
            await asyncio.wait({stream}, timeout=max(self.peers_until - time.monotonic(), 0))
        finally:
            stream.cancel()
            (e,) = await asyncio.gather(stream, return_exceptions=True)
            if isinstance(e, Exception):
                log.warning("a request left running after its fetch ended with %s: %s", type(e).__name__, e)

    def _near(self, peer: str) -> bool:
        """`peer` is in this node's zone (or this node has none)."""
        mine = self.peers.zone
        return not mine or self.peers.zone_of(peer, self.plan.holders) == mine

    def _needed_level(self, chunks: list[int], holders: set[str]) -> str:
        """The level the deadline left needs for these chunks, over the holders' links together."""
        rates = [r for q in holders if (r := self._rate(q))]
        return needed_level(self.levels, self._fp16_bytes(chunks), sum(rates) if rates else None,
                            self._remaining_ms() / 1000)

    def _rate(self, peer: str) -> float | None:
        bw = self.peers.bandwidth
        return bw.get(peer).estimate() if peer in bw else None

    async def _from_peer(self, peer: str, shares: Shares, ready: dict[int, _Item], changed: asyncio.Condition,
                         busy: _Busy) -> None:
        """One peer's part of a fetch: ask it for what `shares` hands it, until nothing is left
        that it could send, or it fails (its chunks then go to the others)."""
        async def tell() -> None:
            async with changed:
                changed.notify_all()

        try:
            while not shares.done() and peer not in shares.failed:
                share = shares.take(peer)
                left = self.peers_until - time.monotonic()
                if left <= 0:
                    shares.fail(peer)
                    return
                if not share:
                    if not shares.waiting():
                        return
                    again = shares.recheck_in(peer)  # when a request it could take from turns silent
                    try:
                        async with changed:  # until a chunk arrives or one is handed back
                            await asyncio.wait_for(changed.wait(), left if again is None else min(left, again + 0.001))
                    except TimeoutError:
                        if again is None or again >= left:
                            return
                    continue
                ok = await self._stream(peer, share, shares, ready, tell, busy, left)
                if ok and self._texting(peer):
                    ok = False  # it answered TEXT for chunks others have: not asked more in this fetch
                if not ok:
                    shares.fail(peer)
                await tell()  # what it did not send may be another's to take now
                if not ok:
                    return
        finally:
            await tell()

    async def _stream(self, peer: str, share: list[int], shares: Shares, ready: dict[int, _Item], tell,
                      busy: _Busy, left: float) -> bool:
        """One FETCH of chunks `share` from `peer`; False when the peer is not to be asked again."""
        p = self.plan
        # dialled within the time left (a holder that never answers holds nothing up: the
        # others take its chunks meanwhile, shares.py), a ghost cooling down (cluster/peers.py)
        conn = await self.peers.connect_to(peer, p.holders.addresses.get(peer), wait_s=left,
                                           stall_s=self.options.stall_s)
        if conn is None:
            return False
        prof = self.coder.profile_for(self.options.model_id)
        left = self.peers_until - time.monotonic()
        stream = conn.fetch([p.keys[j] for j in share], max(self._remaining_ms(), 1), self.levels + [TEXT],
                            decode_mbps=self.coder.rate(gpu=self.stages is not None),
                            recompute_tps=self.options.recompute_tokens_per_s,
                            stall_s=self._stall_s(peer, share), limit_s=max(left, 0.001),
                            prefix_tokens=self._prefix_tokens, rule=self.options.rule,
                            wait_ms=max(int((self._t0 + self.wait_s - time.monotonic()) * 1000), 1),
                            recompute_doubling=self.options.recompute_doubling_tokens,
                            text_last=self.options.text_last)
        nbytes, sent = 0, 0  # positions of `share` received
        at = lambda: share[min(sent, len(share) - 1)]  # noqa: E731  the chunk it was to send next
        self._open.add(peer)
        self._quiet.add(peer)
        try:
            with busy:
                async for msg in stream:
                    self._quiet.discard(peer)
                    j, sent = share[msg.i], msg.i + 1
                    if hasattr(msg, "payload"):
                        nbytes += len(msg.payload)
                        try:  # the chunk asked for? Checked before any of it is decoded or sized
                            admit(msg.payload, msg.level, Wanted.of(p.keys, p.bounds, j, prof, self.levels,
                                                                    self._layers(j)), msg.key)
                        except Refused as e:
                            why = f"peer {peer} sent chunk {j} that is not the chunk asked: {e}"
                            log.warning("%s; it and the rest come from another peer or as text", why)
                            self.result.errors.append(why)
                            self.metrics.error(f"chunk_refused_{e.reason}")
                            return False  # not trusted for the rest of this fetch
                        item = _Item(j, "kv", msg.level, peer, msg.payload, time.monotonic(), nbytes=len(msg.payload))
                    else:
                        item = _Item(j, "text", TEXT, peer, arrived=time.monotonic(), nbytes=text_wire_bytes(msg.tokens, msg.req, msg.i))
                        if self._ask_elsewhere(peer, j, shares):
                            await tell()
                            if sent < len(share) and shares.redundant(peer):
                                break
                            continue
                    if shares.arrived(j, peer):
                        self.metrics.chunks.labels(item.level, "received").inc()
                        if item.kind == "kv":
                            self._kv_came(j, peer, shares)
                        await self._upload(item)
                        ready[j] = item
                    await tell()
                    if sent < len(share) and shares.redundant(peer):
                        break  # the rest of its share came from others: its request is cancelled below
                    # (its own last chunk in: its END follows, and the sender finishes the request)
            if stream.end is not None:
                if stream.end.deadline_missed:
                    self.result.deadline_missed = True
                if not self._texting(peer):
                    self.peers.directory.served(peer)
            shares.give_back(peer)
            return True
        except aio.FetchStalled as e:
            cooldown = self.peers.directory.cool_down(peer, self.options.stall_s)
            why = f"peer {peer} stalled at chunk {at()}: {e.msg}; it is avoided for {cooldown:g} s"
            log.warning("%s; the rest comes from another peer or as text", why)
            self.result.errors.append(why)
            self.metrics.error("peer_stalled")
            return False
        except aio.FetchTimedOut:
            # still sending, only too slowly for this fetch: not marked; its chunks come as text
            log.info("peer %s: chunk %d not in by the fetch's wait + grace; the rest comes as text", peer, at())
            return False
        except aio.FetchFailed as e:
            if e.code != NOT_FOUND:
                why = f"peer {peer} failed at chunk {at()}: {e.code}: {e.msg}"
                log.warning("%s; the rest comes from another peer or as text", why)
                self.result.errors.append(why)
                self.metrics.error("peer_fetch_failed")
                return False
            # The holder lost that chunk (evicted or damaged: its WITHDRAW follows) after it
            # advertised it, or holds it at levels not asked: it sent the chunks before it and
            # may still serve the others; only that one looks elsewhere.
            p.holders.drop(peer, at())
            why = f"peer {peer} no longer holds chunk {at()}: {e.msg}"
            log.info("%s; that chunk comes from another peer or as text", why)
            self.result.errors.append(why)
            shares.give_back(peer)
            return True
        except aio.TransportError as e:
            why = f"peer {peer} failed at chunk {at()}: {e.code}: {e.msg}"
            log.warning("%s; the rest comes from another peer or as text", why)
            self.result.errors.append(why)
            # a chunk damaged on the wire closes the connection (bad_crc): a damaged chunk, counted so
            self.metrics.error("chunk_bad_crc" if e.code == BAD_CRC else "peer_fetch_failed")
            return False
        finally:
            self._open.discard(peer)
            self._quiet.discard(peer)
            await stream.cancel()  # a no-op once it ended; else the peer stops too
            self.result.bytes += nbytes
            self.metrics.peer_bytes.labels(peer, "in").inc(nbytes)

    def _ask_elsewhere(self, peer: str, j: int, shares: Shares) -> bool:
        """`peer` answered chunk j as TEXT. While the deadline is ahead and another live holder
        has j (at a level of this fetch: the plan's holders are those), j is asked of it for KV
        instead (True); else the TEXT is used (False). A holder that then sends KV for it shows
        `peer` advertised what it would not send (_kv_came)."""
        p = self.plan
        if self._remaining_ms() <= 0 or not any(q != peer and q not in shares.failed for q in p.holders.holders(j)):
            return False
        self._texted.setdefault(j, set()).add(peer)
        p.holders.drop(peer, j)
        shares.retry(peer, j)
        log.info("peer %s answered chunk %d as TEXT; asking another holder for its KV", peer, j)
        return True

    def _texting(self, peer: str) -> bool:
        """`peer` answered TEXT in this fetch for a chunk another holder was asked for instead."""
        return peer in self._distrusted or any(peer in who for who in self._texted.values())

    def _kv_came(self, j: int, peer: str, shares: Shares) -> None:
        """Chunk j came as KV from `peer`: each holder that answered it TEXT is trusted less:
        not asked again in this fetch, and left out of lookups for a cooldown as a stalled peer
        is."""
        for q in sorted(self._texted.pop(j, ())):
            if q in self._distrusted:
                continue
            self._distrusted.add(q)
            shares.fail(q)
            cooldown = self.peers.directory.cool_down(q, self.options.stall_s, "text_for_kv")
            why = (f"peer {q} answered chunk {j} as TEXT, which {peer} sent as KV in time; "
                   f"it is avoided for {cooldown:g} s")
            log.warning(why)
            self.result.errors.append(why)
            self.metrics.error("peer_text_for_kv")

    def _stall_s(self, peer: str, share: list[int]) -> float:
        """How long `peer` may go without delivering a whole chunk of `share`: [fetch] stall_s,
        or, over a link measured too slow to bring the largest of them in that time (at the best
        level's nominal ratio), twice that chunk's time on it."""
        rate = self._rate(peer)
        ratios = [r for lv in self.levels if lv in catalog.SCHEMES and (r := catalog.SCHEMES[lv].ratio)]
        if not rate or not ratios or not share:
            return self.options.stall_s
        biggest = max(self._fp16_bytes([j]) for j in share) / min(ratios)
        return max(self.options.stall_s, 2 * biggest / rate)

    def _fp16_bytes(self, chunks: list[int]) -> int:
        """The fp16 K and V of these chunks' tokens, all layers."""
        prof = self.coder.profile_for(self.options.model_id)
        token_bytes = prof.layers * 2 * prof.heads * prof.head_dim * 2
        return sum(self.plan.bounds[i][1] - self.plan.bounds[i][0] for i in chunks) * token_bytes

    async def _upload(self, item: _Item) -> None:
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
        busy = _Busy()
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

    async def _decode_one(self, item: _Item, slots: asyncio.Semaphore | None, busy: "_Busy") -> _Item:
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
                            item.kv = await asyncio.to_thread(self._decode_on_device, item)
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
                        item.kind, item.level, item.error, item.kv = "text", TEXT, str(e), None
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
        if len(reading) != 1 or tuple(reading[0].layers) != tuple(self._layers(i)):
            return None
        part = reading[0]
        return part.kv[:, :, s - part.start:e - part.start]

    def _decode_on_device(self, item: _Item) -> object:
        t0 = time.perf_counter()
        staged = self.stages.decode(item.staged or self.stages.receive(item.payload))
        item.staged = None
        self.coder.observe(staged.kv.numel() * 2 / 1e6, time.perf_counter() - t0, gpu=True)
        return staged

    @property
    def _prefix_tokens(self) -> int | None:
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
        return self.layout is None or len(self._layers(i)) == self.layout.layers

    def _layers(self, i: int) -> tuple[int, ...]:
        """The layers of chunk i this fetch moves (worked out once per fetch)."""
        return self._chunk_layers[i]

    def _check_shape(self, item: _Item) -> None:
        s, e = self.plan.bounds[item.i]
        H, D = self.buffer.parts[0].kv.shape[3:]
        want = (len(self._layers(item.i)), 2, e - s, H, D)
        shape = tuple((item.kv.kv if hasattr(item.kv, "prep") else item.kv).shape)
        if shape != want:
            raise CodecError(f"decoded shape {shape} is not the chunk's {want}")

    def _fill_cpu(self, i: int, kv: torch.Tensor) -> None:
        """Chunk i's decoded layers into the parts of the buffer that hold them."""
        s, e = self.plan.bounds[i]
        row = {layer: r for r, layer in enumerate(self._layers(i))}
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
        early: dict[int, _Item] = {}
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

    async def _fill_one(self, item: _Item, emit: Callable[[events.Event], Awaitable[None]]) -> float:
        """Chunk `item` into the buffer and its event to the client; returns the seconds copying."""
        busy = 0.0
        s, e = self.plan.bounds[item.i]
        if item.kind == "kv" and not item.filled:
            t = time.perf_counter()
            if hasattr(item.kv, "prep"):  # decoded on the device: copy on the fill stream
                done = self.stages.fill(item.kv, self.buffer.dense()[:, :, s:e])  # (GPU stages: dense layouts)
                if done is not None:
                    await asyncio.to_thread(done.synchronize)
            else:
                await asyncio.to_thread(self._fill_cpu, item.i, item.kv)
            busy += time.perf_counter() - t
            item.kv = None
        self._levels[item.i] = item.level
        self.result.events += 1
        await emit(events.Chunk(
            item.i, s, e, item.kind, item.level, item.source, t_ms=round((time.monotonic() - self._t0) * 1000, 2),
            bytes=item.nbytes, arrived_ms=round((item.arrived - self._t0) * 1000, 2) if item.arrived else None,
            error=item.error or None))
        return busy
