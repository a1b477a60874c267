"""Per-token steps: each token's step multiplied by how little the model reads it.

One step per (layer, K/V) stream treats every token alike, but a layer's attention does not:
most of a context's tokens get a small share of the attention of the queries that come after
them, a few (the sink, a heading, the token a sentence turns on) most of it. The process that
holds the model weighs each token, per layer, by the squared attention probabilities it gets
from the queries the rate probes already read (kvstreamd.models.token_weight: the tokens right
after each chunk boundary and the context's last ones, summed over heads), and gives it a
class: its step is multiplied by

    m = clip((w / mean w) ** -power, 1, top),  rounded to a power of 2

the mean over the layer's tokens of the context. A token the probes read at the layer's mean
or more keeps the stream's step; one read 16 times less, twice it (power 1/4). Classes are
counted in half-octaves (a class c multiplies the step by 2 ** (c / 2): the bitstream takes
any), but the rule gives whole octaves only: each class a stream holds is a block of its own
to decode, and the seven of half-octave steps cost 16% of the decode's speed on Gemma-3 where
the four of octaves cost 4%, at 0.7% more bytes at equal steps (docs/benchmarks.md). Gemma-3-270M on
WikiText test, real rANS sizes: 0.68 of the bytes at equal continuation KL, no prefix KL worse
(docs/benchmarks.md, "Per-token steps").

The classes travel in the chunk (bitstream transform TOKEN_STEPS: uint8 [layers, tokens after
the sink], zlib'd), so a decoder needs nothing of this but the method's `codec.steps.multipliers`.
A profile turns it on (its Tuning's token_steps: power p, top t, which calibrate tunes its level
scales with); a chunk put without weights (the vLLM connector, an older client) codes every token at the stream's step.
Only the ladder's levels use it: `max` keeps every token at its fine step.
"""
from __future__ import annotations

import numpy as np

from ..bitstream import TOP_CLASS
from ..errors import CodecError
from ..profile import Profile
from .levels import LADDER, LEVELS, Level, get as get_level
from .tuned import DEFAULT_TOP, Tuning

# The weights come from the queries of the rate probes' layout at this spacing -- the 64 tokens
# after every PROBE_EVERY tokens and the context's last 64 (rate_probe.probe_rows(n, PROBE_EVERY))
# -- whatever the daemon's chunk size: calibrate tunes the level scales on weights so measured
# (its chunks are of 1024 tokens), and at 256-token chunks a quarter of the tokens would be
# probes, their neighbours all read, and a 16K Gemma-3 context 14% larger.
PROBE_EVERY = 1024
MIN_WEIGHT = 1e-12  # what a weight below it is taken as (a token no probe reads at all)


def power(profile: Profile) -> float | None:
    """The profile's power (its Tuning's token_steps), None where it codes every token alike."""
    ts = Tuning.of(profile).token_steps
    return None if ts is None else ts.power


def top(profile: Profile) -> float:
    """The coarsest multiplier the profile's rule gives (its Tuning's token_steps.top, within
    what the bitstream takes)."""
    ts = Tuning.of(profile).token_steps
    return min(DEFAULT_TOP if ts is None else ts.top, 2.0 ** (TOP_CLASS / 2))


def applies(level: str | Level, profile: Profile) -> bool:
    """Whether chunks of `profile` at `level` take per-token steps (given the weights): a level
    of the ladder, or one made from it under another name (calibrate's tuning trials)."""
    return power(profile) is not None and get_level(level).code in {LEVELS[name].code for name in LADDER}


def rule_classes(level: str | Level, profile: Profile) -> list[int]:
    """The classes `classes` may give chunks of `profile` at `level` ([0] where it gives none):
    the steps whose entropy tables a decoder builds ahead of the chunks (Decoder.warm)."""
    if not applies(level, profile):
        return [0]
    return list(range(0, int(2 * np.log2(top(profile))) + 1, 2))


def classes(weights: np.ndarray, profile: Profile) -> np.ndarray:
    """Per-(layer, token) weights [L, T] of a whole context -> classes uint8 [L, T] by the
    profile's power (module docstring)."""
    p = power(profile)
    if p is None:
        raise CodecError(f"profile {profile.id.hex()} takes no per-token steps")
    w = np.maximum(np.asarray(weights, np.float64), MIN_WEIGHT)
    if w.ndim != 2 or w.shape[0] != profile.layers or not np.all(np.isfinite(w)):
        raise CodecError(f"token weights must be finite [{profile.layers}, tokens], got {w.shape}")
    m = np.clip((w / w.mean(1, keepdims=True)) ** -p, 1.0, top(profile))
    return np.clip(2 * np.round(np.log2(m)), 0, TOP_CLASS).astype(np.uint8)


def classes_for(weights: np.ndarray | None, profile: Profile) -> np.ndarray | None:
    """classes(weights, profile) where the profile takes per-token steps and there are weights,
    else None (every token at its stream's step)."""
    return None if weights is None or power(profile) is None else classes(weights, profile)
