"""Which peers hold which chunk keys. `Directory` is the shape every backend has: a lookup of a
prompt's key chain (one round trip, answered as `Holders`, which the fetch then plans and works
from), and the peers that stalled a fetch, left out of lookups while they cool down (this
node's own judgement, whatever the backend). Backends ([directory] backend):

- `PeerDirectory` ("peers", the default): fed by each connected peer's ADVERTISE (a full list
  on connect, then deltas) and WITHDRAW, and telling them this node's in turn; needs nothing,
  serves a small cluster's full mesh.
- `redis_directory.RedisDirectory` ("redis"): the same lookups in a Redis server, under a lease
  each host renews; peers are dialled when a fetch needs them.

A backend also has its part in the peer connections (`peer_connected`, `peer_message`,
`peer_closed`): the peer manager tells every backend about each connection and each message
that is not a fetch's, and only the built-in one acts on them, so the peer manager never asks
which backend it has."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from codec.tuning import catalog
from transport import aio
from transport.messages import Advertise, Message, Withdraw

log = logging.getLogger(__name__)

ADVERTISE_BATCH = 20_000  # keys per ADVERTISE frame (32 B each: well under max_frame_bytes)


Held = dict[bytes, frozenset[str]]  # chunk keys with the levels each is held at


def advertisements(held: Held) -> list[Advertise]:
    """ADVERTISEs of these keys: one per set of levels held, ADVERTISE_BATCH keys at most each."""
    by_levels: dict[frozenset[str], list[bytes]] = {}
    for key, levels in held.items():
        by_levels.setdefault(levels, []).append(key)
    return [Advertise(keys[i:i + ADVERTISE_BATCH], sorted(levels) or None)
            for levels, keys in sorted(by_levels.items(), key=lambda kv: sorted(kv[0]))
            for i in range(0, len(keys), ADVERTISE_BATCH)]


class Holders:
    """Who holds each key of keys[start:], as one lookup found it (a chain lookup stops at the
    first key nobody holds), and at which levels where the backend knows them. Peers cooling
    down after a stall are left out when asked; so is, once `want(levels)` has named a fetch's
    levels, a holder known to hold a chunk at none of them (it would answer NOT_FOUND)."""

    def __init__(self, keys: Sequence[bytes], start: int, held: list[set[str]],
                 cooling: Callable[[str], float | None], addresses: dict[str, str] | None = None,
                 zones: dict[str, str] | None = None, levels: list[dict[str, frozenset[str]]] | None = None) -> None:
        self.keys = list(keys)
        self.start = start
        self._held = held  # held[j]: the holders of keys[start + j]
        self._levels = levels or [{} for _ in held]  # levels[j][peer]: the levels it holds keys[start + j] at
        self._cooling = cooling
        self._wanted: frozenset[str] | None = None
        self.addresses = addresses or {}  # node id -> "host:port", where the backend knows it
        self.zones = zones or {}  # node id -> its [node] zone, where the backend knows it

    def want(self, levels: Sequence[str] | None) -> Holders:
        """Count as holders only those holding a chunk at one of `levels` (None: at any)."""
        self._wanted = None if levels is None else frozenset(levels)
        return self

    def of(self, i: int) -> set[str]:
        j = i - self.start
        if not 0 <= j < len(self._held):
            return set()
        if self._wanted is None:
            return self._held[j]
        return {p for p in self._held[j] if (lv := self._levels[j].get(p)) is None or not lv.isdisjoint(self._wanted)}

    def levels_of(self, peer: str, i: int) -> frozenset[str] | None:
        """The levels `peer` holds chunk i at; None where that is not known (any may be)."""
        j = i - self.start
        return self._levels[j].get(peer) if 0 <= j < len(self._levels) else None

    def levels_at(self, i: int) -> dict[str, frozenset[str]]:
        j = i - self.start
        return self._levels[j] if 0 <= j < len(self._levels) else {}

    def holders(self, i: int) -> list[str]:
        return sorted(p for p in self.of(i) if self._cooling(p) is None)

    def longest_prefix(self, start: int) -> dict[str, int]:
        """Per peer: the index one past the last chunk of the unbroken run keys[start:] it holds.
        Peers holding nothing there, or cooling down after a stall, are left out."""
        out: dict[str, int] = {}
        for peer in self.holders(start):
            n = start
            while n < len(self.keys) and peer in self.of(n):
                n += 1
            out[peer] = n
        return out

    def best(self, start: int, exclude: Iterable[str] = ()) -> tuple[str | None, int]:
        """The peer holding the longest run of keys from `start` (ties: the lowest node id, so
        every caller picks alike), and where its run ends; (None, start) when none holds it."""
        skip = set(exclude)
        runs = sorted((-n, peer) for peer, n in self.longest_prefix(start).items() if peer not in skip)
        return (runs[0][1], -runs[0][0]) if runs else (None, start)

    def drop(self, peer: str, i: int) -> None:
        """`peer` said it does not hold chunk i after all."""
        j = i - self.start
        if 0 <= j < len(self._held):
            self._held[j].discard(peer)


# A peer that stalled a fetch (or is a ghost, or answered TEXT for what it advertised) is left
# out of lookups for COOLDOWN_STALLS * stall_s, doubled for each in a row (a fetch it completes
# resets that), at most COOLDOWN_MAX_S.
COOLDOWN_STALLS = 5
COOLDOWN_MAX_S = 300.0


class Directory:
    """The backend-independent part: a lookup's shape, and peers cooling down after a stall."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cool_until: dict[str, float] = {}  # peer -> clock() until which lookups skip it
        self._cool_why: dict[str, str] = {}  # peer -> why it cools down
        self._stalls: dict[str, int] = {}  # peer -> stalls in a row (a fetch it completes resets it)

    # -- what a backend provides -----------------------------------------------------------------

    async def start(self, node_id: str, address: str, held: Callable[[], Held], zone: str = "") -> None:
        """Begin publishing this node (reachable at `address`, in `zone`) and the keys `held()`
        lists, with their levels."""

    async def stop(self) -> None:
        pass

    def changed(self, added: bool, keys: Held) -> None:
        """This node's store took (added, with their levels) or dropped `keys`; called from any thread."""

    async def lookup(self, keys: Sequence[bytes], start: int = 0, chain: bool = True) -> Holders:
        """The holders of keys[start:] (chain: up to the first key nobody holds; else of every key)."""
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        """Keys known to be held, per peer."""
        return {}

    def fault(self) -> str | None:
        """Why lookups are not answered in full now (the node is degraded), or None."""
        return None

    def info(self) -> dict:
        return {"backend": "peers"}

    # -- its part in the peer connections ----------------------------------------------------------

    async def peer_connected(self, conn: aio.PeerConnection) -> None:
        """A peer connection finished its handshake (whichever side dialled)."""

    def peer_message(self, conn: aio.PeerConnection, msg: Message) -> None:
        """A message that is not part of a fetch came over `conn`."""

    def peer_closed(self, conn: aio.PeerConnection, last: bool) -> None:
        """`conn` closed; `last`: it was the last connection to its peer."""

    # -- peers that stalled a fetch ------------------------------------------------------------

    def stalled(self, peer: str, first_s: float, max_s: float, why: str = "stalled") -> float:
        """`peer` stopped answering a fetch: lookups skip it for a cooldown of `first_s`,
        doubled for each stall in a row before it (a stall after its cooldown ran out, with no
        fetch served between), at most `max_s`. A stall said while it still cools down is the
        same incident (the fetches that were streaming from it when it went quiet, each
        finding it so): it does not double again, the cooldown at its level counted from the
        latest report. (It did: eight fetches caught by one pause of a holder exiled it for
        10 x 2^7 s, capped at 300.) Its keys are kept, so it is found again once the cooldown
        is over. Returns the seconds it is avoided for."""
        left = self.cooling(peer)
        if left is None:
            self._stalls[peer] = self._stalls.get(peer, 0) + 1
        cooldown = max(min(first_s * 2 ** (self._stalls.get(peer, 1) - 1), max_s), left or 0.0)
        self._cool_until[peer] = self._clock() + cooldown
        self._cool_why[peer] = why
        return cooldown

    def cool_down(self, peer: str, stall_s: float, why: str = "stalled") -> float:
        """stalled() at the cooldown a fetch's `stall_s` sets (COOLDOWN_STALLS, COOLDOWN_MAX_S)."""
        return self.stalled(peer, COOLDOWN_STALLS * stall_s, COOLDOWN_MAX_S, why)

    def cooling_why(self, peer: str) -> str | None:
        """Why `peer` cools down ("stalled", "ghost", "text_for_kv"); None when it does not."""
        return self._cool_why.get(peer) if self.cooling(peer) is not None else None

    def served(self, peer: str) -> None:
        """`peer` completed a fetch: its next stall starts the cooldown from `first_s` again."""
        self._stalls.pop(peer, None)

    def cooling(self, peer: str) -> float | None:
        """Seconds left of `peer`'s cooldown; None when it has none."""
        until = self._cool_until.get(peer)
        if until is None:
            return None
        left = until - self._clock()
        if left <= 0:
            del self._cool_until[peer]
            self._cool_why.pop(peer, None)
            return None
        return left

    def _forget_stalls(self, peer: str) -> None:
        self._cool_until.pop(peer, None)
        self._cool_why.pop(peer, None)
        self._stalls.pop(peer, None)


class PeerDirectory(Directory):
    """The built-in backend: the keys each connected peer ADVERTISEd (with the levels, where it
    said them), until it WITHDRAWs them or its last connection closes. The peers exchange them
    over their connections: this node ADVERTISEs all it holds to each new connection, then
    each change to every connection (ADVERTISE or WITHDRAW)."""

    def __init__(self, max_keys_per_peer: int | None = None, *, clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[int], None] | None = None) -> None:
        super().__init__(clock=clock)
        self.max_keys_per_peer = max_keys_per_peer  # None: no cap
        self._held: dict[str, dict[bytes, frozenset[str] | None]] = {}  # peer -> key -> levels (None: not said)
        self._level_sets: dict[frozenset[str], frozenset[str]] = {}
        self._on_refused = on_refused  # keys a peer advertised past the cap (counted as an error)
        self._over_cap: set[aio.PeerConnection] = set()  # connections told of the cap in the log already
        self._conns: set[aio.PeerConnection] = set()
        self._held_here: Callable[[], Held] = dict
        self._deltas: asyncio.Queue[tuple[bool, Held]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broadcaster: asyncio.Task | None = None
        self._started = asyncio.Event()  # a connection up before start() waits for what is held here

    async def start(self, node_id: str, address: str, held: Callable[[], Held], zone: str = "") -> None:
        self._held_here = held
        self._started.set()
        self._loop = asyncio.get_running_loop()
        self._deltas = asyncio.Queue()
        self._broadcaster = asyncio.ensure_future(self._broadcast())

    async def stop(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.cancel()
            await asyncio.gather(self._broadcaster, return_exceptions=True)

    def changed(self, added: bool, keys: Held) -> None:
        if self._loop is not None and self._deltas is not None:
            self._loop.call_soon_threadsafe(self._deltas.put_nowait, (added, dict(keys)))

    async def _broadcast(self) -> None:
        while True:
            added, keys = await self._deltas.get()
            msgs = advertisements(keys) if added else [Withdraw(list(keys))]
            for c in list(self._conns):
                try:
                    for msg in msgs:
                        await c.send(msg)
                except aio.TransportError:
                    pass  # that connection is going away; its reader cleans up

    async def peer_connected(self, conn: aio.PeerConnection) -> None:
        self._conns.add(conn)
        await self._started.wait()
        for msg in advertisements(self._held_here()):
            await conn.send(msg)

    def peer_message(self, conn: aio.PeerConnection, msg: Message) -> None:
        peer = conn.peer_node_id
        if isinstance(msg, Advertise):
            refused = self.add(peer, msg.keys, msg.levels)
            if refused:
                # what one peer makes this node hold is bounded; past it, its keys are not kept
                # (it is then not asked for those chunks), said once per connection
                if self._on_refused is not None:
                    self._on_refused(refused)
                if conn not in self._over_cap:
                    log.warning("peer %s: advertises more than [peer] max_keys_per_peer = %d keys; %d refused, "
                                "and its keys past the cap are refused from now on", peer, self.max_keys_per_peer,
                                refused)
                    self._over_cap.add(conn)
        elif isinstance(msg, Withdraw):
            self.remove(peer, msg.keys)

    def peer_closed(self, conn: aio.PeerConnection, last: bool) -> None:
        self._conns.discard(conn)
        self._over_cap.discard(conn)
        if last:
            self.drop(conn.peer_node_id)

    def add(self, peer: str, keys: Iterable[bytes], levels: Iterable[str] | None = None) -> int:
        """Keep `keys` as held by `peer` (at `levels`; None: not said), up to max_keys_per_peer
        of them; returns how many new keys were refused for the cap (0 when all were kept). A
        key advertised again takes the levels said last."""
        held = self._held.setdefault(peer, {})
        # the names this node knows, one frozenset per distinct set shared by every key held at it
        # (so a peer's ADVERTISEs cost this node no more than its keys do)
        lv = None
        if levels is not None:
            known = frozenset(lv for lv in levels if lv in catalog.SCHEMES)
            lv = self._level_sets.setdefault(known, known)
        cap = self.max_keys_per_peer
        refused = 0
        for key in keys:
            if key in held or cap is None or len(held) < cap:
                held[key] = lv
            else:
                refused += 1
        return refused

    def remove(self, peer: str, keys: Iterable[bytes]) -> None:
        held = self._held.get(peer)
        if held is not None:
            for key in keys:
                held.pop(key, None)

    def drop(self, peer: str) -> None:
        """Forget everything `peer` said (its last connection closed), and that it stalled: a
        peer that connects again has proved it is there."""
        self._held.pop(peer, None)
        self._forget_stalls(peer)

    def holds(self, peer: str, key: bytes) -> bool:
        return key in self._held.get(peer, ())

    async def lookup(self, keys: Sequence[bytes], start: int = 0, chain: bool = True) -> Holders:
        return self.lookup_now(keys, start, chain)

    def lookup_now(self, keys: Sequence[bytes], start: int = 0, chain: bool = True) -> Holders:
        held: list[set[str]] = []
        levels: list[dict[str, frozenset[str]]] = []
        for key in keys[start:]:
            at = {peer: ks[key] for peer, ks in self._held.items() if key in ks}
            if chain and not at:
                break
            held.append(set(at))
            levels.append({peer: lv for peer, lv in at.items() if lv is not None})
        return Holders(keys, start, held, self.cooling, levels=levels)

    def counts(self) -> dict[str, int]:
        return {peer: len(keys) for peer, keys in self._held.items()}
