"""The daemon's codec side: a process pool that encodes a chunk at every stored level and
decodes whatever level a chunk arrives at, off the event loop (coding holds the GIL for much
of each call), plus this host's measured decode rate, which it tells senders in each FETCH."""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from codec import baselines
from codec.tuning import catalog, levels as codec_levels, registry
from codec.errors import CodecError
from codec.pool.parallel import CodecPool, WorkerLost
from codec.profile import Profile

log = logging.getLogger(__name__)

# What one core decodes at the entropy-coded levels (codec.tuning.catalog): a prior for the first
# FETCH, replaced by what this host measures.
PRIOR_MBPS_PER_WORKER = catalog.DECODE_MBPS_PER_CORE
# A decode of less fp16 than this (MB) is mostly hand-over overhead: not timed into the rate.
MIN_TIMED_MB = 1.0
# A GPU decodes tens of GB/s (scripts/gpu_check.sh); per chunk, launch and upload costs bound it.
PRIOR_GPU_MBPS = 2000.0


class _Shares:
    """Each running decode's share of the wall clock: the integral of dt / (decodes running)
    over its run. Overlapping decodes (a fetch keeps two in flight, other fetches add theirs)
    then add up to the pool's throughput, where their wall times would each count the others'
    work; a decode alone gets its wall time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, float] = {}
        self._t = time.perf_counter()
        self._next = 0

    def _advance(self) -> None:
        now = time.perf_counter()
        if self._running:
            d = (now - self._t) / len(self._running)
            for k in self._running:
                self._running[k] += d
        self._t = now

    @contextmanager
    def timed(self) -> Iterator[list[float]]:
        """with shares.timed() as share: ...; share[0] is the block's share once it has left."""
        share = [0.0]
        with self._lock:
            self._advance()
            key = self._next = self._next + 1
            self._running[key] = 0.0
        try:
            yield share
        finally:
            with self._lock:
                self._advance()
                share[0] = self._running.pop(key)


class DecodeTally:
    """One fetch's coded decodes, summed: MB of fp16 out and their shares of the wall clock
    (_Shares). Coder.observe() takes the sum as one sample when the fetch ends: timed chunk by
    chunk, the moving average leant to a fetch's last decodes, which run as the receiving
    winds down and went 7-15% faster than the fetch's decoding as a whole (1000 Mbit/s, 8192
    tokens: told 119-129 MB/s where the fetch's 12 `high` chunks decoded at ~110), and the
    sender's plan, trusting it, sent one `high` chunk too many."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.mb = 0.0
        self.seconds = 0.0

    def add(self, mb: float, seconds: float) -> None:
        with self._lock:
            self.mb += mb
            self.seconds += seconds


class Coder:
    def __init__(self, workers: int, profile_path: Path | None = None,
                 warm_levels: tuple[str, ...] = codec_levels.LADDER, pool: CodecPool | None = None) -> None:
        """pool: a running CodecPool to code with instead of starting one of `workers` workers
        (it is taught profile_path, and left running by close(): its owner closes it); several
        coders may share one, as the tests' in-process daemons do."""
        self.profile: Profile | None = None
        if profile_path is not None:
            self.profile = registry.register(Profile.load(profile_path))
        warm = tuple(lv for lv in warm_levels if lv in codec_levels.LEVELS)
        self._owns_pool = pool is None
        if pool is None:
            pool = CodecPool(workers, (str(profile_path),) if profile_path else (), warm_levels=warm)
        elif profile_path is not None:
            pool.add_profile(profile_path, warm)
        self.pool = pool
        self.workers = workers = pool.workers
        self._lock = threading.Lock()
        self._mbps = PRIOR_MBPS_PER_WORKER * workers * 0.8  # processes share more than cores
        self._samples = 0
        self._gpu_mbps = PRIOR_GPU_MBPS
        self._gpu_samples = 0
        self._shares = _Shares()  # what the CPU decodes' rate is measured in

    def profile_for(self, model_id: str) -> Profile:
        """The configured profile if it is for model_id, else the registry's (the user folder's,
        else the shipped one: codec.tuning.registry); CodecError if none."""
        if self.profile is not None and self.profile.model_id == model_id:
            return self.profile
        return registry.for_model(model_id)

    @property
    def decode_mbps(self) -> float:
        """MB/s of fp16 KV this host decodes at the entropy-coded levels (moving average)."""
        return self._mbps

    @property
    def decode_samples(self) -> int:
        """Samples decode_mbps has taken on the CPU (a fetch's decodes together, or one decode
        outside a fetch; of over 1 MB each); 0: it is still the prior."""
        return self._samples

    def rate(self, gpu: bool = False) -> float:
        """decode_mbps, or the GPU's when a fetch decodes there."""
        return self._gpu_mbps if gpu else self._mbps

    def observe(self, mb: float, seconds: float, gpu: bool = False, alpha: float | None = None) -> None:
        """One decode's size and time (or a fetch's decodes together, DecodeTally), into the
        moving average senders are told; `alpha`: the sample's weight (default: 0.5 for the
        first few samples, then 0.2)."""
        if seconds <= 0 or mb <= MIN_TIMED_MB:
            return
        with self._lock:
            if gpu:
                self._gpu_samples += 1
                alpha = alpha or (0.5 if self._gpu_samples < 4 else 0.2)
                self._gpu_mbps = (1 - alpha) * self._gpu_mbps + alpha * (mb / seconds)
            else:
                self._samples += 1
                alpha = alpha or (0.5 if self._samples < 4 else 0.2)
                self._mbps = (1 - alpha) * self._mbps + alpha * (mb / seconds)

    def warm_for(self, profile: Profile) -> None:
        """A put of per-chunk scales begins for `profile`: have the workers build the tables of
        its rate control's scales in the background (CodecPool.warm_grid), once. (A fetch needs
        no call: the pool starts it at the first chunk it decodes at a scale of its own.)"""
        self.pool.warm_grid(profile)

    def warm_all(self) -> None:
        """warm_for every profile this node codes with: the configured one, and the registry's
        choice for each model it knows ([codec] warm_tables = "start")."""
        for prof in {p.id: p for p in [*registry.current(), *filter(None, [self.profile])]}.values():
            self.warm_for(prof)

    def staged(self, shape: tuple[int, ...], dtype: torch.dtype):
        """A context giving a tensor to fill with a chunk, which encode() then codes at every
        level where it lies (CodecPool.staged)."""
        return self.pool.staged(shape, dtype)

    def encode(self, kv: torch.Tensor, level: str, profile: Profile, start: int, scale: float | None = None,
               token_classes=None) -> bytes:
        """Blocking: one chunk at one level (named codec level or baseline scheme); `scale`: the
        chunk's own step scale at a codec level (codec.tuning.rate), else the level's; `token_classes`:
        uint8 [L, T], its tokens' step classes (codec.tuning.token_steps), where the put has them."""
        if not catalog.get(level).is_level:
            return baselines.SCHEMES[level].encode(kv)
        return self.pool.encode(kv, level, profile, start, scale, token_classes)

    def decode(self, level: str, payload: bytes | memoryview, tally: DecodeTally | None = None) -> torch.Tensor:
        """Blocking: CodecError for a payload that does not decode. Its time goes into the rate
        told to senders, or into `tally` (a fetch's, observed whole when the fetch ends)."""
        scheme = catalog.SCHEMES.get(level)
        if scheme is None:
            raise CodecError(f"unknown level {level!r}")
        if not scheme.is_level:
            return baselines.SCHEMES[level].decode(payload)
        try:
            with self._shares.timed() as share:
                kv = self.pool.decode(payload)
        except WorkerLost as e:  # twice: the fetch takes this chunk as TEXT, as for one that does not decode
            raise CodecError(f"decoding it cost a codec worker: {e}") from e
        self._timed(kv.numel() * 2 / 1e6, share[0], tally)
        return kv

    def decode_into(self, level: str, payload: bytes | memoryview, out: torch.Tensor, segment: str,
                    base: torch.Tensor, tally: DecodeTally | None = None) -> None:
        """Blocking: decode into `out`, a view of `base` (the shared-memory segment `segment`
        as one tensor); the codec workers write there directly. CodecError and `tally` as for
        decode()."""
        scheme = catalog.SCHEMES.get(level)
        if scheme is None:
            raise CodecError(f"unknown level {level!r}")
        if not scheme.is_level:  # a baseline scheme: in this thread, straight into out
            baselines.SCHEMES[level].decode_into(payload, out)
            return
        try:
            with self._shares.timed() as share:
                self.pool.decode_into(payload, out, segment, base)
        except WorkerLost as e:
            raise CodecError(f"decoding it cost a codec worker: {e}") from e
        self._timed(out.numel() * 2 / 1e6, share[0], tally)

    def _timed(self, mb: float, seconds: float, tally: DecodeTally | None) -> None:
        if tally is None:
            self.observe(mb, seconds)
        elif mb > MIN_TIMED_MB:
            tally.add(mb, seconds)

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()
