"""Bandwidth traces in CacheGen's style (a new bandwidth for each chunk) and a discrete-event
simulation of one stream over a trace, so level-choice rules are compared without a network."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .bandwidth import BandwidthEstimator, Probe
from .frames import text_wire_bytes_for
from .policy import TEXT, Rule, Situation, receiver_work

# CacheGen draws each chunk's bandwidth from 0.1-10 Gbps; this machine's loopback carries far
# less, so traces are scaled by 1/20 into 5-500 Mbit/s.
PAPER_GBPS = (0.1, 10.0)
SCALE = 1 / 20

# SmolLM2-135M, 1024-token chunks (docs/benchmarks.md): 11,520 KV elements per token.
CHUNK_ELEMENTS = 11_520 * 1024
CHUNK_BYTES = CHUNK_ELEMENTS * 2  # fp16: 23.6 MB
BITS_PER_ELEMENT = {"int8": 8.083, "high": 3.064, "balanced": 2.303, "fast": 1.381}
# Receiver decode, MB of fp16 out per second: int8 on one core; the entropy-coded levels
# with both cores (a pool of 2 processes), as the daemon decodes them.
DECODE_MB_S = {"int8": 751.0, "high": 120.0, "balanced": 135.0, "fast": 147.0}
RECOMPUTE_S = 3.5  # prefill of 1024 tokens on this machine's CPU
TEXT_BYTES = text_wire_bytes_for(1024, 49_152)  # a TEXT frame of 1024 ids of SmolLM2's vocabulary


def generate(seed: int, chunks: int, gbps: tuple[float, float] = PAPER_GBPS,
             scale: float = SCALE) -> list[float]:
    """A trace of `chunks` bandwidths in Mbit/s: each drawn log-uniformly from `gbps`, then
    scaled; the same seed gives the same trace."""
    low, high = (math.log(g * 1000 * scale) for g in gbps)
    return [round(float(v), 3) for v in np.exp(np.random.default_rng(seed).uniform(low, high, chunks))]


def save(path: str | Path, trace: Sequence[float]) -> None:
    """Write a trace as text: one Mbit/s value per line."""
    Path(path).write_text("".join(f"{float(v)!r}\n" for v in trace))


def load(path: str | Path) -> list[float]:
    """Read a trace written by `save` (blank lines and '#' comments are skipped)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            value = float(line)
        except ValueError:
            raise ValueError(f"{path}:{n}: not a bandwidth in Mbit/s: {line!r}") from None
        if not value > 0:
            raise ValueError(f"{path}:{n}: bandwidth must be > 0, got {value}")
        out.append(value)
    if not out:
        raise ValueError(f"{path}: no bandwidths in the trace")
    return out


def smollm2_chunks(chunks: int) -> tuple[dict[str, list[int]], dict[str, float]]:
    """(sizes, work_s) of `chunks` full SmolLM2-135M chunks, levels best first, TEXT last."""
    sizes = {lv: [round(CHUNK_ELEMENTS * bits / 8)] * chunks for lv, bits in BITS_PER_ELEMENT.items()}
    sizes[TEXT] = [TEXT_BYTES] * chunks
    rates = {lv: mb * 1e6 for lv, mb in DECODE_MB_S.items()}
    return sizes, receiver_work(CHUNK_BYTES, rates, RECOMPUTE_S)


@dataclass(frozen=True)
class SimResult:
    total_seconds: float  # from the start (probe included) until the receiver has all the KV
    deadline_met: bool
    levels: tuple[str, ...]  # the level of each chunk
    mean_dppl: float  # mean quality cost of the levels used, Δppl %


def simulate(rule: Rule, trace: Sequence[float], sizes: Mapping[str, Sequence[int]], deadline_s: float,
             work_s: Mapping[str, float], dppl: Mapping[str, float], *,
             estimator: BandwidthEstimator | None = None, probe: Probe = Probe(),
             beside: frozenset[str] = frozenset()) -> SimResult:
    """Send one context chunk by chunk over `trace` (chunk i crosses the link at trace[i]
    Mbit/s, wrapping round) with the receiver decoding in order as chunks land (those at a
    level in `beside` in order among themselves, beside the rest: Situation.beside).

    The rule sees only what a real sender would: the estimator's smoothed past, fed by each
    chunk's bytes and send-to-ack time (acks are immediate: no round-trip time), and the
    receiver's backlog as predicted from `work_s`. A fresh estimator is probed first, on
    trace[0], and the probe's time counts."""
    est = estimator if estimator is not None else BandwidthEstimator()
    n = len(next(iter(sizes.values())))
    rate = [trace[i % len(trace)] * 1e6 / 8 for i in range(n)]  # bytes/s
    now = 0.0
    if est.needs_probe:
        now = probe.size / rate[0]
        probe.record(est, 0.0, now)
    receiver_free = aside_free = now
    levels = []
    for i in range(n):
        situation = Situation(bandwidth=est.estimate(), sizes={lv: s[i:] for lv, s in sizes.items()},
                              work_s=work_s, dppl=dppl, deadline_s=deadline_s - now,
                              backlog_s=max(0.0, receiver_free - now), peak_bandwidth=est.peak(), beside=beside)
        level = rule(situation).level
        nbytes = sizes[level][i]
        arrived = now + nbytes / rate[i]
        est.add(nbytes, now, arrived)
        if level in beside:
            aside_free = max(aside_free, arrived) + work_s[level]
        else:
            receiver_free = max(receiver_free, arrived) + work_s[level]
        levels.append(level)
        now = arrived
    end = max(receiver_free, aside_free)
    return SimResult(end, end <= deadline_s, tuple(levels), sum(dppl[lv] for lv in levels) / n)
