"""The chunk-key contract pinned to known values: every node must compute these exact bytes, so a
change here strands every stored chunk and splits the cluster."""
from __future__ import annotations

import pytest

from kvstreamd.store.keys import KEY_BYTES, chunk_bounds, chunk_key, chunk_keys, prefix_keys

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2**32 - 1]
GOLDEN = [
    "605cae431c8224a78f21929d6a98c40925fe9aaea09eabb7f5520a1d428f0e18",
    "91c33fefbff425f9736b70397ee32cb1a79bae4ccff47e10bdd8fbfedb54ba33",
    "6b63684027918432903f7c20633e5d956c817e0e07b1baa895d3a8d0bc7f8e66",
]


def test_chunk_keys_match_the_pinned_values():
    assert [k.hex() for k in chunk_keys(MODEL, TOKENS, 4)] == GOLDEN
    assert KEY_BYTES == 32


def test_chunk_key_chains_to_the_pinned_values():
    k0 = chunk_key(None, MODEL, TOKENS[:4])
    k1 = chunk_key(k0, MODEL, TOKENS[4:8])
    assert [k0.hex(), k1.hex(), chunk_key(k1, MODEL, TOKENS[8:]).hex()] == GOLDEN


def test_prefix_keys_match_the_pinned_values():
    parent = bytes.fromhex(GOLDEN[1])
    assert [k.hex() for k in prefix_keys(parent, MODEL, TOKENS[8:])] == [
        "3a7fa475798d622272bee6b4da476f00264bc587d856adc1268ec0cfabb1b128", GOLDEN[2]]


def test_a_non_ascii_model_id_is_hashed_as_utf8():
    assert chunk_keys("modèle-ü", [0], 4)[0].hex() == \
        "c12542db25e9c42644baf33f3612d9233855328a01b9a202c2b23e799a66db1e"


def test_chunk_bounds_cover_the_context_in_whole_chunks_and_one_partial_last():
    assert chunk_bounds(0, 4) == []
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(9, 4) == [(0, 4), (4, 8), (8, 9)]
    tokens = list(range(9))
    assert len(chunk_keys("m", tokens, 4)) == len(chunk_bounds(len(tokens), 4))
    with pytest.raises(ValueError):
        chunk_bounds(9, 0)
