"""The chunk-key contract: how a context (model id, token ids) becomes chunk keys. Every node
must compute exactly these bytes, or peers stop finding each other's chunks.

A context is cut into chunks of `chunk_tokens` tokens (the last one may be shorter). Chunk i's
key chains chunk i-1's, so equal keys mean equal prefixes and nothing ever compares token lists:

    key_i = blake2b(key_{i-1} || u32le(len(m)) || m || u32le(t_0) || u32le(t_1) || ...,
                    digest_size=32)

key_{-1} is empty (b""), m is the model id encoded as UTF-8, u32le is a 4-byte little-endian
unsigned integer and t_0, t_1, ... are chunk i's token ids, each in [0, 2**32). The hash input
carries no chunk length: the token bytes run to its end. tests/store/test_keys.py pins known values.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

KEY_BYTES = 32
_U32 = struct.Struct("<I")


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """The token ids as u32le, the form they take in a key (and in a chunk file's header)."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None


def _start(parent: bytes | None, model_id: str):
    m = model_id.encode("utf-8")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent or b"")
    h.update(_U32.pack(len(m)))
    h.update(m)
    return h


def chunk_key(parent: bytes | None, model_id: str, tokens: Sequence[int]) -> bytes:
    """The key of one chunk given its parent's key (None for chunk 0)."""
    h = _start(parent, model_id)
    h.update(tokens_bytes(tokens))
    return h.digest()


def prefix_keys(parent: bytes | None, model_id: str, tokens: Sequence[int]) -> list[bytes]:
    """chunk_key(parent, model_id, tokens[:k]) for k = 1..len(tokens), hashed incrementally: the
    keys a stored context's last, partial chunk could have when a longer prompt runs past it."""
    h = _start(parent, model_id)
    data = tokens_bytes(tokens)
    out = []
    for i in range(0, len(data), 4):
        h.update(data[i:i + 4])
        out.append(h.copy().digest())
    return out


def chunk_bounds(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """The token range [start, end) of each chunk of a context of n_tokens: chunk i holds
    tokens[i*chunk_tokens:(i+1)*chunk_tokens], the last one what is left."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def chunk_keys(model_id: str, tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    """Keys of the chunks of a context, one per chunk_bounds(). An empty token list gives no keys."""
    keys: list[bytes] = []
    parent: bytes | None = None
    for s, e in chunk_bounds(len(tokens), chunk_tokens):
        parent = chunk_key(parent, model_id, tokens[s:e])
        keys.append(parent)
    return keys


def chunk_ranges(idx: list[int]) -> str:
    """Chunk indices as messages name them: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
