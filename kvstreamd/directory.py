"""Which peer holds which chunk keys, fed by each peer's ADVERTISE (a full list on connect,
then deltas) and WITHDRAW. A lookup answers, per peer, how many leading chunks of a prompt's
key chain that peer holds; a peer that stalled a fetch is left out of lookups while it cools down."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence


class Directory:
    def __init__(self, max_keys_per_peer: int | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_keys_per_peer = max_keys_per_peer  # None: no cap
        self._held: dict[str, set[bytes]] = {}
        self._clock = clock
        self._cool_until: dict[str, float] = {}  # peer -> clock() until which lookups skip it
        self._stalls: dict[str, int] = {}  # peer -> stalls in a row (a fetch it completes resets it)

    def add(self, peer: str, keys: Iterable[bytes]) -> int:
        """Keep `keys` as held by `peer`, up to max_keys_per_peer of them; returns how many
        new keys were refused for the cap (0 when all were kept)."""
        held = self._held.setdefault(peer, set())
        cap = self.max_keys_per_peer
        if cap is None:
            held.update(keys)
            return 0
        refused = 0
        for key in keys:
            if key in held:
                continue
            if len(held) >= cap:
                refused += 1
            else:
                held.add(key)
        return refused

    def remove(self, peer: str, keys: Iterable[bytes]) -> None:
        held = self._held.get(peer)
        if held is not None:
            held.difference_update(keys)

    def drop(self, peer: str) -> None:
        """Forget everything `peer` said (its last connection closed), and that it stalled: a
        peer that connects again has proved it is there."""
        self._held.pop(peer, None)
        self._cool_until.pop(peer, None)
        self._stalls.pop(peer, None)

    # -- peers that stalled a fetch ------------------------------------------------------------

    def stalled(self, peer: str, first_s: float, max_s: float) -> float:
        """`peer` stopped answering a fetch: lookups skip it for a cooldown of `first_s`,
        doubled for each stall in a row before it, at most `max_s`. Its keys are kept, so it
        is found again once the cooldown is over. Returns the cooldown in seconds."""
        n = self._stalls[peer] = self._stalls.get(peer, 0) + 1
        cooldown = min(first_s * 2 ** (n - 1), max_s)
        self._cool_until[peer] = self._clock() + cooldown
        return cooldown

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
            return None
        return left

    # -- lookups (peers cooling down are left out) ---------------------------------------------

    def _available(self) -> Iterable[tuple[str, set[bytes]]]:
        return ((peer, held) for peer, held in self._held.items() if self.cooling(peer) is None)

    def holds(self, peer: str, key: bytes) -> bool:
        return key in self._held.get(peer, ())

    def longest_prefix(self, keys: Sequence[bytes], start: int = 0) -> dict[str, int]:
        """Per peer: the index one past the last chunk of the unbroken run keys[start:] it holds
        (start itself when it holds keys[start] not at all). Peers holding nothing there, or
        cooling down after a stall, are left out."""
        out = {}
        for peer, held in list(self._available()):
            n = start
            while n < len(keys) and keys[n] in held:
                n += 1
            if n > start:
                out[peer] = n
        return out

    def best(self, keys: Sequence[bytes], start: int = 0, exclude: Iterable[str] = ()) -> tuple[str | None, int]:
        """The peer holding the longest run of keys from `start` (ties: the lowest node id, so
        every caller picks alike), and where its run ends; (None, start) when none holds keys[start]."""
        skip = set(exclude)
        runs = sorted((-n, peer) for peer, n in self.longest_prefix(keys, start).items() if peer not in skip)
        return (runs[0][1], -runs[0][0]) if runs else (None, start)

    def holders(self, key: bytes) -> list[str]:
        return sorted(peer for peer, held in list(self._available()) if key in held)

    def counts(self) -> dict[str, int]:
        return {peer: len(keys) for peer, keys in self._held.items()}
