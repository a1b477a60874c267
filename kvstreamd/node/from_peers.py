"""The receive stage's peers (node/fetch.py): a fetch's chunks [local, found) from every peer
holding them at once, handed on to decode as they come.

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
KV, the first cools down (it advertised what it would not send). How a peer's request can end
early, and what follows, is node/endings.py's table."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from codec.tuning import catalog
from transport import aio
from transport.frames import text_wire_bytes
from transport.messages import Chunk, Fetch
from transport.policy import TEXT

from kvstreamd.cluster.admission import Refused, Wanted, admit
from kvstreamd.cluster.shares import Shares, level_tier, needed_level
from kvstreamd.node.endings import ending_of
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.coder import Coder
from kvstreamd.metrics import Metrics
from kvstreamd.node.options import FetchOptions
from kvstreamd.node.plan import Plan
from kvstreamd.node.stages import Busy, FetchResult, Item
from kvstreamd.store.keys import chunk_ranges

log = logging.getLogger(__name__)


class Job(Protocol):
    """All the peers' part asks of its fetch (node.fetch.FetchJob is the one there is)."""

    plan: Plan
    options: FetchOptions
    levels: list[str]
    result: FetchResult
    metrics: Metrics
    peers: PeerManager
    coder: Coder
    stages: object  # codec.gpu.CudaStages, or None: decoded on the CPU
    t0: float  # time.monotonic() the request arrived
    prefix_tokens: int | None  # what a peer is told of the prefix (Fetch.prefix_tokens)

    @property
    def wait_s(self) -> float: ...  # seconds from t0 that peers' chunks are waited for (grace aside)
    @property
    def peers_until(self) -> float: ...  # time.monotonic() after which no peer is waited for
    def remaining_ms(self) -> int: ...  # of the deadline
    def layers(self, i: int) -> tuple[int, ...]: ...  # of chunk i, that this fetch moves
    async def upload(self, item: Item) -> None: ...  # on a GPU: staged on the receive stream


class FromPeers:
    """One fetch's chunks from its peers (FetchJob.run's receive stage, after the local ones)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.plan = job.plan
        self.options = job.options
        self.levels = job.levels
        self.result = job.result
        self.metrics = job.metrics
        self.peers = job.peers
        self.coder = job.coder
        self._texted: dict[int, set[str]] = {}  # chunk -> peers that answered it TEXT, asked elsewhere for KV
        self._distrusted: set[str] = set()  # peers cooled down in this fetch for TEXT another sent as KV
        self._open: set[str] = set()  # peers with a FETCH of this fetch out (not ended)
        self._quiet: set[str] = set()  # of those, the ones that have delivered nothing yet

    async def receive(self, out: asyncio.Queue) -> float:
        """Chunks [local, found) from every peer holding them at once (shares.py says who sends
        which), handed on to decode as they come (the fill stage puts them back in order);
        those no peer sent come as TEXT. Where a peer failed and left chunks no other holder of
        the plan has, the directory is asked once more (a holder may have got them since).
        Returns the seconds in which some peer was streaming."""
        p = self.plan
        ready: dict[int, Item] = {}
        busy = Busy()
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
            if not chunks or not shares.failed or time.monotonic() >= self.job.peers_until:
                break
            failed |= shares.failed
            fresh = (await self.peers.directory.lookup(p.keys, chunks[0])).want(self.levels)
            if not any(q not in failed for i in chunks for q in fresh.holders(i)):
                break
            p.holders = fresh
        missing = [j for j in range(p.local, p.found) if j not in handed]
        late = None  # why the chunks left come as TEXT: the time for peers ran out
        if missing and time.monotonic() >= self.job.peers_until:
            ms = self.options.deadline_ms
            wait = f"the deadline ({ms} ms)" if self.job.wait_s * 1000 <= ms else \
                f"the time recomputing them takes ({self.job.wait_s:.1f} s, past the deadline of {ms} ms)"
            late = f"not received within {wait} + {aio.grace_s(ms) / 2:g} s"
            self.result.errors.append(f"chunks {chunk_ranges(missing)} {late}: recompute them")
            self.result.deadline_missed = True
        for j in missing:
            await out.put(ready.pop(j, None) or Item(j, "text", TEXT, "fallback", error=late))
        return busy.total

    async def _round(self, shares: Shares, ready: dict[int, Item], out: asyncio.Queue, handed: set[int],
                     busy: Busy) -> None:
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
            await asyncio.wait({stream}, timeout=max(self.job.peers_until - time.monotonic(), 0))
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
                            self.job.remaining_ms() / 1000)

    def _rate(self, peer: str) -> float | None:
        bw = self.peers.bandwidth
        return bw.get(peer).estimate() if peer in bw else None

    async def _from_peer(self, peer: str, shares: Shares, ready: dict[int, Item], changed: asyncio.Condition,
                         busy: Busy) -> None:
        """One peer's part of a fetch: ask it for what `shares` hands it, until nothing is left
        that it could send, or it fails (its chunks then go to the others)."""
        async def tell() -> None:
            async with changed:
                changed.notify_all()

        try:
            while not shares.done() and peer not in shares.failed:
                share = shares.take(peer)
                left = self.job.peers_until - time.monotonic()
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

    async def _stream(self, peer: str, share: list[int], shares: Shares, ready: dict[int, Item], tell,
                      busy: Busy, left: float) -> bool:
        """One FETCH of chunks `share` from `peer`; False when the peer is not to be asked again."""
        p = self.plan
        # dialled within the time left (a holder that never answers holds nothing up: the
        # others take its chunks meanwhile, shares.py), a ghost cooling down (cluster/peers.py)
        conn = await self.peers.connect_to(peer, p.holders.addresses.get(peer), wait_s=left,
                                           stall_s=self.options.stall_s)
        if conn is None:
            return False
        prof = self.coder.profile_for(self.options.model_id)
        left = self.job.peers_until - time.monotonic()
        stream = conn.fetch(self._ask(share), stall_s=self._stall_s(peer, share), limit_s=max(left, 0.001))
        nbytes, sent = 0, 0  # positions of `share` received
        at = lambda: share[min(sent, len(share) - 1)]  # noqa: E731  the chunk it was to send next
        self._open.add(peer)
        self._quiet.add(peer)
        try:
            with busy:
                async for msg in stream:
                    self._quiet.discard(peer)
                    j, sent = share[msg.i], msg.i + 1
                    if isinstance(msg, Chunk):
                        nbytes += len(msg.payload)
                        try:  # the chunk asked for? Checked before any of it is decoded or sized
                            admit(msg.payload, msg.level, Wanted.of(p.keys, p.bounds, j, prof, self.levels,
                                                                    self.job.layers(j)), msg.key)
                        except Refused as e:
                            return self._ended(peer, j, e, shares)  # not trusted for the rest of this fetch
                        item = Item(j, "kv", msg.level, peer, msg.payload, time.monotonic(), nbytes=len(msg.payload))
                    else:
                        item = Item(j, "text", TEXT, peer, arrived=time.monotonic(), nbytes=text_wire_bytes(msg.tokens, msg.req, msg.i))
                        if self._ask_elsewhere(peer, j, shares):
                            await tell()
                            if sent < len(share) and shares.redundant(peer):
                                break
                            continue
                    if shares.arrived(j, peer):
                        self.metrics.chunks.labels(item.level, "received").inc()
                        if item.kind == "kv":
                            self._kv_came(j, peer, shares)
                        await self.job.upload(item)
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
        except aio.TransportError as e:
            return self._ended(peer, at(), e, shares)
        finally:
            self._open.discard(peer)
            self._quiet.discard(peer)
            await stream.cancel()  # a no-op once it ended; else the peer stops too
            self.result.bytes += nbytes
            self.metrics.peer_bytes.labels(peer, "in").inc(nbytes)

    def _ask(self, share: list[int]) -> Fetch:
        """The FETCH of chunks `share`: this fetch's request as its senders need it, with what
        is left of its time and this node's decode rate."""
        o = self.options
        return Fetch.ask([self.plan.keys[j] for j in share], max(self.job.remaining_ms(), 1), self.levels + [TEXT],
                         decode_mbps=self.coder.rate(gpu=self.job.stages is not None),
                         recompute_tps=o.recompute_tokens_per_s, prefix_tokens=self.job.prefix_tokens, rule=o.rule,
                         wait_ms=max(int((self.job.t0 + self.job.wait_s - time.monotonic()) * 1000), 1),
                         recompute_doubling=o.recompute_doubling_tokens, text_last=o.text_last or None)

    def _ended(self, peer: str, chunk: int, e: Exception, shares: Shares) -> bool:
        """`peer`'s request ended at `chunk` with `e`, as ENDINGS says: logged, counted, maybe
        cooled down. True when the peer may be asked for more in this fetch."""
        end = ending_of(e)
        cooldown = self.peers.directory.cool_down(peer, self.options.stall_s) if end.cools else None
        if end.drops_chunk:
            self.plan.holders.drop(peer, chunk)
        why = end.says.format(peer=peer, chunk=chunk, e=e, cooldown=cooldown)
        log.log(end.log_level, "%s; %s", why, end.then)
        if end.recorded:
            self.result.errors.append(why)
        if end.metric is not None:
            self.metrics.error(end.metric.format(e=e))
        if end.drops_chunk:
            shares.give_back(peer)
        return end.asked_again

    def _ask_elsewhere(self, peer: str, j: int, shares: Shares) -> bool:
        """`peer` answered chunk j as TEXT. While the deadline is ahead and another live holder
        has j (at a level of this fetch: the plan's holders are those), j is asked of it for KV
        instead (True); else the TEXT is used (False). A holder that then sends KV for it shows
        `peer` advertised what it would not send (_kv_came)."""
        p = self.plan
        if self.job.remaining_ms() <= 0 or not any(q != peer and q not in shares.failed for q in p.holders.holders(j)):
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
