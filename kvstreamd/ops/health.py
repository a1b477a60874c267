"""The health thresholds of a node and its fetches as operators read them (the one definition:
deploy/prometheus/kvstreamd.rules.yml alerts on the same bounds, a test holds the two equal),
and each one's state now (ok / warn / no data) for GET /v1/status."""
from __future__ import annotations

import collections
import operator
from dataclasses import dataclass

import numpy as np
from prometheus_client import Gauge

from kvstreamd.features import Feature, FetchEnded

# /v1/status judges the fetch thresholds over this many of the node's latest fetches (the
# alerting rules over the last 5 minutes of the histograms).
RECENT_FETCHES = 100

_WARN_WHEN = {"<": operator.lt, ">": operator.gt}


@dataclass(frozen=True)
class Bound:
    """One side of a threshold: the value warns when it is `op` `limit`."""
    op: str
    """"<" or ">"."""
    limit: float
    alert: str
    """The alert in the rules file that fires on this side."""
    check: str
    """What the operator should check when it warns (also the alert's description)."""

    def crossed(self, value: float) -> bool:
        return _WARN_WHEN[self.op](value, self.limit)


@dataclass(frozen=True)
class Threshold:
    """One health threshold: its name in /v1/status, its unit, and the side(s) it warns past."""
    name: str
    unit: str
    """"s", "%" (the value is a fraction) or ":1" (a ratio)."""
    over: str
    """What the value in /v1/status is taken over."""
    bounds: tuple[Bound, ...]

    def ok_when(self) -> str:
        """The healthy range as an operator reads it: "< 2 s", "> 3:1", "60% to 80%"."""
        if len(self.bounds) == 2:
            lo, hi = sorted(self.bounds, key=lambda b: b.limit)
            return f"{self.reads(lo.limit)} to {self.reads(hi.limit)}"
        b = self.bounds[0]
        return f"{'>' if b.op == '<' else '<'} {self.reads(b.limit)}"

    def reads(self, value: float) -> str:
        if self.unit == "%":
            return f"{value * 100:.3g}%"
        if self.unit == ":1":
            return f"{value:.3g}:1"
        return f"{value:.3g} {self.unit}"


TIME_TO_FIRST_TOKEN = Threshold(
    "time_to_first_token", "s", f"p95 of the fetch time (request to last chunk ready) of the last "
    f"{RECENT_FETCHES} fetches", (
        Bound(">", 2.0, "KvstreamdSlowTimeToFirstToken",
              "Fetches keep the model from its first token too long. Check kvstreamd_fetch_stage_seconds_sum by stage for "
              "the slow stage (transfer: peer links and kvstreamd_link_utilisation; decode: codec workers), "
              "kvstreamd_fetches_active for queueing, and kvstreamd_errors_total{kind=~\"peer_.*\"} for "
              "stalled peers."),))
DECODE_SHARE = Threshold(
    "decode_share", "%", f"mean share of decode time in each of the last {RECENT_FETCHES} fetches", (
        Bound(">", 0.10, "KvstreamdDecodeBound",
              "Decoding, not the link, bounds fetches. Check the host's CPU load and the codec workers "
              "([codec] workers, kvstreamd_codec_worker_restarts_total), and whether fetches take a slower "
              "level than needed (kvstreamd_chunks_total by level)."),))
COMPRESSION_RATIO = Threshold(
    "compression_ratio", ":1", "fp16 KV bytes over coded bytes of every chunk stored since start, per level", (
        Bound("<", 3.0, "KvstreamdLowCompression",
              "A level codes the KV this node stores less than 3:1, so fetches move more bytes than planned. "
              "Check that the codec profile ([codec] profile) was calibrated for the model that puts, and "
              "the level in the alert."),))
LINK_UTILISATION = Threshold(
    "link_utilisation", "%", "share of the link's estimated bandwidth the last transfer to each peer used", (
        Bound("<", 0.60, "KvstreamdLinkUnderused",
              "Transfers to this peer use little of its link: the sender is the bottleneck. Check this "
              "node's CPU and disk (chunks read from the disk tier), its send window, and "
              "kvstreamd_errors_total{kind=\"served_fetch_timed_out\"}."),
        Bound(">", 0.80, "KvstreamdLinkSaturated",
              "Transfers to this peer fill its link, so other traffic and other fetches queue behind them. "
              "Check the link's other users, whether fetches take a heavier level than needed, and add "
              "holders of the contexts (kvstreamd_chunks_total{direction=\"sent\"}) to spread the load."),))

THRESHOLDS = (TIME_TO_FIRST_TOKEN, DECODE_SHARE, COMPRESSION_RATIO, LINK_UTILISATION)


class RecentFetches:
    """The time and decode share of the node's latest RECENT_FETCHES fetches."""

    def __init__(self) -> None:
        self.seconds: collections.deque[float] = collections.deque(maxlen=RECENT_FETCHES)
        self.decode_shares: collections.deque[float] = collections.deque(maxlen=RECENT_FETCHES)

    def add(self, seconds: float, decode_seconds: float) -> None:
        self.seconds.append(seconds)
        if seconds > 0:  # (as kvstreamd_fetch_decode_share: decode time overlaps other stages, so at most 1)
            self.decode_shares.append(min(decode_seconds / seconds, 1.0))


def judge(threshold: Threshold, values: dict[str, float] | float | None) -> dict:
    """{"status": "ok" | "warn" | "no data", "value", "reads", "ok_when", "over"} and, when it
    warns, "check": the checks of every side crossed. `values` is one number or one per
    label (level, peer), and warns if any does."""
    if isinstance(values, dict):
        values = {k: round(v, 4) for k, v in values.items()}
    elif values is not None:
        values = round(values, 4)
    out = {"status": "no data", "value": values, "reads": None, "ok_when": threshold.ok_when(),
           "over": threshold.over}
    if values is None or values == {}:
        return out
    each = values if isinstance(values, dict) else {"": values}
    crossed = [b for b in threshold.bounds if any(b.crossed(v) for v in each.values())]
    out["status"] = "warn" if crossed else "ok"
    out["reads"] = ", ".join(f"{k} {threshold.reads(v)}" if k else threshold.reads(v) for k, v in each.items())
    if crossed:
        out["check"] = " ".join(b.check for b in crossed)
    return out


def _by_label(gauge: Gauge) -> dict[str, float]:
    """A gauge with one label, as {label value: value}."""
    return {next(iter(s.labels.values())): s.value for m in gauge.collect() for s in m.samples}


def report(recent: RecentFetches, compression_ratio: Gauge, link_utilisation: Gauge) -> dict:
    """Every threshold's state now, by name; the fetch thresholds say how many fetches they
    were judged over ("fetches": up to RECENT_FETCHES)."""
    ttft = float(np.percentile(recent.seconds, 95)) if recent.seconds else None
    decode = float(np.mean(recent.decode_shares)) if recent.decode_shares else None
    out = {t.name: judge(t, v) for t, v in (
        (TIME_TO_FIRST_TOKEN, ttft), (DECODE_SHARE, decode),
        (COMPRESSION_RATIO, _by_label(compression_ratio)), (LINK_UTILISATION, _by_label(link_utilisation)))}
    out[TIME_TO_FIRST_TOKEN.name]["fetches"] = len(recent.seconds)
    out[DECODE_SHARE.name]["fetches"] = len(recent.decode_shares)
    return out


class HealthWatch(Feature):
    """The four thresholds, judged over the node's recent fetches and its metrics: /v1/status
    "thresholds"."""

    name = "thresholds"

    def __init__(self, metrics) -> None:
        self.metrics = metrics  # kvstreamd.metrics.Metrics: compression ratio and link utilisation
        self.recent = RecentFetches()

    async def fetch_ended(self, ended: FetchEnded) -> None:
        self.recent.add(ended.seconds, ended.decode_s)

    def status(self) -> dict:
        return report(self.recent, self.metrics.compression_ratio, self.metrics.link_utilisation)
