"""One store tier on its own: LRU by bytes under a budget, eviction that skips pins and the chunk
being put, and the byte count."""
from __future__ import annotations

import collections

import pytest

from kvstreamd.store.tier import Tier


def key(i: int) -> bytes:
    return bytes([i]) * 32


def filled(budget: int, sizes: list[int], on_evict=None) -> Tier:
    t = Tier("test", budget, on_evict=on_evict)
    for i, n in enumerate(sizes):
        t.add(key(i), n)
    return t


def test_evicts_least_recently_used_first_until_within_budget():
    dropped = []
    t = filled(100, [40, 40, 40, 40], on_evict=dropped.append)
    assert t.bytes == 160 and len(t) == 4
    assert t.evict({}) == [key(0), key(1)] == dropped
    assert t.bytes == 80 and list(t) == [key(2), key(3)]


def test_touch_makes_a_chunk_the_most_recently_used():
    t = filled(80, [40, 40, 40])
    t.touch(key(0))
    assert t.evict({}) == [key(1)]
    assert list(t) == [key(2), key(0)]


def test_eviction_counts_bytes_not_chunks():
    t = filled(100, [10, 90, 10, 10])
    assert t.evict({}) == [key(0), key(1)]
    assert t.bytes == 20


def test_within_budget_evicts_nothing():
    dropped = []
    t = filled(100, [50, 50], on_evict=dropped.append)
    assert t.evict({}) == [] and dropped == []


def test_pinned_chunks_and_the_protected_one_are_skipped():
    t = filled(120, [40, 40, 40, 40])
    pins = collections.Counter({key(0): 2, key(2): 0})  # a count of 0 is no pin
    assert t.evict(pins, protect=key(1)) == [key(2)]
    assert list(t) == [key(0), key(1), key(3)]
    t.budget = 80
    assert t.evict(pins, protect=key(3)) == [key(1)]


def test_a_tier_of_only_pinned_chunks_stays_over_budget():
    t = filled(10, [40, 40])
    assert t.evict({key(0): 1, key(1): 1}) == []
    assert t.bytes == 80 and len(t) == 2


def test_pop_drops_without_on_evict_and_reports_absence():
    dropped = []
    t = filled(100, [30, 20], on_evict=dropped.append)
    assert t.pop(key(0)) is True and t.pop(key(0)) is False
    assert t.bytes == 20 and key(0) not in t and key(1) in t and dropped == []


def test_records_and_sizes_are_kept_per_key():
    t = Tier("memory", 100)
    rec = object()
    t.add(key(1), 7, rec)
    t.add(key(2), 5)
    assert t.get(key(1)) is rec and t.get(key(2)) is None and t.get(key(3)) is None
    assert t.size(key(1)) == 7 and t.size(key(2)) == 5
    with pytest.raises(KeyError):
        t.add(key(1), 7, rec)
    assert t.bytes == 12


def test_a_lowered_budget_applies_at_the_next_evict():
    t = filled(100, [30, 30, 30])
    t.budget = 30
    assert t.evict({}) == [key(0), key(1)]
