"""Per-chunk rate control: each chunk's steps from what its own coding costs the model.

The process that holds the model measures, for each chunk of a context it puts, what coding
that chunk alone at PROBE_SCALE (a multiple of the profile's base steps) costs
(kvstreamd.models.rate_probe), as KL of next-token distributions against the exact cache:
- `end`: on the context's last tokens, as a prompt that goes on after the whole context sees it;
- `last`: on the tokens right after the chunk, as a prompt that ends with this chunk sees it
  (a context is found by its prefix, so any chunk may end a later prompt).
Both are stored divided by PROBE_SCALE**2: a chunk's KL grows as the square of its step scale
(measured on SmolLM2, scales 1.6 to 4.5: exponent 2.0 to 2.5), so one probe prices every scale.

Each level then gives each chunk the coarsest scale s_c its target allows:

    maximise  sum(log s_c)  (fewest bits: a chunk's bits fall by log2 of its scale per element)
    subject to  sum(end_c * s_c**2) <= target      the whole context, seen from its end
                last_c * s_c**2 <= target          a prompt that ends right after chunk c
                lo <= s_c <= hi                    the profile's bounds

whose solution is s_c = clip(sqrt(mu / end_c), lo, min(hi, sqrt(target / last_c))), mu set by
bisection. The chunk nearest the end carries most of the KL (10x the first chunk's, at one
scale), so early chunks may go coarser, as far as a prompt ending right after them allows
(on SmolLM2's test contexts that limit, not the whole context's, sets them); and a chunk of
hard text (contracts, code) goes finer than one of prose. The chosen steps travel in each
chunk's header, so decoding needs none of this.

When even the finest scale cannot meet a target, every chunk takes its finest. A chunk put
without costs (the vLLM connector, an older client), or coded with a profile that has no
targets of its own (its Tuning's rate_control, which calibrate tunes), is coded at its level's one
scale, as before rate control.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..bitstream import Header
from ..errors import CodecError
from ..profile import Profile
from .levels import LADDER, LEVELS, Level, get as get_level
from .tuned import RateControl, Tuning

# The scale on the profile's base steps the probes code each chunk at: between high's and
# fast's fixed scales, where KL is well above the numerical floor and still quadratic.
PROBE_SCALE = 2.4
# Scales are rounded down to this grid (2**(1/8) apart, 9% in step): the entropy models are
# built per step, and a grid keeps the number a decoder builds and caches small.
GRID_PER_OCTAVE = 8
# What a cost below this is taken as: a chunk that costs nothing measurable is not free.
MIN_COST = 1e-9


@dataclass(frozen=True)
class ChunkCost:
    """What coding one chunk costs, in KL per unit of scale**2 (see the module docstring)."""
    end: float
    last: float

    def __post_init__(self) -> None:
        for name in ("end", "last"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CodecError(f"chunk cost {name}={v!r} must be a finite number >= 0")

    def to_list(self) -> list[float]:
        return [self.end, self.last]

    @classmethod
    def of(cls, value) -> "ChunkCost":
        """From [end, last] (the wire's form); CodecError for anything else."""
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise CodecError(f"a chunk cost is [end, last], got {value!r}")
        return cls(*value)


def settings(profile: Profile) -> RateControl:
    """The profile's own rate control (its Tuning's, written by calibrate), else the defaults."""
    return Tuning.of(profile).rate_control or RateControl({})


def tuned(profile: Profile) -> bool:
    """Whether the profile carries rate control's targets: only then are its chunks coded each at
    its own scale (an untuned target would trade quality for size blind)."""
    return bool(settings(profile).targets)


def grid_scales(profile: Profile) -> list[float]:
    """Every scale rate control may give a chunk of `profile` at any level of the ladder, the
    ones nearest a level's own scale first: what a codec worker builds tables for ahead of the
    chunks (codec.pool.parallel); none for a profile not tuned for it."""
    if not tuned(profile):
        return []
    rc = settings(profile)
    near: dict[float, float] = {}
    for name in LADDER:
        base = get_level(name).scale_in(profile)
        k = math.floor(math.log2(on_grid(rc.bounds[0] * base)) * GRID_PER_OCTAVE + 0.5)
        while (scale := 2.0 ** (k / GRID_PER_OCTAVE)) <= rc.bounds[1] * base * (1 + 1e-9):
            near[scale] = min(near.get(scale, math.inf), abs(math.log2(scale / base)))
            k += 1
    return sorted(near, key=lambda s: (near[s], s))


def own_scale(h: Header, profile: Profile) -> bool:
    """Whether the chunk whose header is `h` was coded at a scale of its
    own: its steps are not its level's one scale's in `profile`, the whole profile it names."""
    lv = next((lv for lv in LEVELS.values() if lv.code == h.level), None)
    if lv is None or lv.name not in LADDER:
        return False
    return not np.array_equal(h.steps, lv.steps(profile)[list(h.held_layers())])


def on_grid(scale: float) -> float:
    """The grid point at or below `scale`."""
    return 2.0 ** (math.floor(math.log2(scale) * GRID_PER_OCTAVE + 1e-9) / GRID_PER_OCTAVE)


def scales(level: str | Level, profile: Profile, costs: list[ChunkCost],
           target: float | None = None) -> list[float | None]:
    """Each chunk's scale (a multiple of the profile's base steps) at `level`, for a context of
    these chunks' costs, in order (module docstring); `target`: in place of the profile's. None
    for each chunk (the level's one scale) with a profile that is not tuned for rate control, and
    at a level outside the ladder (`max`, a fixed distance below `high`)."""
    lv = get_level(level)
    if lv.name not in LADDER or (target is None and not tuned(profile)):
        return [None] * len(costs)
    if not costs:
        return []
    rc = settings(profile)
    target, base = rc.target(lv) if target is None else target, lv.scale_in(profile)
    lo, hi = rc.bounds[0] * base, rc.bounds[1] * base
    end = np.maximum(np.array([c.end for c in costs], np.float64), MIN_COST)
    last = np.maximum(np.array([c.last for c in costs], np.float64), MIN_COST)
    upper = np.clip(np.sqrt(target / last), lo, hi)  # where each chunk's own ceiling lies

    def at(mu: float) -> np.ndarray:
        return np.clip(np.sqrt(mu / end), lo, upper)

    def spent(mu: float) -> float:
        return float((end * at(mu) ** 2).sum())

    if spent(float((end * upper ** 2).max())) <= target:  # every chunk at its ceiling fits
        chosen = upper
    else:
        a, b = 0.0, float((end * upper ** 2).max())  # spent(a) < target < spent(b)
        for _ in range(60):
            mid = (a + b) / 2
            a, b = (mid, b) if spent(mid) <= target else (a, mid)
        chosen = at(a)
    return [max(on_grid(float(s)), on_grid(lo)) for s in chosen]
