"""What a serving engine loads and saves of a request: whole chunks that are whole blocks, never
the prompt's last token, nothing it has already; and the blocks a token range lives in."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstreamd.engines.plan import blocks_of, tokens_to_load, tokens_to_save

prop = settings(max_examples=300, deadline=None)
chunks = st.integers(256, 4096)  # the daemon's [store] chunk_tokens range
block_sizes = st.sampled_from([1, 8, 16, 32, 64, 128])


def test_a_prompt_loads_its_held_whole_chunks_short_of_its_last_token():
    assert tokens_to_load(3000, 3000, 1024, 16, 0) == 2048
    assert tokens_to_load(3000, 1500, 1024, 16, 0) == 1024
    # held to the end, and the prompt exactly whole chunks: the last chunk holds the last token
    assert tokens_to_load(2048, 2048, 1024, 16, 0) == 1024
    assert tokens_to_load(2049, 2048, 1024, 16, 0) == 2048


def test_a_prompt_no_longer_than_a_chunk_loads_nothing():
    assert tokens_to_load(1024, 1024, 1024, 16, 0) == 0
    assert tokens_to_load(500, 4096, 1024, 16, 0) == 0


def test_tokens_the_engine_computed_already_are_not_loaded():
    assert tokens_to_load(3000, 3000, 1024, 16, 1024) == 1024  # the second chunk only
    assert tokens_to_load(3000, 3000, 1024, 16, 2048) == 0
    assert tokens_to_load(3000, 3000, 1024, 16, 2900) == 0  # its own prefix cache covers more


def test_a_chunk_that_ends_inside_a_block_is_not_loaded():
    # chunk_tokens 1000 with blocks of 16: only every second chunk ends on a block's end
    assert tokens_to_load(5000, 5000, 1000, 16, 0) == 4000
    assert tokens_to_load(5000, 1999, 1000, 16, 0) == 0


@prop
@given(prompt=st.integers(1, 20000), held=st.integers(0, 20000), chunk=chunks, block=block_sizes,
       computed=st.integers(0, 20000))
def test_a_load_is_whole_chunks_and_whole_blocks_of_what_is_held_short_of_the_last_token(
        prompt, held, chunk, block, computed):
    n = tokens_to_load(prompt, held, chunk, block, computed)
    assert n >= 0
    if n:
        end = computed + n
        assert end % chunk == 0 and end % block == 0
        assert end < prompt and end <= held
    # the longest such prefix: a further chunk would not be a whole block or not be held
    alone = tokens_to_load(prompt, held, chunk, block, 0)
    assert n == max(alone - computed, 0)
    for more in range(alone + chunk, min(held, prompt - 1) + 1, chunk):
        assert more % block != 0


def test_a_prompt_saves_its_whole_chunks():
    assert tokens_to_save(3000, 1024, 0) == 2048
    assert tokens_to_save(2048, 1024, 0) == 2048
    assert tokens_to_save(1000, 1024, 0) == 0


def test_a_prompt_the_local_daemon_holds_already_is_not_saved():
    assert tokens_to_save(3000, 1024, 2048) == 0
    assert tokens_to_save(3000, 1024, 3000) == 0
    assert tokens_to_save(3000, 1024, 1024) == 2048  # it holds less: the whole chunks go


@prop
@given(prompt=st.integers(0, 20000), chunk=chunks, held=st.integers(0, 20000))
def test_a_save_is_all_whole_chunks_when_they_are_more_than_is_held(prompt, chunk, held):
    n = tokens_to_save(prompt, chunk, held)
    whole = prompt // chunk * chunk  # the prompt's whole chunks: all of them or none are put
    assert n == (whole if whole > held else 0)


def test_the_blocks_of_a_token_range():
    assert list(blocks_of(0, 16, 16)) == [0]
    assert list(blocks_of(0, 17, 16)) == [0, 1]
    assert list(blocks_of(16, 48, 16)) == [1, 2]
    assert list(blocks_of(20, 40, 16)) == [1, 2]


@prop
@given(start=st.integers(0, 5000), length=st.integers(1, 5000), block=block_sizes)
def test_the_blocks_of_a_range_hold_every_token_of_it_and_no_other_block(start, length, block):
    end = start + length
    got = blocks_of(start, end, block)
    assert set(got) == {t // block for t in range(start, end)}
