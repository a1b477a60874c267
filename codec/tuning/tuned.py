"""What calibration tuned into a profile, as one typed value: `Tuning.of(profile)` reads it,
`write(profile, field=...)` writes it. The only code that reads or writes these keys of a
profile's meta; a .kvprofile file keeps them there (JSON), as it always has."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..errors import CodecError
from ..profile import Profile

# A chunk's rate-controlled scale stays within these multiples of its level's fixed scale
# (codec.tuning.rate), unless the profile's rate control says otherwise.
DEFAULT_BOUNDS = (0.5, 3.0)
# Where calibrate.tune_targets starts each level's target, as a share of its KL floor
# (Level.kl_floor), and what a level missing from a tuned profile's targets aims for. The probes
# see a few of the context's own tokens, which feel a chunk's error more than a long
# continuation does (SmolLM2, test.txt: a continuation's KL came to 0.24-0.55 of the probes').
DEFAULT_MARGIN = 1.0
DEFAULT_POWER = 0.25  # per-token steps: the rule's power, where a profile names none (token_steps)
# The coarsest multiplier the per-token rule gives (the bitstream takes up to 2 ** (TOP_CLASS / 2)
# = 8). At 8, Gemma-3's `fast` came to 1.42x its KL floor on the kind of text no tuning saw
# (manual), where every tuned kind held it: half the tokens sat there, read by no probe but by
# later prompts.
DEFAULT_TOP = 4.0


@dataclass(frozen=True)
class RateControl:
    """A profile's per-chunk rate control (codec.tuning.rate): each level's target (the probes'
    KL that a context may reach, tuned by calibrate so that held-out text lands under the
    level's floor) and the bounds of a chunk's scale, as multiples of its level's fixed scale."""

    targets: dict[str, float]
    bounds: tuple[float, float] = DEFAULT_BOUNDS

    def target(self, lv) -> float:
        """Level lv's target: the profile's own, else DEFAULT_MARGIN of its KL floor."""
        if lv.name in self.targets:
            return self.targets[lv.name]
        if lv.kl_floor is None:
            raise CodecError(f"level {lv.name} has no KL floor to aim for")
        return DEFAULT_MARGIN * lv.kl_floor

    def to_meta(self) -> dict:
        return {"targets": dict(self.targets), "bounds": list(self.bounds)}


@dataclass(frozen=True)
class TokenSteps:
    """A profile's per-token steps (codec.tuning.token_steps): the rule's power and its
    coarsest multiplier."""

    power: float = DEFAULT_POWER
    top: float = DEFAULT_TOP

    def to_meta(self) -> dict:
        return {"power": self.power, "top": self.top}


@dataclass(frozen=True)
class Tuning:
    """What `kvstreamd profile calibrate` tunes on held-out text (kvstreamd.lab.calibrate), kept
    in the profile beside its fitted statistics. Each field is stored in the profile's meta
    under its own name; an empty or None field is not stored."""

    level_scales: dict[str, float] = field(default_factory=dict)  # level -> its scale on base_step
    level_dppl: dict[str, float] = field(default_factory=dict)  # level -> expected Δppl %, measured
    rate_control: RateControl | None = None  # None: every chunk at its level's one scale
    token_steps: TokenSteps | None = None  # None: every token at its stream's step

    @classmethod
    def of(cls, profile: Profile) -> "Tuning":
        """The tuning `profile` carries (none: the defaults, every field empty)."""
        return cls.from_meta(profile.meta)

    @classmethod
    def from_meta(cls, meta: dict) -> "Tuning":
        rc, ts = meta.get("rate_control"), meta.get("token_steps")
        return cls({k: float(v) for k, v in (meta.get("level_scales") or {}).items()},
                   {k: float(v) for k, v in (meta.get("level_dppl") or {}).items()},
                   None if not rc else RateControl({k: float(v) for k, v in (rc.get("targets") or {}).items()},
                                                   tuple(float(b) for b in rc.get("bounds", DEFAULT_BOUNDS))),
                   None if not ts else TokenSteps(float(ts.get("power", DEFAULT_POWER)),
                                                  float(ts.get("top", DEFAULT_TOP))))

    def to_meta(self) -> dict:
        """The fields as a profile's meta stores them (the empty ones left out)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value:
                out[f.name] = dict(value) if isinstance(value, dict) else value.to_meta()
        return out


def write(profile: Profile, **changes) -> Tuning:
    """Set the named fields of `profile`'s tuning (Tuning's field names), in its meta as the file
    stores them (a field set empty or None is removed); the profile's id is taken afresh."""
    tuning = replace(Tuning.of(profile), **changes)
    stored = tuning.to_meta()
    for name in changes:
        if name in stored:
            profile.meta[name] = stored[name]
        else:
            profile.meta.pop(name, None)
    profile.changed()
    return tuning
