"""The split of one fetch's chunks among the peers holding them (kvstreamd/cluster/shares.py): pure
bookkeeping, driven here by hand and by random runs of arrivals and failures."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvstreamd.cluster.shares import PATIENCE, Shares, level_tier, needed_level
from tests.fixtures import Clock

LADDER = ["high", "balanced", "fast"]


def everyone(*peers):
    return lambda i: list(peers)


def test_shares_follow_the_measured_links_and_interleave():
    rates = {"a": 2.0, "b": 1.0, "c": 1.0}
    s = Shares(range(8), everyone("a", "b", "c"), rates.get)
    a, b, c = s.take("a"), s.take("b"), s.take("c")
    assert sorted(a + b + c) == list(range(8))
    assert len(a) == 4 and len(b) == 2 and len(c) == 2  # twice the link, twice the share
    assert {a[0], b[0], c[0]} <= {0, 1, 2, 3}  # every source starts at once, near the front


def test_an_unmeasured_link_counts_as_the_median_and_chunks_held_by_one_go_to_it():
    held = {0: ["a", "b"], 1: ["a", "b"], 2: ["b"], 3: ["a", "b"]}
    s = Shares(range(4), held.__getitem__, {"a": 5.0}.get)
    assert 2 in s.take("b") and 2 not in s.take("a")


def test_a_failed_peers_outstanding_chunks_go_to_the_others():
    s = Shares(range(6), everyone("a", "b"), lambda p: 1.0)
    a, b = s.take("a"), s.take("b")
    assert s.arrived(a[0])
    s.fail("a")
    assert s.take("a") == []
    assert s.waiting()
    for i in b:
        s.arrived(i)
    assert s.take("b") == a[1:]  # what a did not send
    for i in a[1:]:
        s.arrived(i)
    assert s.done() and not s.waiting()


def test_a_peer_with_nothing_left_takes_the_second_half_of_the_slowest_and_duplicates_are_dropped():
    s = Shares(range(8), everyone("a", "b"), lambda p: 1.0)
    a, b = s.take("a"), s.take("b")
    for i in b:
        s.arrived(i)
    s.arrived(a[0])
    stolen = s.take("b")
    assert stolen == a[-(len(a) - 1) // 2:] and stolen
    for i in stolen:
        assert s.arrived(i)
    assert not s.redundant("a")
    for i in a[1:]:
        if i not in stolen:
            s.arrived(i)
    assert s.redundant("a")  # all a still had to send came from b: a's request can be cancelled
    assert not s.arrived(stolen[0])  # a's copy, had it come, is a duplicate
    assert s.done()


def test_holders_in_this_nodes_zone_send_what_they_hold_and_the_others_only_the_rest():
    held = {0: ["core", "edge"], 1: ["core", "edge"], 2: ["core"]}
    s = Shares(range(3), held.__getitem__, {"core": 10.0, "edge": 1.0}.get, near=lambda p: p == "edge")
    assert s.sources == ["edge", "core"]
    assert s.take("edge") == [0, 1] and s.take("core") == [2]  # a far, faster link only for chunk 2


def test_a_chunk_nobody_holds_leaves_nothing_to_wait_for():
    held = {0: ["a"], 1: []}
    s = Shares(range(2), held.__getitem__, lambda p: 1.0)
    assert s.take("a") == [0]
    s.arrived(0)
    assert s.missing() == [1] and not s.waiting()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 24), st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=80))
def test_every_chunk_arrives_once_while_one_live_holder_remains(n, steps):
    """Random runs: peers take, chunks arrive from the peers asked for them, peers 1-3 may fail;
    peer 0 never does. Every chunk arrives exactly once (duplicates refused) and nothing waits
    forever."""
    peers = ["p0", "p1", "p2", "p3"]
    s = Shares(range(n), everyone(*peers), lambda p: 1.0 + peers.index(p))
    asked = {p: s.take(p) for p in peers}
    used = []

    def step(p: str) -> None:  # p's next chunk arrives, or p asks for more
        if asked[p]:
            i = asked[p].pop(0)
            if s.arrived(i):
                used.append(i)
        else:
            asked[p] = s.take(p)

    for who, fail in steps:
        if fail and who:
            s.fail(peers[who])
            asked[peers[who]] = []
        else:
            step(peers[who])
    for _ in range(4 * n + 8):  # then p0 (and whoever is left) runs to the end
        for p in peers:
            step(p)
    assert sorted(used) == list(range(n)) and s.done() and not s.waiting()


def test_the_level_a_deadline_needs_is_the_best_whose_nominal_bytes_cross_in_time():
    mb = 1e6
    # 100 MB of fp16 KV: at 5.42x high is 18.5 MB, balanced 15.0 MB, fast 10.3 MB
    assert needed_level(LADDER, 100 * mb, 12.5 * mb, 2.0) == "high"  # 100 Mbit/s, 2 s: 20 MB of room
    assert needed_level(LADDER, 100 * mb, 12.5 * mb, 1.2) == "fast"  # 12 MB of room
    assert needed_level(LADDER, 100 * mb, 1.0 * mb, 1.0) == "fast"  # nothing fits: the cheapest
    assert needed_level(LADDER, 100 * mb, None, 1.0) == "high"  # no link measured: the best


def test_a_holder_is_tiered_by_the_levels_it_holds_against_the_one_needed():
    assert level_tier(frozenset(LADDER), "balanced", LADDER) == 0
    assert level_tier(None, "balanced", LADDER) == 0  # not said: may hold it
    assert level_tier(frozenset({"fast"}), "balanced", LADDER) == 1  # on time, lower quality
    assert level_tier(frozenset({"high"}), "balanced", LADDER) == 2  # more bytes than the deadline allows


def test_holders_with_the_needed_level_send_it_before_faster_holders_without_it():
    tiers = {"full": 0, "fast-only": 2}
    s = Shares(range(4), everyone("full", "fast-only"), {"full": 1.0, "fast-only": 10.0}.get,
               tier=lambda p, i: tiers[p])
    assert s.sources == ["full", "fast-only"]
    assert s.take("full") == [0, 1, 2, 3] and s.take("fast-only") == []


def test_a_chunk_only_a_lesser_holder_has_still_goes_to_it():
    held = {0: ["full", "lesser"], 1: ["lesser"]}
    s = Shares(range(2), held.__getitem__, lambda p: 1.0, tier=lambda p, i: 0 if p == "full" else 1)
    assert s.take("full") == [0] and s.take("lesser") == [1]


# -- holders that go silent, or answer what they should not (issue 26) ---------------------------

def test_an_idle_holder_takes_the_chunks_of_a_holder_that_delivered_nothing_its_last_one_too():
    """"a" never sends (a ghost, or a peer that only PINGs); "b" and "c" sent theirs in 0.1 s:
    once "a" has been silent for PATIENCE x that, "b" takes its chunk, though it is a's last and
    a's (unmeasured) rate ties b's; "c" does not ask for it too while b's request is live."""
    clock = Clock(100.0)
    s = Shares(range(3), everyone("a", "b", "c"), lambda p: 1.0, clock=clock)
    a, b, c = s.take("a"), s.take("b"), s.take("c")
    assert (a, b, c) == ([0], [1], [2])
    clock.now += 0.1
    assert s.arrived(1, "b") and s.arrived(2, "c")
    assert s.take("b") == [] and s.waiting()  # not yet silent: 0.1 s < PATIENCE x 0.1 s
    assert abs(s.recheck_in("b") - (PATIENCE * 0.1 - 0.1)) < 1e-9
    clock.now += s.recheck_in("b")
    assert s.take("b") == [0]
    assert s.take("c") == [] and s.recheck_in("c") is not None  # c looks again should b go silent too
    assert s.arrived(0, "b") and s.done()


def test_a_chunk_answered_in_a_way_not_to_be_used_goes_to_another_holder():
    held = {i: ["a", "b"] for i in range(4)}
    s2 = Shares(range(4), lambda i: held[i], lambda p: 1.0)
    a, b = s2.take("a"), s2.take("b")
    held[a[0]].remove("a")  # "a" answered a[0] as TEXT: the caller takes it off a[0]'s holders
    s2.retry("a", a[0])
    for i in b:
        s2.arrived(i, "b")
    assert s2.take("b") == [a[0]]  # asked of b, while a's request goes on for the rest
    for i in a[1:]:
        s2.arrived(i, "a")
    assert not s2.done() and s2.waiting()
    s2.arrived(a[0], "b")
    assert s2.done() and not s2.waiting()
