"""Which step quantized a symbol: a chunk's coding (`Coding`) and each stream's symbol steps
(`stream_steps`), the one place the factors meet.

A symbol of stream (layer, K/V) at a PCA level is quantized at

    steps[layer, k_or_v]          the stream's step, in the chunk's header: the profile's base
                                  step (its sensitivity at its KL budget, codec.profile) times a
                                  scale -- the chunk's own (rate control, codec.tuning.rate) or its
                                  level's in the profile (codec.tuning.levels.Level.steps)
  x pca_step_scale[layer, k_or_v, c]   its PCA component's (Profile.component_steps)
  x 2 ** (class / 2)              its token's class (classes chosen by codec.tuning.token_steps,
                                  carried in the header: bitstream.TOKEN_STEPS)

and at CacheGen's anchor/delta levels each channel's anchors at anchor_step x its anchors'
sigma, its deltas at the stream's step x its deltas' sigma. Tuning chooses the stream steps and
the classes (codec.tuning.named.coding); the header carries them, so a decoder needs none of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import bitstream as bs
from .errors import CodecError
from .profile import Profile


@dataclass(frozen=True)
class Coding:
    """What one chunk is coded with, as its header records it: a value tuning makes
    (codec.tuning.named.coding) and the method takes."""

    level: int  # the level's code in the bitstream
    transforms: int  # bitstream transform flags (bitstream.PCA, RANS, DELTA, ...)
    steps: np.ndarray  # [L, 2] float32: each (layer, K/V) stream's step
    anchor_step: float  # anchor/delta levels: the anchors' step, in their standard deviations
    token_classes: np.ndarray | None = None  # uint8 [L, T]: each token's step class; None: all 0


class StreamSteps(NamedTuple):
    """The steps of one stream's symbols."""

    symbols: torch.Tensor  # [n, C] with token classes, [C] per component or channel, [] one step
    anchors: torch.Tensor | None = None  # anchor/delta levels: each channel's anchor step [C]


def stream_steps(profile: Profile, transforms: int, layer: int, k_or_v: int, step: float,
                 anchor_step: float, classes: np.ndarray | None = None) -> StreamSteps:
    """The step of every symbol of stream (layer, K/V) whose header step is `step` (module
    docstring); `classes`: the token classes of its rows after the sink, where it has them."""
    if transforms & bs.DELTA:
        sigma = profile.tensors
        return StreamSteps(torch.from_numpy(sigma["delta_sigma"][layer, k_or_v]) * step,
                           torch.from_numpy(sigma["anchor_sigma"][layer, k_or_v]) * anchor_step)
    if transforms & bs.PCA:
        steps = profile.component_steps(layer, k_or_v, step)
        if classes is not None:
            steps = steps[None] * torch.from_numpy(multipliers(classes))[:, None]
        return StreamSteps(steps)
    return StreamSteps(torch.tensor(step))


def multipliers(token_classes: np.ndarray) -> np.ndarray:
    """Classes (uint8, any shape) -> each token's step multiplier (float32): 2 ** (class / 2)."""
    return np.exp2(np.asarray(token_classes, np.float32) / 2).astype(np.float32)


def class_step(step: float, token_class: int) -> float:
    """The step of a stream's tokens of class `token_class`, whose stream step is `step`: what
    their entropy models are built for, on both sides."""
    return step * 2.0 ** (token_class / 2)


def check_classes(token_classes: np.ndarray, layers: int, tokens: int) -> np.ndarray:
    """Classes a caller gives for a chunk or a context, validated: uint8 [layers, tokens], each
    at most TOP_CLASS. CodecError naming what is wrong."""
    c = np.asarray(token_classes)
    if c.dtype != np.uint8 or c.shape != (layers, tokens):
        raise CodecError(f"token classes must be uint8 [{layers}, {tokens}], got {c.dtype} {list(c.shape)}")
    if c.size and int(c.max()) > bs.TOP_CLASS:
        raise CodecError(f"token class {int(c.max())} is above the top class {bs.TOP_CLASS}")
    return c
