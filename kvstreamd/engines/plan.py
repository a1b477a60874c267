"""Which tokens of a request a serving engine loads from kvstreamd and which it saves, in whole
chunks: the engine holds a loaded prefix and then computes, never a hole in the middle, and it
computes the prompt's last token itself (its logits give the first new token)."""
from __future__ import annotations

import math


def tokens_to_load(prompt_tokens: int, held: int, chunk_tokens: int, block_size: int, computed: int) -> int:
    """Tokens past the `computed` ones to load, when the cluster holds the prompt's first `held`
    tokens: whole chunks that are whole blocks too, short of the last prompt token; 0 when
    that is no more than the engine has already."""
    n = min(held, prompt_tokens - 1)
    n -= n % math.lcm(chunk_tokens, block_size)  # a chunk cut to a block's end is not a whole chunk
    return max(n - computed, 0)


def tokens_to_save(prompt_tokens: int, chunk_tokens: int, held_locally: int) -> int:
    """The prompt's whole chunks, to put once its prefill is done; 0 when the local daemon holds
    them already (a prefix it holds is not put again)."""
    n = prompt_tokens - prompt_tokens % chunk_tokens
    return n if n > held_locally else 0


def blocks_of(token_start: int, token_end: int, block_size: int) -> range:
    """Indices, in a request's block list, of the blocks holding tokens [token_start, token_end)."""
    return range(token_start // block_size, -(-token_end // block_size))
