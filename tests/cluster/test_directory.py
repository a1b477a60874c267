"""The built-in directory's bookkeeping of who holds which chunk at which levels
(kvstreamd/cluster/directory.py), and the ADVERTISEs a node sends of what it holds (kvstreamd/cluster/peers.py)."""
from __future__ import annotations

import pytest

from kvstreamd.cluster.directory import PeerDirectory
from kvstreamd.cluster.directory import ADVERTISE_BATCH, advertisements

K = [bytes([i]) * 32 for i in range(4)]
ALL = frozenset({"high", "balanced", "fast"})


def test_a_lookup_says_the_levels_each_holder_advertised_and_none_where_it_said_none():
    d = PeerDirectory()
    d.add("full", K[:2], ["high", "balanced", "fast"])
    d.add("kept", K[:2], ["fast"])
    d.add("old", K[:2])  # a peer from before levels were said
    held = d.lookup_now(K[:2])
    assert held.levels_of("full", 1) == ALL and held.levels_of("kept", 0) == {"fast"}
    assert held.levels_of("old", 0) is None
    assert held.want(["high"]).holders(0) == ["full", "old"]
    assert held.want(None).holders(0) == ["full", "kept", "old"]


def test_a_key_advertised_again_takes_the_levels_said_last_and_withdraw_forgets_them():
    d = PeerDirectory(max_keys_per_peer=2)
    d.add("p", K[:2], ["fast"])
    assert d.add("p", K[:3], ["high", "fast"]) == 1  # the third is over the cap; the two are updated
    assert d.lookup_now(K[:2]).levels_of("p", 1) == {"high", "fast"}
    d.remove("p", K[:1])
    assert d.lookup_now(K[:2], chain=False).of(0) == set() and d.counts() == {"p": 1}


def test_a_want_leaves_out_a_chain_held_only_at_other_levels():
    d = PeerDirectory()
    d.add("p", K[:3], ["fast"])
    d.add("q", K[:1], ["high"])
    held = d.lookup_now(K[:3]).want(["high", "balanced"])
    assert held.longest_prefix(0) == {"q": 1}


def test_a_node_advertises_one_message_per_set_of_levels_held():
    held = {K[0]: ALL, K[1]: frozenset({"fast"}), K[2]: ALL}
    msgs = advertisements(held)
    assert sorted((m.levels, m.keys) for m in msgs) == [
        (["balanced", "fast", "high"], [K[0], K[2]]), (["fast"], [K[1]])]
    many = advertisements({bytes(32 - 4) + i.to_bytes(4, "big"): ALL for i in range(ADVERTISE_BATCH + 1)})
    assert [len(m.keys) for m in many] == [ADVERTISE_BATCH, 1]


def test_a_bad_directory_section_is_a_config_error(tmp_path):
    from kvstreamd import config

    bad = tmp_path / "c.toml"
    bad.write_text('[directory]\nbackend = "etcd"\n')
    with pytest.raises(config.ConfigError, match=r"\[directory\] backend"):
        config.load(bad)
    bad.write_text('[directory]\nbackend = "redis"\nurl = "localhost:6379"\n[peer]\nsecret = "0123456789abcdef0"\n')
    with pytest.raises(config.ConfigError, match="not a Redis URL"):
        config.load(bad)
    bad.write_text('[directory]\nbackend = "redis"\n')
    with pytest.raises(config.ConfigError, match="no secret"):
        config.load(bad)
