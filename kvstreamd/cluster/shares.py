"""Which peer a fetch asks for which chunk, when several hold them: the bookkeeping alone, no
I/O (node/fetch.py streams what it hands out). The chunks are split among up to MAX_SOURCES
holders, each peer's share in proportion to its measured link, interleaved so that they arrive
about in order (the fill stage takes them in order); a peer that fails or gives up hands its
outstanding chunks back to the others; a peer with nothing left to ask for takes the second
half of the outstanding chunks of the peer furthest behind (the last chunks come from whichever
holder sends them first: a chunk is used once, the first time it arrives). A peer that has
delivered no chunk for PATIENCE times the stealer's own time per chunk (a holder that never
answers, a dial that hangs) is silent: an idle holder takes all of its outstanding chunks that no
other live request has, its last one too. A chunk a peer answered in a way not to be used (TEXT,
where another holder has its KV) is asked of another holder (retry). Holders are
preferred by level too: one holding a chunk at the level the fetch's deadline needs comes before
one holding only cheaper levels (on time, at a lower quality), and that before one holding only
better levels (more bytes than the deadline allows)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from codec.tuning import catalog

MAX_SOURCES = 4  # holders one fetch pulls from at once
SAFETY = 0.8  # of the deadline's time a needed level's guessed bytes may fill
# A peer is silent to a stealer once it delivered no chunk for PATIENCE x the stealer's seconds
# per chunk in this fetch, and at least PATIENCE_MIN_S (scheduling noise is no silence).
PATIENCE = 3.0
PATIENCE_MIN_S = 0.05


def needed_level(ladder: Sequence[str], fp16_bytes: float, rate: float | None, seconds: float) -> str:
    """The best level of `ladder` (best first) whose chunks, at its nominal ratio, cross at
    `rate` bytes/s within the deadline's `seconds`: the level a sender would pick for them;
    the cheapest when none does, the best while no link is measured."""
    if not ladder or rate is None:
        return ladder[0] if ladder else ""
    for level in ladder:
        ratio = catalog.SCHEMES[level].ratio if level in catalog.SCHEMES else None
        if ratio is not None and fp16_bytes / ratio <= rate * max(seconds, 0.0) * SAFETY:
            return level
    return ladder[-1]


def level_tier(held: frozenset[str] | None, needed: str, ladder: Sequence[str]) -> int:
    """How well a holder holding a chunk at `held` (None: not said) serves a fetch that needs
    `needed`: 0 holds it (or may), 1 holds a cheaper level of the ladder, 2 only better ones."""
    if held is None or needed in held or needed not in ladder:
        return 0
    n = ladder.index(needed)
    return 1 if any(lv in held and ladder.index(lv) > n for lv in ladder) else 2


class Shares:
    def __init__(self, chunks: Iterable[int], holders: Callable[[int], list[str]],
                 rate: Callable[[str], float | None], max_sources: int = MAX_SOURCES,
                 near: Callable[[str], bool] = lambda peer: True,
                 tier: Callable[[str, int], int] = lambda peer, i: 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.chunks = list(chunks)
        self._clock = clock
        self._began: dict[str, float] = {}  # peer -> clock() of its first take
        self._since: dict[str, float] = {}  # peer -> clock() of its latest take or chunk
        self._sent: dict[str, int] = {}  # peer -> chunks it delivered first
        self._holders = holders  # asked anew each time: a holder that said NOT_FOUND drops out
        self._arrived: set[int] = set()
        self._todo: list[int] = []  # chunks given back, nobody asking for them
        self._asked: dict[str, list[int]] = {}  # peer -> chunks of its request still to arrive
        self.failed: set[str] = set()
        every = sorted({p for i in self.chunks for p in holders(i)})
        known = [r for p in every if (r := rate(p))]
        default = sorted(known)[len(known) // 2] if known else 1.0  # unmeasured: the median link
        self._rate = {p: rate(p) or default for p in every}
        self._tier = tier  # level_tier of a holder for a chunk: lower is better
        best = {p: min((tier(p, i) for i in self.chunks if p in holders(i)), default=2) for p in every}
        # holders in this node's zone first, then by the levels they hold, the faster first;
        # others only for what those lack
        ranked = sorted(every, key=lambda p: (not near(p), best[p], -self._rate[p], p))
        self._near = [p for p in ranked if near(p)][:max_sources]
        self.sources = list(self._near)
        for i in self.chunks:  # and, past those, a holder of each chunk they do not hold
            if holders(i) and not set(holders(i)) & set(self.sources):
                self.sources.append(next(p for p in ranked if p in holders(i)))
        self._first = self._split()

    def _split(self) -> dict[str, list[int]]:
        """Each chunk to the source that would have it soonest, counting each source's queue
        in chunks over its rate (chunks alike in size: the sender picks the level)."""
        load = {p: 0.0 for p in self.sources}
        out: dict[str, list[int]] = {p: [] for p in self.sources}
        for i in self.chunks:
            can = [p for p in self._near if p in self._holders(i)] or [p for p in self.sources
                                                                        if p in self._holders(i)]
            if not can:
                continue  # held by nobody: the fetch ends before it
            top = min(self._tier(p, i) for p in can)
            can = [p for p in can if self._tier(p, i) == top]
            p = min(can, key=lambda q: (load[q] + 1 / self._rate[q], q))
            load[p] += 1 / self._rate[p]
            out[p].append(i)
        return out

    # -- what a peer asks for next ---------------------------------------------------------------

    def take(self, peer: str) -> list[int]:
        """The chunks `peer` should ask for now, in order ([] when there is nothing for it): its
        first share, else its part of the chunks given back that it holds, else the second
        half of what the peer furthest behind still has to send."""
        if peer in self.failed:
            return []
        share = self._first.pop(peer, None)
        if share is None:
            share = self._given_back(peer) or self._steal(peer)
        share = [i for i in share if i not in self._arrived]
        self._asked[peer] = share
        if share:
            now = self._clock()
            self._began.setdefault(peer, now)
            self._since[peer] = now
        return share

    def _given_back(self, peer: str) -> list[int]:
        mine = [i for i in self._todo if peer in self._holders(i)]
        if not mine:
            return []
        takers = max(1, sum(1 for p in self.sources if p not in self.failed and not self.pending(p)))
        part = mine[:-(-len(mine) // takers)]
        self._todo = [i for i in self._todo if i not in part]
        return part

    def _steal(self, peer: str) -> list[int]:
        silent = self._silent(peer)
        if silent:
            return silent
        behind = [(len(c), p, c) for p in self._asked if p != peer and p not in self.failed
                  and (c := [i for i in self.pending(p) if peer in self._holders(i)])]
        if not behind:
            return []
        n, victim, chunks = max(behind, key=lambda t: (t[0], t[1]))
        if n == 1 and self._rate.get(victim, 0) >= self._rate.get(peer, 0):
            return []  # its last chunk: no sooner from a link no faster
        return chunks[n // 2:]

    def _patience(self, peer: str) -> float | None:
        """Seconds without a chunk after which another peer is silent to `peer`: PATIENCE x
        its own seconds per chunk so far; None before it delivered one (nothing to judge by)."""
        n = self._sent.get(peer, 0)
        if not n:
            return None
        return max(PATIENCE_MIN_S, PATIENCE * (self._since[peer] - self._began[peer]) / n)

    def _live_others(self, peer: str) -> list[str]:
        return [p for p in self._asked if p != peer and p not in self.failed and self.pending(p)]

    def _silent(self, peer: str) -> list[int]:
        """The chunks `peer` holds of the requests silent to it that no other live request has."""
        patience = self._patience(peer)
        if patience is None:
            return []
        now = self._clock()
        others = self._live_others(peer)
        silent = {p for p in others if now - self._since[p] >= patience}
        covered = {i for p in others if p not in silent for i in self.pending(p)}
        return sorted({i for p in silent for i in self.pending(p)
                       if i not in covered and peer in self._holders(i)})

    def recheck_in(self, peer: str) -> float | None:
        """Seconds until a request `peer` could take chunks from turns silent (None: none will),
        for a peer with nothing to ask for to look again then."""
        patience = self._patience(peer)
        if patience is None or peer in self.failed:
            return None
        now = self._clock()  # (one silent already has been taken from, or is covered by a live request)
        due = [d for p in self._live_others(peer) if (d := self._since[p] + patience - now) > 0
               and any(peer in self._holders(i) for i in self.pending(p))]
        return min(due) if due else None

    def pending(self, peer: str) -> list[int]:
        """The chunks `peer`'s request still owes (asked of it, not yet arrived from anyone)."""
        return [i for i in self._asked.get(peer, ()) if i not in self._arrived]

    # -- what happened ------------------------------------------------------------------------

    def arrived(self, i: int, peer: str | None = None) -> bool:
        """Chunk i came in (from `peer`); False if it had already (a duplicate, to be dropped)."""
        if peer is not None and peer in self._since:
            self._since[peer] = self._clock()  # moving, duplicate or not
        if i in self._arrived:
            return False
        self._arrived.add(i)
        if peer is not None:
            self._sent[peer] = self._sent.get(peer, 0) + 1
        return True

    def retry(self, peer: str, i: int) -> None:
        """`peer` answered chunk i in a way not to be used (TEXT, where another holder has its
        KV): it no longer counts as asked for i, and i goes to whoever takes it (the caller has
        taken `peer` off i's holders)."""
        if peer in self._asked:
            self._asked[peer] = [j for j in self._asked[peer] if j != i]
        others = {j for p in self._asked if p not in self.failed for j in self.pending(p)}
        if i not in self._arrived and i not in others:
            self._todo = sorted(set(self._todo) | {i})

    def redundant(self, peer: str) -> bool:
        """Everything `peer`'s request still has to send has arrived from others: cancel it."""
        return bool(self._asked.get(peer)) and not self.pending(peer)

    def give_back(self, peer: str) -> None:
        """`peer`'s request ended short (it no longer holds a chunk, or was cancelled): what it
        did not send, and no other peer is asked for, goes to whoever takes it."""
        unsent = self.pending(peer)
        self._asked.pop(peer, None)
        others = {i for p in self._asked if p not in self.failed for i in self.pending(p)}
        self._todo = sorted(set(self._todo) | {i for i in unsent if i not in others})

    def fail(self, peer: str) -> None:
        """`peer` is not asked again in this fetch; its outstanding chunks go back."""
        self.failed.add(peer)
        untaken = self._first.pop(peer, [])
        self.give_back(peer)
        self._todo = sorted(set(self._todo) | {i for i in untaken if i not in self._arrived})

    def missing(self) -> list[int]:
        """Chunks not arrived."""
        return [i for i in self.chunks if i not in self._arrived]

    def done(self) -> bool:
        return len(self._arrived) >= len(self.chunks)

    def waiting(self) -> bool:
        """Some chunk not arrived could still come: a request is out for it, or a live holder
        could take it."""
        if any(self.pending(p) for p in self._asked if p not in self.failed):
            return True
        live = [p for p in self.sources if p not in self.failed]
        later = self._todo + [i for share in self._first.values() for i in share]
        return any(p in self._holders(i) for i in later if i not in self._arrived for p in live)
