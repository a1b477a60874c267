"""Quality levels. A level is a set of transforms plus a scale on the profile's step table;
the bitstream records the transforms and the steps themselves, so levels can be retuned
without breaking chunks already stored."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import bitstream as bs
from ..profile import Profile
from .tuned import Tuning


@dataclass(frozen=True)
class Level:
    name: str
    code: int
    transforms: int
    scale: float = 1.0  # multiplies the profile's sensitivity-set steps (PCA levels)
    thirds: tuple[float, float, float] | None = None  # CacheGen: step/sigma per third of layers
    anchor_step: float = 1.0 / 32  # CacheGen: anchor step / sigma, about 8-bit anchors
    # The most a level may change what the model predicts, on held-out text of every kind: KL of
    # next-token distributions against the exact cache (docs/benchmarks.md, "Against the floors").
    # Calibration tunes each level's scale under it, and rate control (codec.tuning.rate) aims each chunk at it.
    kl_floor: float | None = None
    # A level defined on another: its scale is `scale` x that level's in the profile (tuned or
    # not), so it keeps its distance from it on every model; None: `scale` is its own.
    of: str | None = None

    def scale_in(self, profile: Profile) -> float:
        """The level's one scale for every chunk: a profile tuned on calibration text carries
        its own for each named level."""
        own = Tuning.of(profile).level_scales.get(self.name)
        if own is not None:
            return float(own)
        return self.scale * (LEVELS[self.of].scale_in(profile) if self.of else 1.0)

    def steps(self, profile: Profile, scale: float | None = None) -> np.ndarray:
        """[L, 2] float32: the quantization step of each (layer, K/V) stream; `scale`: this
        chunk's own multiple of the profile's base steps (codec.tuning.rate), else the level's."""
        if self.thirds is None:
            return (profile.base_step * (self.scale_in(profile) if scale is None else scale)).astype(np.float32)
        if scale is not None:
            raise ValueError(f"level {self.name} has fixed steps per third of layers: it takes no scale")
        L = profile.layers
        per_layer = np.array([self.thirds[min(3 * i // L, 2)] for i in range(L)], np.float32)
        return np.repeat(per_layer[:, None], 2, axis=1)


OURS = bs.UNROTATE_KEYS | bs.PCA | bs.SINK | bs.RANS

# A calibrated profile carries its own scale per level (tuned on valid.txt by `kvstreamd profile
# calibrate`, never on test.txt) and that wins; these scales serve a profile without that table.
LEVELS: dict[str, Level] = {
    "high": Level("high", 1, OURS, scale=1.0, kl_floor=0.002),
    "balanced": Level("balanced", 2, OURS, scale=1.8, kl_floor=0.005),
    "fast": Level("fast", 3, OURS, scale=3.6, kl_floor=0.02),
    # For an engine that must answer as if it had computed the context (the same greedy tokens,
    # near ties included): an eighth of `high`'s steps, 3 bits more per value. SmolLM2 on WikiText:
    # 2.73x (int8: 1.98x) at KL 0.00001 (int8: 0.00009, high: 0.00094); the 8 greedy tokens after
    # 4096-token documents changed in 1 of 40 (int8: 4, a quarter of high's steps: 4; high: 6 of
    # 10) (docs/benchmarks.md "`max`: the level that keeps the answer"). Stored where [codec] levels
    # names it; never tuned or rate-controlled: a fixed distance below `high`.
    "max": Level("max", 7, OURS, scale=0.125, of="high"),
    # CacheGen as the paper has it: anchor/delta, per-channel steps, fixed thirds of layers.
    "cachegen-paper": Level("cachegen-paper", 4, bs.DELTA, thirds=(0.5, 1.0, 1.5)),
    "cachegen-paper-high": Level("cachegen-paper-high", 5, bs.DELTA, thirds=(0.3, 0.8, 1.2)),
    "cachegen-paper-fast": Level("cachegen-paper-fast", 6, bs.DELTA, thirds=(0.8, 1.5, 2.0)),
}
LADDER = ("high", "balanced", "fast")  # the levels every chunk is stored at, best first; each tuned


def expected_dppl(profile: Profile) -> dict[str, float]:
    """Each level's expected Δppl % with `profile`: its own measurement (Tuning.level_dppl,
    kvstreamd.lab.calibrate.level_costs), and for a level defined on a measured one (Level.of),
    that one's scaled by the square of their steps' ratio -- KL, and so the expected Δppl, grows
    as the step squared (SmolLM2, `high` at 1, 1/2, 1/4, 1/8 of its steps: KL 0.00131, 0.00035,
    0.000075, 0.000023). What the sender's rule weighs a model's levels by (codec.tuning.catalog)."""
    own = dict(Tuning.of(profile).level_dppl)
    for lv in LEVELS.values():
        if lv.name not in own and lv.of in own:
            own[lv.name] = own[lv.of] * (lv.scale_in(profile) / LEVELS[lv.of].scale_in(profile)) ** 2
    return own


def get(level: str | Level) -> Level:
    if isinstance(level, Level):
        return level
    try:
        return LEVELS[level]
    except KeyError:
        raise ValueError(f"unknown level {level!r}; known: {', '.join(LEVELS)}") from None
