"""The codec by names: a level by its name (levels), a chunk's profile by the id it names
(registry). What `codec.encode(kv, "balanced", profile)` and `codec.decode(data)` are: each
turns the names into the values the method takes (a steps.Coding, a Profile) and calls it."""
from __future__ import annotations

import numpy as np
import torch

from .. import bitstream as bs, cachegen, decoder
from ..bitstream import Header
from ..profile import Profile
from ..steps import Coding
from . import levels, registry, token_steps


def coding(level: str | levels.Level, profile: Profile, scale: float | None = None,
           token_classes: np.ndarray | None = None) -> Coding:
    """How a chunk of `profile` at `level` is coded: the level's transforms, its streams' steps
    (the chunk's own `scale` on the profile's base steps, codec.tuning.rate, else the level's in
    the profile: Level.steps) and the tokens' classes where the level and profile take them
    (codec.tuning.token_steps); what each symbol's step then is: codec.steps."""
    lv = levels.get(level)
    classes = token_classes if token_classes is not None and token_steps.applies(lv, profile) else None
    return Coding(lv.code, lv.transforms, lv.steps(profile, scale), lv.anchor_step, classes)


def encode(kv: torch.Tensor, level: str | levels.Level = "balanced", profile: Profile | None = None,
           start: int = 0, scale: float | None = None, token_classes: np.ndarray | None = None) -> bytes:
    """Compress one chunk of KV [L, 2, T, H, D] (fp16, bf16 or fp32) whose first token sits at
    absolute position `start` (codec.cachegen.encode, whose docstring draws the pipeline);
    `scale`: the chunk's own step scale (codec.tuning.rate.scales), else the level's;
    `token_classes`: uint8 [L, T], its tokens' step classes (codec.tuning.token_steps), used
    where the profile and level take them. Pure CPU work that holds the GIL: never call it on
    an event loop."""
    cachegen.check(kv)
    lv = levels.get(level)
    if profile is None:
        raise ValueError("encode needs the model's profile (codec.tuning.registry.for_model(model_id))")
    return cachegen.encode(kv, coding(lv, profile, scale, token_classes), profile, start)


def roundtrip(kv: torch.Tensor, level: str | levels.Level, profile: Profile, start: int = 0,
              scale: float | None = None, token_classes: np.ndarray | None = None) -> torch.Tensor:
    """What decode(encode(kv, level, profile, start, scale, token_classes)) gives, without the
    entropy coder either way (codec.cachegen.roundtrip); the anchor/delta levels are refused."""
    lv = levels.get(level)
    if lv.transforms & bs.DELTA:
        raise ValueError(f"roundtrip() takes the PCA levels, not {lv.name}")
    return cachegen.roundtrip(kv, coding(lv, profile, scale, token_classes), profile, start)


def read(data: bytes | memoryview, profile: Profile | None = None, check_crc: bool = True) -> tuple[Header, Profile]:
    """A bitstream validated, and its profile: the one given, or the registry's of the id it
    names (codec.decoder.read)."""
    return decoder.read(data, profile, check_crc, registry.find)


def decode(data: bytes | memoryview, profile: Profile | None = None) -> torch.Tensor:
    """Decompress one chunk on the CPU to [L, 2, T, H, D] in the dtype it was encoded from; its
    profile: the one given, or the registry's of the id it names.

    Raises CodecError for damaged, truncated, foreign or mismatched input."""
    return decoder.decode(data, profile, registry.find)


def warm(dec: decoder.Decoder, level: str | levels.Level, streams: range | None = None) -> None:
    """Build what `dec` needs to decode chunks at `level` ahead of the first one (Decoder.warm):
    at the level's steps, and each token class's the profile's rule may give."""
    dec.warm(coding(level, dec.profile), streams, token_steps.rule_classes(level, dec.profile))
