"""Per-chunk level choice for a stream: CacheGen's rule and kvstreamd's adaptive rule, as pure
functions of the link estimate, the remaining chunks' sizes, the receiver's work and the deadline."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import combinations_with_replacement
from typing import Callable, Mapping, Sequence

import numpy as np

from codec.tuning.catalog import TEXT  # the token ids, for the receiver to recompute

# Each level's quality cost (Δppl %) is data the caller passes in (Situation.dppl): it is
# measured per model and kept in codec.tuning.catalog, not here.

# Δppl points within which a plan counts as good as the best fitting one when it recomputes
# fewer chunks, and a level as near-lossless once the deadline is lost: about what Δppl on a few
# hundred scored tokens can tell apart (codec.tuning.catalog), and recompute takes the receiver's
# compute, which is what kvstreamd saves. Of the levels' expected costs (a profile's
# level_dppl), SmolLM2's and Gemma-3's `high` (0.155, 0.149) are within it and `balanced`
# (0.361, 0.357) is not.
NEAR_LOSSLESS_DPPL = 0.3


@dataclass(frozen=True)
class Situation:
    """What a rule knows when it picks the level of the next chunk."""

    bandwidth: float  # bytes/s: the smoothed estimate (harmonic mean of recent chunks)
    # level -> wire bytes of each remaining chunk, the next one first; levels listed best first
    sizes: Mapping[str, Sequence[int]]
    work_s: Mapping[str, float]  # level -> receiver seconds per chunk: decode, or recompute for TEXT
    dppl: Mapping[str, float]  # level -> quality cost, Δppl %
    deadline_s: float  # seconds left until the deadline; <= 0 once it has passed
    backlog_s: float = 0.0  # receiver seconds of work already queued (sent, not yet decoded)
    inflight_bytes: int = 0  # bytes sent and not yet acknowledged
    # TEXT chunks only after every KV chunk: the receiver holds a KV prefix, then computes (vLLM)
    text_last: bool = False
    # receiver seconds of each remaining chunk as TEXT, the next one first, where they differ by
    # position (text_seconds); None: work_s[TEXT] each
    text_s: Sequence[float] | None = None
    # bytes/s: the fastest recent sample (BandwidthEstimator.peak), how fast the link has lately
    # been; None: not known (a rule may then hope for anything up to its own optimism)
    peak_bandwidth: float | None = None
    # levels whose receiver work runs beside the other levels' rather than after it: a baseline
    # scheme (int8, fp16) the fetcher decodes in a thread of its own as each chunk lands, while
    # its codec workers are on the entropy-coded chunks before it (node/fetch.py)
    beside: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0, got {self.bandwidth}")
        if self.peak_bandwidth is not None and not self.peak_bandwidth > 0:
            raise ValueError(f"peak_bandwidth must be > 0, got {self.peak_bandwidth}")
        lengths = {len(v) for v in self.sizes.values()}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError(f"every level needs the same, non-zero number of chunks: {lengths}")
        missing = [lv for lv in self.sizes if lv not in self.work_s or lv not in self.dppl]
        if missing:
            raise ValueError(f"no receiver work or quality cost for levels {missing}")
        if self.text_s is not None and len(self.text_s) != self.chunks:
            raise ValueError(f"text_s has {len(self.text_s)} chunks, the sizes {self.chunks}")

    @property
    def chunks(self) -> int:
        return len(next(iter(self.sizes.values())))


@dataclass(frozen=True)
class Choice:
    """A rule's answer: the level of the next chunk, and why."""

    level: str
    predicted_seconds: float  # the rule's own prediction of the time from now to the end
    reason: str


Rule = Callable[[Situation], Choice]


def receiver_work(chunk_bytes: int, decode_rate: Mapping[str, float], recompute_s: float) -> dict[str, float]:
    """Receiver seconds per chunk for each level, from decode rates in bytes of fp16 KV out per
    second (of the whole receiver, all its decode processes together) and the recompute time."""
    return {level: chunk_bytes / rate for level, rate in decode_rate.items()} | {TEXT: recompute_s}


def text_seconds(tokens: int, start: int, tokens_per_s: float, doubling: float | None) -> float:
    """Receiver seconds to prefill `tokens` tokens from position `start` (a TEXT chunk): a token
    at position p costs (1 + p / doubling) / tokens_per_s, `tokens_per_s` being the rate at the
    start of a prompt and `doubling` the position where a token costs twice that (attention's
    share grows with the context: ~5000 tokens for SmolLM2 on two CPU cores); None: the same
    everywhere."""
    mid = start + (tokens - 1) / 2
    return tokens / tokens_per_s * (1 + (mid / doubling if doubling else 0.0))


def _by_quality(s: Situation) -> list[str]:
    """Coded levels, best first: lowest Δppl, ties in the order the caller listed them."""
    order = [lv for lv in s.sizes if lv != TEXT]
    return sorted(order, key=lambda lv: (s.dppl[lv], order.index(lv)))


def _mbit(rate: float) -> str:
    return f"{rate * 8 / 1e6:.1f} Mbit/s"


def fixed_rule(level: str) -> Rule:
    """Every chunk at `level`, whatever the link: what a fetch naming one level asks for, and
    how the fixed-level baselines are measured."""
    def rule(_s: Situation) -> Choice:
        return Choice(level, 0.0, f"every chunk at {level}, as asked")
    return rule


def cachegen_rule(s: Situation) -> Choice:
    """CacheGen's rule (SIGCOMM 2024): the highest-quality level whose predicted time for all
    the remaining chunks -- their bytes at that level over the estimated bandwidth -- fits
    the remaining deadline; if no level fits, TEXT for the receiver to recompute (or, where
    the tokens are not on offer, the smallest level). The receiver's decode time is not part
    of the prediction, as in the paper."""
    levels = _by_quality(s)
    for level in levels:
        seconds = (s.inflight_bytes + sum(s.sizes[level])) / s.bandwidth
        if seconds <= s.deadline_s:
            return Choice(level, seconds, f"{level} fits: {seconds:.2f} s <= {s.deadline_s:.2f} s "
                                          f"at {_mbit(s.bandwidth)}")
    fallback = TEXT if TEXT in s.sizes else min(levels, key=lambda lv: sum(s.sizes[lv]))
    seconds = (s.inflight_bytes + sum(s.sizes[fallback])) / s.bandwidth
    return Choice(fallback, seconds, f"no level fits {s.deadline_s:.2f} s at {_mbit(s.bandwidth)}: "
                                     f"{fallback}")


@lru_cache(maxsize=64)
def _splits(groups: int, levels: int) -> np.ndarray:
    """Every way to share `groups` equal groups of chunks among `levels` levels: [plans, levels]."""
    rows = [np.bincount(c, minlength=levels) for c in combinations_with_replacement(range(levels), groups)]
    out = np.array(rows, dtype=np.float64)
    out.flags.writeable = False
    return out


def _finish(s: Situation, counts: np.ndarray, bandwidth: float) -> tuple[np.ndarray, list[int]]:
    """For each plan (a row of chunk counts per level): seconds from now until the receiver
    holds every remaining chunk, at `bandwidth`; and the order its levels are sent in."""
    levels = list(s.sizes)
    link = np.array([np.mean(s.sizes[lv]) / bandwidth for lv in levels])
    work = np.array([s.work_s[lv] for lv in levels])
    # Johnson's rule, which minimises a two-stage pipeline's time: receiver-bound levels
    # first by link time ascending, then link-bound ones by receiver time descending.
    order = sorted(range(len(levels)), key=lambda j: (0, link[j]) if link[j] < work[j] else (1, -work[j]))
    if s.text_last and TEXT in levels:  # a receiver that holds a KV prefix, then computes
        order = [j for j in order if levels[j] != TEXT] + [levels.index(TEXT)]
    sent = np.full(len(counts), s.inflight_bytes / bandwidth)  # the link is through the plan so far
    done = np.full(len(counts), s.backlog_s)  # the receiver is through it
    aside = np.zeros(len(counts))  # and through the chunks it works on beside the rest (s.beside)
    for j in order:
        m, a, b = counts[:, j], link[j], work[j]
        apart = levels[j] in s.beside
        mb = m * b  # the receiver's work on them
        if levels[j] == TEXT and s.text_s is not None:
            # TEXT chunks by position: a head is the next m chunks, a tail the last m
            costs = np.asarray(s.text_s, dtype=np.float64)
            cum = np.concatenate([[0.0], np.cumsum(costs[::-1] if s.text_last else costs)])
            k = np.rint(m).astype(int)
            mb, b = cum[k], np.where(k > 0, cum[k] - cum[np.maximum(k - 1, 0)], 0.0)
        # m like chunks in a row: the receiver ends their work after it is free, or after the
        # first chunk lands (a), or one chunk's work after the last one lands (m*a).
        finish = np.maximum(np.maximum((aside if apart else done) + mb, sent + a + mb), sent + m * a + b)
        if apart:
            aside = np.where(m > 0, finish, aside)
        else:
            done = np.where(m > 0, finish, done)
        sent = sent + m * a
    return np.maximum(done, aside), order


def adaptive_rule(s: Situation, *, horizon: int = 8, safety: float = 0.9, optimism: float = 2.0,
                  stress: float = 0.5, near: float = NEAR_LOSSLESS_DPPL) -> Choice:
    """kvstreamd's rule: plan all the remaining chunks on a model of the whole pipeline, send
    the first chunk of the best plan, and plan again at the next chunk (model-predictive
    control, as in video bitrate adaptation).

    - Time: the link carries chunks one after another (bytes / bandwidth each) while the
      receiver decodes them in order as they land (`work_s`; for TEXT, the recompute), so a
      plan takes about max(link time, receiver time) plus one chunk of the other, not their
      sum. Decode time per chunk does not shrink with the level, so on a fast link the
      entropy-coded levels (small, slow to decode) lose to int8 (2.6x the bytes of `high`,
      ~6x faster to decode), and a mix of the two can beat both by keeping both stages busy.
      TEXT costs the link nothing but the receiver a prefill, which overlaps the link's work.
      A level in `beside` (a baseline scheme, decoded in a thread of its own as each chunk
      lands) does not queue behind the coded chunks' decode: at 146 MB/s of decode and 115 MB/s
      of link, priced as if it did, 8 `high` + 8 int8 came out 10 ms slower than 6 + 10, and
      priced beside, 21 ms faster.
    - Plans: how many of the remaining chunks go at each level (a context's chunks are the
      same size, so counts are enough), sent in the order that minimises the pipeline's time
      (Johnson's rule). Past `horizon` chunks, the chunks are shared out in `horizon` equal
      groups, so there are a few hundred plans whatever the context's length.
    - Safety: plans are timed at `safety` x the smoothed bandwidth. The harmonic mean already
      leans to the slow samples; planning on the slowest recent sample instead made no
      consistent difference on the random traces, so the simpler discount stays. The
      receiver's decode rate (a moving average over its recent decodes, which share its cores
      with whatever else it runs) is discounted alike (`_discounted`): discounting the link
      alone leant every mix toward the decoder, and at 1000 Mbit/s, 4096 tokens, plans of 8-9
      `high` chunks ended 70-150 ms after the wire, decode-bound, where 6 would have kept both
      busy. (TEXT's prefill is not: its rate is learned from heads run inside fetches, HeadPace.)
    - Choice, in three cases:
      1. Some plan fits the deadline: of those within `near` Δppl points of the best one,
         the fewest TEXT chunks (a prefill takes the receiver's compute, and an exact
         recompute is no better than a level whose measured cost is within noise of 0), then
         the least mean Δppl, then the plan that finishes first (among plans of one quality:
         a mix of two levels priced alike, int8 and `high`, that keeps the wire and the
         decoder both busy), then the one that would still finish first if the link fell to
         `stress` x the planning bandwidth.
      2. None fits, but one would if the link sped up -- to `optimism` x the smoothed
         bandwidth, and no faster than its fastest recent sample (`peak_bandwidth`): the
         deadline can still be met, so the fastest plan (least Δppl among equals). A steady
         link, whose samples sit at its estimate, gives no such hope: betting quality on it
         sent `fast` chunks for nothing on a 20 Mbit/s tbf link (+2.4% Δppl on an e2e document).
      3. Not even then: the deadline is lost and lower quality cannot save it, so the fastest
         (at the bandwidth estimate itself: with no deadline left to keep, the safety discount,
         which falls on the link alone, would only price every KV chunk against a TEXT head too
         high -- at 20 Mbit/s, 8192 tokens, a head of 12 TEXT chunks took 10-11 s of prefill
         beside a tail the link carried in 7.7 s)
         of the plans whose every level is within `near` Δppl points of the best level -- a
         late but lossless finish, as
         with CacheGen's TEXT fallback, but by the quickest lossless way (a plan all TEXT, at
         Δppl 0, is not worth seconds over one a noise-level 0.1 point from it)."""
    levels = list(s.sizes)
    n = s.chunks
    groups = min(n, horizon)
    counts = _splits(groups, len(levels)) * (n / groups)
    cost = np.array([s.dppl[lv] for lv in levels])
    quality = np.round(counts @ cost / n, 9)
    texts = counts[:, levels.index(TEXT)] if TEXT in levels else np.zeros(len(counts))
    at = s.bandwidth * safety  # the bandwidth plans are timed at
    done, order = _finish(_discounted(s, safety), counts, at)
    fits = done <= s.deadline_s
    if fits.any():
        fits &= quality <= quality[fits].min() + near
        keys = (_finish(_discounted(s, safety), counts, at * stress)[0], done, quality, texts)
        verdict = "fits"
    elif (_finish(s, counts, _hope(s, optimism))[0] <= s.deadline_s).any():
        fits[:], keys, verdict = True, (quality, done), "behind, fastest plan"
    else:
        # every chunk near-lossless, not the mean: a quarter of the chunks at `fast` averages
        # under `near` but costs the tokens that read them (+1.45% Δppl at 20 Mbit/s, bench e2e)
        worst = np.where(counts > 0, cost, -np.inf).max(axis=1)
        fits = worst <= cost.min() + near
        at = s.bandwidth
        done, order = _finish(s, counts, at)
        keys, verdict = (quality, done), "deadline lost, best quality"
    candidates = np.flatnonzero(fits)
    best = candidates[np.lexsort(tuple(k[candidates] for k in keys))[0]]
    used = [j for j in order if counts[best, j] > 0]
    plan = " + ".join(f"{counts[best, j]:g}x{levels[j]}" for j in used)
    return Choice(levels[used[0]], float(done[best]),
                  f"{verdict} ({s.deadline_s:.2f} s left): {plan} in {done[best]:.2f} s at "
                  f"{_mbit(at)}, mean Δppl {quality[best]:.2f}%")


def _discounted(s: Situation, safety: float) -> Situation:
    """`s` with the receiver's decoding `safety` x as fast as it said (its backlog too): TEXT's
    prefill aside."""
    return replace(s, work_s={lv: w if lv == TEXT else w / safety for lv, w in s.work_s.items()},
                   backlog_s=s.backlog_s / safety)


def _hope(s: Situation, optimism: float) -> float:
    """The fastest the link may be hoped to get (bytes/s): `optimism` x the estimate, but no
    faster than it has lately been (and never below the estimate itself)."""
    hope = s.bandwidth * optimism
    return hope if s.peak_bandwidth is None else max(s.bandwidth, min(hope, s.peak_bandwidth))


# The per-chunk rules a fetch may ask its sender for by name (FETCH `rule`); a sender refuses
# any other name. "adaptive" is what a FETCH that names none gets.
RULES: dict[str, Rule] = {"adaptive": adaptive_rule, "cachegen": cachegen_rule}
DEFAULT_RULE = "adaptive"
