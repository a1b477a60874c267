"""Quality levels. A level is a set of transforms plus a scale on the profile's step table;
the bitstream records the transforms and the steps themselves, so levels can be retuned
without breaking chunks already stored."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import bitstream as bs
from .profile import Profile


@dataclass(frozen=True)
class Level:
    name: str
    code: int
    transforms: int
    scale: float = 1.0  # multiplies the profile's sensitivity-set steps (PCA levels)
    thirds: tuple[float, float, float] | None = None  # CacheGen: step/sigma per third of layers
    anchor_step: float = 1.0 / 32  # CacheGen: anchor step / sigma, about 8-bit anchors

    def steps(self, profile: Profile) -> np.ndarray:
        """[L, 2] float32: the quantization step of each (layer, K/V) stream."""
        if self.thirds is None:
            # A profile tuned on calibration text carries its own scale for each named level.
            scale = profile.meta.get("level_scales", {}).get(self.name, self.scale)
            return (profile.base_step * scale).astype(np.float32)
        L = profile.layers
        per_layer = np.array([self.thirds[min(3 * i // L, 2)] for i in range(L)], np.float32)
        return np.repeat(per_layer[:, None], 2, axis=1)


OURS = bs.UNROTATE_KEYS | bs.PCA | bs.SINK | bs.RANS

# A calibrated profile carries its own scale per level (tuned on valid.txt by `kvstreamd profile
# calibrate`, never on test.txt) and that wins; these scales serve a profile without that table.
LEVELS: dict[str, Level] = {
    "high": Level("high", 1, OURS, scale=1.0),
    "balanced": Level("balanced", 2, OURS, scale=1.8),
    "fast": Level("fast", 3, OURS, scale=3.6),
    # CacheGen as the paper has it: anchor/delta, per-channel steps, fixed thirds of layers.
    "cachegen-paper": Level("cachegen-paper", 4, bs.DELTA, thirds=(0.5, 1.0, 1.5)),
    "cachegen-paper-high": Level("cachegen-paper-high", 5, bs.DELTA, thirds=(0.3, 0.8, 1.2)),
    "cachegen-paper-fast": Level("cachegen-paper-fast", 6, bs.DELTA, thirds=(0.8, 1.5, 2.0)),
}
LADDER = ("high", "balanced", "fast")  # the levels every chunk is stored at, best first


def get(level: str | Level) -> Level:
    if isinstance(level, Level):
        return level
    try:
        return LEVELS[level]
    except KeyError:
        raise ValueError(f"unknown level {level!r}; known: {', '.join(LEVELS)}") from None
