"""Every name a chunk can be stored or sent at, and what each costs: the codec's levels
(`codec.tuning.levels`) and the comparison baselines (`codec.baselines`). The daemon's config, its
API and the sender's level choice all read this one table; a name missing here is not a level.

Costs are measured on SmolLM2-135M-Instruct over WikiText-2 test.txt (docs/benchmarks.md,
`kvstreamd bench codec`): the defaults. A profile carries its own model's costs
(its Tuning's `level_dppl`: the expected Δppl, 100 x a continuation's KL on the kind of text where the
level costs most, kvstreamd.lab.calibrate.level_costs), which win for that model's chunks; the
policy gets them as data (`dppl_table`), never from its own copy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

TEXT = "text"  # not a scheme: the token ids, for the receiver to recompute (always available)


@dataclass(frozen=True)
class Scheme:
    """One way a chunk's KV travels."""

    name: str
    kind: str  # "level": a CacheGen-family bitstream (codec.encode/decode); "baseline": codec.baselines
    dppl: float  # quality cost, Δppl % of the continuation's perplexity on the decoded cache
    # MB/s of fp16 output one core decodes; None for the entropy-coded levels, whose rate the
    # receiver measures and tells the sender (FETCH decode_mbps)
    decode_mbps: float | None = None
    # fp16 bytes over coded bytes, nominal (SmolLM2 on WikiText-2 test.txt): what a fetcher
    # guesses a chunk's size from before any holder has sent it; None: not measured
    ratio: float | None = None

    @property
    def is_level(self) -> bool:
        """A CacheGen-family bitstream (entropy-coded, decoded by codec.decode), not a baseline."""
        return self.kind == "level"


def is_level(name: str) -> bool:
    """Whether `name` is one of the codec's levels (False for a baseline, TEXT or an unknown name)."""
    scheme = SCHEMES.get(name)
    return scheme is not None and scheme.is_level


def decoded_as_it_lands(name: str) -> bool:
    """Whether a fetcher decodes a chunk at `name` as it lands, in a thread of its own (a
    baseline scheme: one pass), rather than queue it for the codec workers behind the coded
    chunks before it (node/fetch.py); a sender's plan prices it so (transport Situation.beside)."""
    return not is_level(name)


# Δppl over 768 scored tokens is noisy to about ±0.3 points: int8 measures -0.09% and high +0.31%
# (at KL 0.00102, less than half of balanced's 0.00233, whose Δppl is +0.22%). Both count as 0,
# the near-lossless levels, which keeps the ladder in KL order. The baselines' decode rates are
# their measured per-core rates, rounded down.
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("high", "level", 0.0, ratio=5.42),
    Scheme("balanced", "level", 0.22, ratio=6.68),
    Scheme("fast", "level", 1.86, ratio=9.71),
    Scheme("max", "level", 0.0, ratio=2.73),
    Scheme("cachegen-paper", "level", 18.4),
    Scheme("cachegen-paper-high", "level", 18.4),  # not measured apart; priced as its middle sibling
    Scheme("cachegen-paper-fast", "level", 18.4),
    Scheme("fp16", "baseline", 0.0, decode_mbps=2000.0, ratio=1.0),
    Scheme("zstd-fp16", "baseline", 0.0, decode_mbps=800.0),
    Scheme("int8", "baseline", 0.0, decode_mbps=1500.0, ratio=1.98),
    Scheme("kivi2", "baseline", 18.1, decode_mbps=1000.0),
)}


# What one core decodes at the entropy-coded levels, MB/s of fp16 output: the reference
# machine's figure for the shipped profiles (docs/benchmarks.md, `kvstreamd bench codec`:
# 148-186 on SmolLM2-135M, rounded down), and the floor those benchmarks hold. A daemon starts
# from the first (kvstreamd/coder.py) until it has measured its own host; `kvstreamd doctor`
# judges that measurement against both.
DECODE_MBPS_PER_CORE = 140.0
DECODE_FLOOR_MBPS_PER_CORE = 80.0


def names() -> list[str]:
    return list(SCHEMES)


def get(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown level {name!r}; known: {', '.join(SCHEMES)}") from None


def dppl_table(levels: Iterable[str], measured: dict[str, float] | None = None) -> dict[str, float]:
    """level -> Δppl % for these levels plus TEXT (recompute is exact): what a rule weighs.
    `measured`: a model's own figures (codec.tuning.levels.expected_dppl of its profile), where it has them."""
    own = measured or {}
    # A model's own figures and the catalog's come from different measurements (the expected Δppl
    # from KL on its calibration text; Δppl of SmolLM2 on 768 tokens, noisy to tenths of a point).
    # Where the model has its own, a level it has none for (a baseline) counts as no better than
    # its best own level: int8's
    # catalog 0.0 against SmolLM2 high's own 0.08 made every chunk of a 1000 Mbit/s fetch int8 (2.7x
    # high's bytes) for a difference neither measurement can tell, where a mix of the two keeps both
    # the wire and the decoder busy.
    # The best own level in play (else the best own level): `max`'s tiny price, which a profile
    # gives but a fetch of chunks not stored at `max` cannot use, would otherwise put int8 above
    # `high` there.
    levels = [lv for lv in levels if lv != TEXT]
    best_own = min((own[lv] for lv in levels if lv in own), default=min(own.values(), default=0.0))
    return {**{lv: float(own[lv]) if lv in own else max(SCHEMES[lv].dppl, best_own)
               for lv in levels}, TEXT: 0.0}


def decode_seconds(level: str, fp16_mb: float, receiver_mbps: float) -> float:
    """The receiver's seconds to decode a chunk of `fp16_mb` MB of fp16 KV at `level`."""
    rate = SCHEMES[level].decode_mbps
    return fp16_mb / (rate if rate is not None else receiver_mbps)
