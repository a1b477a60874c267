"""`kvstreamd ab report`: the two arms of a level-policy experiment compared on fetch time
(median and p95, each difference with a bootstrap confidence interval), deadline misses,
levels chosen and bytes, and whether the difference is significant yet."""
from __future__ import annotations

import math
from collections import Counter
from statistics import NormalDist
from typing import Iterable

import numpy as np

from kvstreamd.experiment import ARMS, CANDIDATE, CONTROL
from kvstreamd.ops.outcomes import Outcome

RESAMPLES = 2000  # bootstrap resamples: the CI's ends move by well under 1% of its width between seeds
CONFIDENCE = 0.95
# Fewer fetches in an arm than this and no verdict: a percentile bootstrap of a median from a
# handful of fetches is too narrow (on simulated equal arms of ~20 it called 1 in 6 "significant").
MIN_PER_ARM = 30
_BATCH = 4_000_000  # resampled values held at once (memory: 8 bytes each, a few copies)


# A p95 needs about 5 fetches above it in an arm before its bootstrap interval means anything
# (with fewer, no resample can go past the arm's slowest fetch, and the interval is too narrow).
MIN_FOR_P95 = 100


def _bootstrap(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """[resamples, 2]: median and p95 of each resample of one arm's fetch times."""
    out = np.empty((resamples, 2))
    rows = max(1, _BATCH // len(x))
    for lo in range(0, resamples, rows):
        hi = min(resamples, lo + rows)
        idx = rng.integers(0, len(x), size=(hi - lo, len(x)))
        out[lo:hi] = np.quantile(x[idx], [0.5, 0.95], axis=1).T
    return out


def _wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _rate_difference_ci(k1: int, n1: int, k0: int, n0: int, confidence: float) -> tuple[float, float]:
    """Newcombe's interval (from two Wilson intervals) for rate1 - rate0: sound where misses are
    rare or absent, which a bootstrap of a proportion is not (no misses: an interval of width 0)."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p1, p0 = k1 / n1, k0 / n0
    l1, u1 = _wilson(k1, n1, z)
    l0, u0 = _wilson(k0, n0, z)
    d = p1 - p0
    return d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)


def _more_needed(total: int, diff: float, ci: tuple[float, float]) -> int | None:
    """Roughly how many more fetches (both arms, in today's split) until an interval as wide as
    `ci` shrinks (as 1/sqrt(n)) to exclude 0 around `diff`; None when no difference is seen."""
    half = (ci[1] - ci[0]) / 2
    if diff == 0 or half <= 0:
        return None
    return max(1, math.ceil(total * ((half / abs(diff)) ** 2 - 1)))


def compare(outcomes: Iterable[Outcome], experiment: str | None = None, *, seed: int = 0,
            resamples: int = RESAMPLES, confidence: float = CONFIDENCE) -> dict:
    """The report on `outcomes` of `experiment` (an Experiment.label; None: the latest
    outcome's, so a log that outlived a change of experiment compares the current one only).
    Seeded: the same outcomes give the same report."""
    outcomes = list(outcomes)
    if experiment is None:
        experiment = outcomes[-1].experiment if outcomes else ""
    mine = [o for o in outcomes if o.experiment == experiment]
    report: dict = {"experiment": experiment, "other_experiments_skipped": len(outcomes) - len(mine),
                    "confidence": confidence, "resamples": resamples, "seed": seed, "arms": {}}
    data = {}
    for arm in ARMS:
        rows = [o for o in mine if o.arm == arm]
        x = np.array([o.seconds for o in rows], dtype=np.float64)
        missed = np.array([o.deadline_missed for o in rows], dtype=np.float64)
        chunks = Counter()
        for o in rows:
            chunks.update(o.levels)
        n_chunks = sum(chunks.values())
        report["arms"][arm] = {
            "fetches": len(rows),
            "median_s": float(np.median(x)) if len(x) else None,
            "p95_s": float(np.quantile(x, 0.95)) if len(x) else None,
            "deadline_miss_rate": float(missed.mean()) if len(x) else None,
            "levels": {lv: round(c / n_chunks, 4) for lv, c in chunks.most_common()},
            "bytes_per_fetch": float(np.mean([o.bytes for o in rows])) if rows else None,
        }
        data[arm] = (x, missed)
    n = {arm: len(data[arm][0]) for arm in ARMS}
    if min(n.values()) < MIN_PER_ARM:
        short = min(ARMS, key=lambda a: n[a])
        report["difference"] = None
        report["significant"] = False
        report["verdict"] = (f"not significant yet: the {short} arm has {n[short]} fetches, "
                             f"and at least {MIN_PER_ARM} a side are needed")
        return report
    rng = np.random.default_rng(seed)
    boot = {arm: _bootstrap(data[arm][0], rng, resamples) for arm in ARMS}
    diffs = boot[CANDIDATE] - boot[CONTROL]
    tail = (1 - confidence) / 2 * 100
    missed = {arm: int(data[arm][1].sum()) for arm in ARMS}
    cis = {"median_s": np.percentile(diffs[:, 0], [tail, 100 - tail]),
           "p95_s": np.percentile(diffs[:, 1], [tail, 100 - tail]) if min(n.values()) >= MIN_FOR_P95 else None,
           "deadline_miss_rate": _rate_difference_ci(missed[CANDIDATE], n[CANDIDATE], missed[CONTROL], n[CONTROL],
                                                     confidence)}
    report["difference"] = {}
    for name, ci in cis.items():
        base, cand = report["arms"][CONTROL][name], report["arms"][CANDIDATE][name]
        lo, hi = (None, None) if ci is None else (float(v) for v in ci)
        report["difference"][name] = {
            "candidate_minus_control": cand - base, "ci": None if ci is None else [lo, hi],
            "relative": (cand - base) / base if base else None,
            "significant": ci is not None and bool(lo > 0 or hi < 0),
        }
    med = report["difference"]["median_s"]
    report["significant"] = med["significant"]
    if med["significant"]:
        report["verdict"] = (f"significant: the candidate's median fetch time differs by {_pct(med['relative'])} "
                             f"from the control's ({confidence:.0%} CI excludes no difference)")
    else:
        more = _more_needed(sum(n.values()), med["candidate_minus_control"], tuple(med["ci"]))
        report["more_fetches_needed"] = more
        report["verdict"] = ("not significant: the medians are equal" if more is None else
                             f"not significant yet (need ~{more} more fetches to tell a "
                             f"{_pct(med['relative'])} difference in the median)")
    return report


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def text(report: dict) -> str:
    """The report as a table for people."""
    arms = report["arms"]
    lines = [f"experiment: {report['experiment'] or '(none recorded)'}"
             + (f"  ({report['other_experiments_skipped']} fetches of other experiments left out)"
                if report["other_experiments_skipped"] else ""),
             f"{'':22}{'control':>16}{'candidate':>16}"]
    for label, key, show in (("fetches", "fetches", str), ("median fetch time", "median_s", _s),
                             ("p95 fetch time", "p95_s", _s),
                             ("deadline misses", "deadline_miss_rate", lambda v: "-" if v is None else f"{v:.1%}"),
                             ("bytes per fetch", "bytes_per_fetch", lambda v: "-" if v is None else f"{v / 1e6:.2f} MB")):
        lines.append(f"{label:22}{show(arms[CONTROL][key]):>16}{show(arms[CANDIDATE][key]):>16}")
    for arm in ARMS:
        levels = ", ".join(f"{lv} {share:.0%}" for lv, share in arms[arm]["levels"].items()) or "-"
        lines.append(f"levels ({arm}): {levels}")
    if report["difference"]:
        conf = f"{report['confidence']:.0%}"
        for key, label in (("median_s", "median"), ("p95_s", "p95")):
            d = report["difference"][key]
            ci = (f"{conf} CI [{d['ci'][0] * 1000:+.1f}, {d['ci'][1] * 1000:+.1f}] ms" if d["ci"] else
                  f"no interval below {MIN_FOR_P95} fetches an arm")
            lines.append(f"candidate - control, {label}: {d['candidate_minus_control'] * 1000:+.1f} ms "
                         f"({_pct(d['relative'])}); {ci}" + (" significant" if d["significant"] else ""))
        d = report["difference"]["deadline_miss_rate"]
        lines.append(f"candidate - control, deadline misses: {d['candidate_minus_control']:+.1%}; "
                     f"{conf} CI [{d['ci'][0]:+.1%}, {d['ci'][1]:+.1%}]" + (" significant" if d["significant"] else ""))
    lines.append(report["verdict"])
    return "\n".join(lines)
