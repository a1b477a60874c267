"""What a sender offers of the chunks it holds for one FETCH: each chunk's size at each level
asked, where a chunk held at some of those levels only goes at the nearest it holds (a node
that kept chunks it fetched holds each at the level it came as)."""
from __future__ import annotations

import logging
from typing import Callable

from codec.errors import CodecError
from codec.select import selected_size

log = logging.getLogger("kvstreamd.peers")


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


def coded_sizes(recs, cuts, levels, level_of) -> tuple[dict[str, list[int]], int]:
    """Each chunk's size at each level (that is, at the level it goes at when that one is
    chosen), for the chunks up to the first whose header does not read, and how many those are."""
    sizes = {lv: [] for lv in levels}
    for i, (r, cut) in enumerate(zip(recs, cuts)):
        try:
            row = {}
            for lv in levels:
                data = r.levels[level_of(i, lv)]
                row[lv] = len(data) if cut is None else selected_size(data, cut)
        except CodecError as e:
            log.warning("chunk %s: header does not read: %s", r.key.hex()[:16], e)
            return sizes, i
        for lv, n in row.items():
            sizes[lv].append(n)
    return sizes, len(recs)
