"""Serving a peer's FETCH: the chunks asked for, pinned while they are sent and each read from the
store just before it is sent (a FETCH holds the chunks on the wire, not the whole context), each at the level
the FETCH's rule picks from the measured link and the deadline (transport/send.py), cut to the
layers the fetcher's prefix reads. What a sender offers: each chunk's size at each level asked,
where a chunk held at some of those levels only goes at the nearest it holds (a node that kept
chunks it fetched holds each at the level it came as)."""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable

from codec import select_layers
from codec.tuning import catalog
from codec.tuning import levels as codec_levels
from codec.errors import CodecError
from codec.layout import Layout
from codec.profile import Profile
from codec.select import selected_size
from transport import aio
from transport.bandwidth import PeerBandwidth
from transport.frames import text_wire_bytes
from transport.messages import BAD_MESSAGE, NOT_FOUND, Fetch
from transport.policy import DEFAULT_RULE, RULES, TEXT, fixed_rule, text_seconds
from transport.send import send_chunks

from kvstreamd.metrics import Metrics, new_request_id
from kvstreamd.store.store import Store

log = logging.getLogger(__name__)


def nearest_held(recs, levels: list[str]) -> Callable[[int, str], str]:
    """(chunk, level) -> the level that chunk is sent at when `level` is chosen: that one where
    it is held, else the nearest it holds in `levels` (best first), a lower quality first."""
    def level_of(i: int, level: str) -> str:
        held = recs[i].levels
        if level in held:
            return level
        k = levels.index(level)
        return next((lv for lv in levels[k + 1:] + levels[:k][::-1] if lv in held), level)
    return level_of


def coded_sizes(recs, cuts, levels, level_of, read=None) -> tuple[dict[str, list[int]], int]:
    """Each chunk's size at each level (that is, at the level it goes at when that one is
    chosen), for the chunks up to the first whose header does not read, and how many those are.
    `recs` say each level's payload bytes; a chunk cut to some of its layers is `read(i)` (its
    record, or None: not readable) for the cut's size, one at a time."""
    sizes = {lv: [] for lv in levels}
    for i, (r, cut) in enumerate(zip(recs, cuts)):
        try:
            row = {}
            rec = None if cut is None else read(i)
            if cut is not None and rec is None:
                log.warning("chunk %s: not readable here", r.key.hex()[:16])
                return sizes, i
            for lv in levels:
                held = level_of(i, lv)
                row[lv] = r.levels[held] if cut is None else selected_size(rec.levels[held], cut)
            del rec
        except CodecError as e:
            log.warning("chunk %s: header does not read: %s", r.key.hex()[:16], e)
            return sizes, i
        for lv, n in row.items():
            sizes[lv].append(n)
    return sizes, len(recs)


class Serving:
    """Serves the FETCHes that come over every peer connection, this node's and the peers'
    dialled alike (PeerManager hands `serve` to each)."""

    def __init__(self, store: Store, metrics: Metrics, bandwidth: PeerBandwidth, recompute_tokens_per_s: float,
                 profile_for: Callable[[str], Profile] | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.bandwidth = bandwidth  # each peer's link, measured from the ACKs of what it was sent
        self.recompute_tokens_per_s = recompute_tokens_per_s  # TEXT's price where a FETCH does not say its own
        self.profile_for = profile_for  # model id -> its profile (layer windows, measured costs)

    async def serve(self, served: aio.ServedFetch, fetch: Fetch) -> None:
        """The handler of every peer connection's FETCH."""
        new_request_id()
        peer = served.peer.peer_node_id or "?"
        loop = asyncio.get_running_loop()
        # Pinned so eviction cannot take a chunk until it is sent; what each is (a disk-tier chunk's
        # header) is read off the loop, its payload only as it is about to be sent (_send).
        recs = await asyncio.to_thread(self.store.pin_info, fetch.keys)
        pinned = collections.Counter(r.key for r in recs if r is not None)  # the pins it still holds

        def release(key: bytes) -> None:  # a chunk sent needs its pin no longer
            if pinned.get(key):
                pinned[key] -= 1
                self.store.unpin([key])
        try:
            # a fetcher gone silent (no ACK, not reading) holds these pins no longer than this
            async with asyncio.timeout_at(served.give_up_at):
                done = await self._send(served, fetch, recs, peer, loop, release)
        except TimeoutError:
            log.warning("peer %s: req %d not served by its deadline + grace (the fetcher sends no ACK); "
                        "given up", peer, served.req)
            self.metrics.error("served_fetch_timed_out")
            return  # the connection ends the request (ERROR internal: fewer chunks than asked)
        finally:
            self.store.unpin(list(pinned.elements()))
        if done is None:
            return
        sent, busy, estimator, sender, t0 = done
        self.metrics.peer_bytes.labels(peer, "out").inc(sent)
        est = estimator.estimate()
        if est and busy > 0:
            self.metrics.link_utilisation.labels(peer).set(min(sent / busy / est, 1.0))
        log.info("served %d chunks to %s in %.3f s (rule %s): levels %s; the first chunk's plan: %s", len(recs), peer,
                 loop.time() - t0, fetch.rule or DEFAULT_RULE, ",".join(c.level for c in sender.choices),
                 sender.choices[0].reason if sender.choices else "none")

    async def _send(self, served: aio.ServedFetch, fetch: Fetch, recs, peer: str, loop, release):
        """Send the chunks, each at the level the FETCH's rule (default: the adaptive rule)
        picks; None if some are not held or the rule is unknown."""
        rule = RULES.get(fetch.rule or DEFAULT_RULE)
        if rule is None:
            self.metrics.error("fetch_unknown_rule")
            await served.fail(BAD_MESSAGE, f"FETCH.rule: {fetch.rule[:64]!r} is not a level rule this node "
                                           f"knows (known: {', '.join(RULES)})")
            return None
        # Chunks from the first one not held (evicted, or damaged on disk or in its header) are
        # not sent: the held ones before it are, then NOT_FOUND names it, and the fetcher looks
        # for it elsewhere.
        # A chunk held here only at levels the fetcher did not ask for counts as not held: the
        # fetcher takes it from a holder that has one (a node that kept chunks it fetched holds
        # each at the level it came as).
        asked = [lv for lv in fetch.levels if lv in catalog.SCHEMES]
        none_asked = lambda r: bool(asked) and r.levels.keys().isdisjoint(asked)  # noqa: E731
        held = next((i for i, r in enumerate(recs) if r is None or none_asked(r)), len(recs))
        cuts = self._cuts(recs[:held], fetch.prefix_tokens)
        coded = [lv for lv in asked if any(lv in r.levels for r in recs[:held])]
        level_of = nearest_held(recs, coded)
        read = lambda i: self.store.get(recs[i].key)  # noqa: E731
        if any(c is not None for c in cuts):  # a cut's size reads its chunk: off the loop
            sizes, held = await asyncio.to_thread(coded_sizes, recs[:held], cuts, coded, level_of, read)
        else:
            sizes, held = coded_sizes(recs[:held], cuts, coded, level_of)
        missing = None
        if held < len(recs):
            r = recs[held]
            why = f"held here only at {', '.join(r.levels)}, not at a level asked" if r and none_asked(r) else "not held here"
            missing = f"chunk {held} ({fetch.keys[held].hex()[:16]}) is {why}"
        if missing:
            self.metrics.error("fetch_not_found")
        if held == 0:
            await served.fail(NOT_FOUND, missing)
            return None
        recs, cuts = recs[:held], cuts[:held]
        sizes = {lv: s[:held] for lv, s in sizes.items()}
        served.chunk_keys = [r.key for r in recs]  # each CHUNK says which chunk it is, from the record
        shares = [1.0 if c is None else len(c) / r.shape[0] for r, c in zip(recs, cuts)]
        sizes[TEXT] = [text_wire_bytes(r.tokens, served.req, i) for i, r in enumerate(recs)]
        caps = served.peer.peer_caps or {}
        decode_mbps = fetch.decode_mbps or float(caps.get("decode_mbps") or 60.0)
        recompute_tps = float(fetch.recompute_tps or caps.get("recompute_tokens_per_s") or self.recompute_tokens_per_s)
        # The rule prices every chunk alike: a hybrid model's chunks outside the window are a
        # fraction of the window's, so their mean, not the largest, is what the plan costs.
        fp16_mb = sum(2 * _numel(r.shape) * share for r, share in zip(recs, shares)) / len(recs) / 1e6
        work = {lv: catalog.decode_seconds(lv, fp16_mb, decode_mbps) for lv in coded}
        work[TEXT] = max(len(r.tokens) for r in recs) / recompute_tps
        # by position where the fetcher says how its prefill slows with the context
        text_s = [text_seconds(len(r.tokens), r.start, recompute_tps, fetch.recompute_doubling) for r in recs] \
            if fetch.recompute_doubling else None
        estimator = self.bandwidth.get(peer)
        if len(asked) == 1 and asked == coded:
            # One level asked for (and held): exactly that level for every chunk, as a baseline wants.
            rule = fixed_rule(coded[0])
            sizes = {coded[0]: sizes[coded[0]]}
        async def payload(i: int, lv: str) -> bytes | None:  # read as it is about to go, cut when chosen
            rec = await asyncio.to_thread(self.store.get, recs[i].key)  # pinned: held until sent
            if rec is None or lv not in rec.levels:  # its file went bad: NOT_FOUND, never other bytes
                log.warning("peer %s: req %d: chunk %d (%s) is no longer readable here", peer, served.req, i, lv)
                return None
            data = rec.levels[lv]
            if cuts[i] is None:
                return data
            try:
                return select_layers(data, cuts[i])
            except CodecError as e:
                log.warning("peer %s: req %d: chunk %d (%s) does not cut: %s", peer, served.req, i, lv, e)
                return None

        done = await send_chunks(served, sizes, payload, lambda i: list(recs[i].tokens),
                                 rule, estimator, work, catalog.dppl_table(coded, self._measured(recs[0].model_id)),
                                 on_sent=lambda i, lv, n: (self.metrics.chunks.labels(lv, "sent").inc(),
                                                           release(recs[i].key)),
                                 count=held, level_of=level_of, text_last=bool(fetch.text_last), text_s=text_s,
                                 beside=[lv for lv in coded if catalog.decoded_as_it_lands(lv)])
        if done.stopped_at is not None:
            self.metrics.error("fetch_not_found")
            i = done.stopped_at
            missing = f"chunk {i} ({fetch.keys[i].hex()[:16]}) is damaged here"
        if missing:
            await served.fail(NOT_FOUND, missing)
        return done.coded_bytes, done.busy_s, estimator, done.sender, done.started

    def _cuts(self, recs, prefix_tokens: int | None) -> list[tuple[int, ...] | None]:
        """Per chunk, the layers that read the first prefix_tokens tokens, where that is not
        all of them (None: the chunk goes whole, as for a fetcher that did not say, or a model
        whose layers all hold every token)."""
        cuts = []
        for r in recs:
            layout = self._layout(r.model_id) if prefix_tokens is not None else None
            layers = layout.chunk_layers(r.start, r.start + len(r.tokens), prefix_tokens) if layout else None
            cuts.append(None if layers is None or len(layers) == r.shape[0] else layers)
        return cuts

    def _measured(self, model_id: str) -> dict | None:
        """The model's own Δppl per level, from its profile (None: the catalog's defaults)."""
        try:
            return codec_levels.expected_dppl(self.profile_for(model_id)) if self.profile_for else None
        except CodecError:
            return None

    def _layout(self, model_id: str) -> Layout | None:
        if self.profile_for is None:
            return None
        try:
            layout = self.profile_for(model_id).layout
        except CodecError:
            return None  # no profile here for it: every layer is sent
        return None if layout.is_dense else layout


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
