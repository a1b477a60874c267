"""Where each chunk of a prompt will come from: one lookup of its key chain, in the local store
and in the directory (the peers that advertised its chunks), before a fetch or a lookup runs."""
from __future__ import annotations

from dataclasses import dataclass

from kvstreamd.cluster.directory import Directory, Holders
from kvstreamd.store.keys import chunk_bounds, chunk_keys, prefix_keys
from kvstreamd.store.store import Store


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
