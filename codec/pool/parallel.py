"""Encode and decode a chunk's independent substreams across worker processes.

The substreams' Python and torch work holds the GIL for much of a call (and constriction all
of it), so threads do not help; processes do. Tensors and bitstreams cross to the workers
through shared-memory segments the pool reuses, so only names and indices travel over the
pool's pipes, and a decoded chunk is returned as a view of its segment rather than copied out.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Iterator

import numpy as np
import torch

from .. import bitstream as bs, cachegen, decoder
from ..errors import CodecError
from ..profile import Profile
from ..tuning import levels, named, rate, registry
from .quiet import Quiet
from .segments import Arena, Destination, open_segment, worker_map
from .warm import learn_profile, level_tables, scale_tables, split, streams_with_tables, table_steps

log = logging.getLogger(__name__)


def _exit_with_parent(parent: int) -> None:
    """A worker holds both ends of the pool's call queue, so it never sees EOF when its parent is
    SIGKILLed: watch for being re-parented instead, and go."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _anon_bytes() -> int:
    """This process's resident anonymous memory (resident less file-backed and shared pages)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


_TRIM = _malloc_trim()
TRIM_GROWTH_BYTES = 64 << 20  # a worker whose anonymous memory grew this much since its last trim trims
_anon_at_trim = 0


def _job(fn, *args):
    """fn(*args) in a worker, its freed heap handed back to the system after it when the
    worker's memory grew by TRIM_GROWTH_BYTES since it last did. A chunk's temporaries (hundreds
    of MB at a Llama-3-8B shape) are freed between live results and tables, and glibc keeps
    such holes mapped, so each worker would hold its largest job's memory from then on (~390 MB
    a worker, docs/benchmarks.md "bench scale"). Not after every job: a trim costs a 3-layer
    Gemma-3 chunk's decode 1-3 ms (its next temporaries fault their pages in again)."""
    global _anon_at_trim
    try:
        return fn(*args)
    finally:
        if _TRIM is not None and _anon_bytes() - _anon_at_trim > TRIM_GROWTH_BYTES:
            _TRIM(0)
            _anon_at_trim = _anon_bytes()


def _init_worker(index: int, workers: int, profile_paths: tuple[str, ...], warm_levels: tuple[str, ...]) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    # Ctrl-C at a terminal signals the whole process group. The pool's owner stops its workers
    # (close(), or the parent watch when it dies): a worker takes no KeyboardInterrupt of its own
    # (each printed its traceback before `kvstreamd run` said "stopped").
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    # The parent read the same folders (CodecPool) and warned of a file there that does not
    # load: not once more per worker.
    logging.getLogger(registry.__name__).setLevel(logging.ERROR)
    given = [registry.register(Profile.load(p)) for p in profile_paths]
    known = {p.id: p for p in given + registry.current()}  # the pool's own, and each model's by precedence
    level_tables(index, workers, list(known.values()), warm_levels)


def _decode_part(name: str, size: int, out_bytes: int, data_len: int, streams: range) -> None:
    mm = worker_map(name, size)
    # decode_many checked the CRC of these bytes before it wrote them here
    h, profile = named.read(memoryview(mm)[out_bytes:out_bytes + data_len], check_crc=False)
    out = torch.frombuffer(mm, dtype=h.dtype, count=out_bytes // h.dtype.itemsize).view(h.shape)
    decoder.for_profile(profile).decode_streams(h, streams, out)
    del out, h


def _decode_into(dest: Destination, name: str, size: int, data_len: int, streams: range) -> None:
    mm = worker_map(name, size)
    h, profile = named.read(memoryview(mm)[:data_len], check_crc=False)  # checked by decode_into
    # The destination is mapped for this job only: a worker that kept it would keep the fetch
    # buffer's memory alive after the daemon and the model process have let it go.
    _, out_mm = open_segment(dest.size, dest.segment)
    try:
        base = torch.frombuffer(out_mm, dtype=getattr(torch, dest.dtype))
        out = base.as_strided(dest.shape, dest.strides, dest.offset // base.element_size())
        decoder.for_profile(profile).decode_streams(h, streams, out)
        del out, base, h
    finally:
        try:
            out_mm.close()
        except BufferError:  # a view outlived the job (an exception's traceback): closed when it goes
            pass


def _encode_part(name: str, size: int, shape: tuple, dtype_code: int, transforms: int, steps: np.ndarray,
                 anchor_step: float, profile_id: bytes, layer_ids: tuple[int, ...] | None, start: int,
                 sink_rows: int, streams: range, classes: np.ndarray | None = None) -> list[bytes]:
    mm = worker_map(name, size)
    kv = torch.frombuffer(mm, dtype=bs.DTYPES[dtype_code], count=int(np.prod(shape))).view(shape)
    profile = registry.find(profile_id)
    if layer_ids is not None:  # a chunk of some layers: coded with those layers' tables, as its header says
        profile = profile.whole().subset(layer_ids)
    angles = cachegen.key_angles(transforms, start, sink_rows, shape[2], profile)
    res = [cachegen.encode_stream(kv[s // 2, s % 2], s // 2, s % 2, transforms, steps, anchor_step, start, sink_rows,
                                  profile, angles, None if classes is None else classes[s // 2]) for s in streams]
    del kv
    return res


class WorkerLost(RuntimeError):
    """A codec worker process died (killed, out of memory) under the same job twice: the job
    fails with this, naming how the worker died, and the pool has replaced its workers."""


class CodecPool:
    """A pool of codec worker processes. `decode(data)` and `encode(kv, ...)` give the same
    results as codec.decode / codec.encode, split across the workers by substream: worker k
    always codes run k of a chunk's streams (split()), so each keeps the tables of its share
    of the streams only. Each worker is a one-process executor of its own.

    A worker that dies (the OOM killer, a stray SIGKILL) breaks its ProcessPoolExecutor for
    good, so the pool replaces the executors: a watcher thread does it as soon as a worker
    dies, and a job that saw it die is run once more on the new workers (coding is a pure
    function of the job's segments, so a rerun gives the same bytes). `fault()` says why the
    pool is short of workers while it is."""

    def __init__(self, workers: int | None = None, profile_paths: tuple[str, ...] = (),
                 warm_levels: tuple[str, ...] = levels.LADDER):
        self.workers = workers or os.cpu_count() or 1
        registry.current()  # the profile folders read here first, so that a bad file is reported once
        self._initargs = (tuple(map(str, profile_paths)), tuple(warm_levels))
        self._profile_ids = {Profile.load(p).id for p in self._initargs[0]}  # what the workers know (add_profile)
        self._learning = threading.Lock()
        self._arena = Arena()
        self._staged: dict[int, tuple[str, int]] = {}  # data_ptr of a staged() tensor -> its segment, size
        self._lock = threading.Lock()  # held while the workers are replaced
        self._closed = False
        self._replacing: str | None = None  # why the workers are being replaced, while they are
        self._start_failed: str | None = None  # why the last replacement could not start workers
        self.restarts = 0  # times the workers were replaced
        self.last_loss: str | None = None  # how a worker last died
        self._lost: tuple[list[cf.ProcessPoolExecutor], str] | None = None  # the last broken executors, and why
        self.grid_warm: set[bytes] = set()  # the profiles whose grid scales' tables are built (warm_grid)
        self._grid_started: set[bytes] = set()
        self._grid_given_up: set[bytes] = set()  # warming stopped short (best effort)
        self._grid_lock = threading.Lock()
        self._quiet = Quiet()  # warming waits for the coding jobs
        self._pool = self._start()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="codec-pool-watch")
        self._watcher.start()

    def warm_grid(self, profile: Profile) -> None:
        """Start building, in the background, each worker's share of the tables of every scale
        rate control may give a chunk of `profile` (codec.tuning.rate.grid_scales; nothing for a profile
        not tuned for it), nearest the levels' own scales first, one job a worker at a time. A
        chunk at a scale its worker has not coded yet builds those tables in the middle of a
        fetch (0.07 s of one core for SmolLM2's 60 streams: `kvstreamd bench tables`). It
        yields to coding: a scale's job starts once the workers have coded nothing for
        quiet.QUIET_S (35 scales of SmolLM2 are 2.4 s of one worker). Called as a put with costs begins (kvstreamd.coder) and at the first
        chunk decoded at a scale of its own (warm_for_chunk): a daemon that never codes or decodes
        per-chunk scales (a vLLM connector's chunks) never spends the CPU; once per profile."""
        with self._grid_lock:
            if profile.id in self._grid_started or not rate.tuned(profile):
                return
            self._grid_started.add(profile.id)
        threading.Thread(target=self._warm_grid, args=(profile,), daemon=True, name="codec-pool-warm").start()

    def warm_for_chunk(self, h: bs.Header) -> None:
        """warm_grid for a chunk coded at a scale of its own (rate.own_scale): more are likely coming."""
        if h.profile_id not in self._grid_started and rate.own_scale(h, whole := registry.find(h.profile_id)):
            self.warm_grid(whole)

    @property
    def warming(self) -> bool:
        """Some profile's grid tables are being built (warm_grid)."""
        with self._grid_lock:
            return bool(self._grid_started - self.grid_warm - self._grid_given_up)

    def _warm_grid(self, profile: Profile) -> None:
        for scale in rate.grid_scales(profile):
            if not self._quiet.wait() or self._closed:
                with self._grid_lock:
                    self._grid_given_up.add(profile.id)
                return
            try:
                self._run([(k, scale_tables, k, self.workers, profile.id, scale) for k in range(self.workers)],
                          coding=False)
            except Exception:  # the pool closing, or its workers lost twice: warming is best effort
                with self._grid_lock:
                    self._grid_given_up.add(profile.id)
                return
        with self._grid_lock:
            self.grid_warm.add(profile.id)

    def _start(self) -> list[cf.ProcessPoolExecutor]:
        ctx = mp.get_context("spawn")
        pools = [cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker,
                                        initargs=(k, self.workers, *self._initargs)) for k in range(self.workers)]
        # Start the workers now (spawn + warm-up take seconds), not inside the first request.
        try:
            for f in [pool.submit(os.getpid) for pool in pools]:
                f.result()
        except BaseException:
            for pool in pools:
                pool.shutdown(wait=False, cancel_futures=True)
            raise
        return pools

    # -- worker deaths -----------------------------------------------------------------------

    def pids(self) -> list[int]:
        """The worker processes' pids."""
        return [pid for pool in self._pool for pid in (pool._processes or ())]

    def fault(self) -> str | None:
        """Why the pool is short of workers now (one died and is being replaced, or new ones
        could not be started), or None."""
        return self._replacing or self._start_failed or self._dead(self._pool)

    @staticmethod
    def _procs(pools: list[cf.ProcessPoolExecutor]) -> list:
        # An executor keeps its processes in `_processes` (no public list).
        return [p for pool in pools for p in list((pool._processes or {}).values())]

    @classmethod
    def _dead(cls, pools: list[cf.ProcessPoolExecutor]) -> str | None:
        """How a worker of `pools` died, or None while all live (a process's sentinel is ready
        once it exited)."""
        procs = cls._procs(pools)
        try:
            gone = set(mp.connection.wait([p.sentinel for p in procs], timeout=0))
        except (OSError, ValueError):  # a process object closed under us: the pool is shutting down
            return None
        dead = [p for p in procs if p.sentinel in gone]
        if not dead:
            return "the codec worker processes were lost" if any(pool._broken for pool in pools) else None
        # A broken executor SIGTERMs the workers still alive: name the one that died first.
        dead.sort(key=lambda p: p.exitcode == -signal.SIGTERM)
        p = dead[0]
        for _ in range(20):  # None while the executor's thread is reaping it this instant
            if (code := p.exitcode) is not None:
                break
            time.sleep(0.005)
        else:
            return f"codec worker process {p.pid} died"
        if code < 0:
            return f"codec worker process {p.pid} was killed by {signal.Signals(-code).name}"
        return f"codec worker process {p.pid} exited with status {code}"

    def _watch(self) -> None:
        """Replace the workers as soon as one dies, whether or not a job was running on it."""
        backoff = 0.5
        while not self._closed:
            pool = self._pool
            try:
                mp.connection.wait([p.sentinel for p in self._procs(pool)], timeout=1.0)
            except (OSError, ValueError):
                time.sleep(0.1)
            if self._closed or cf.process._global_shutdown:  # workers go with the interpreter
                return
            why = self._dead(pool)
            if why is None:
                continue
            if self._replace(pool, why):
                backoff = 0.5
            else:
                time.sleep(backoff)
                backoff = min(2 * backoff, 30.0)

    def _replace(self, broken: list[cf.ProcessPoolExecutor], why: str) -> bool:
        """New workers for broken executors (once, whoever notices first); False if they
        could not be started (the next attempt is the watcher's)."""
        with self._lock:
            if self._pool is not broken or self._closed:
                return True
            self._replacing = why
            self._lost = (broken, why)
            log.warning("%s; starting new codec workers", why)
            for pool in broken:
                pool.shutdown(wait=False, cancel_futures=True)
            t0 = time.monotonic()
            try:
                self._pool = self._start()
            except Exception as e:
                self._start_failed = f"{why}; new codec workers could not be started: {type(e).__name__}: {e}"
                log.error("%s", self._start_failed)
                return False
            finally:
                self._replacing = None
            self._start_failed = None
            self.restarts += 1
            self.last_loss = why
            log.warning("codec workers replaced in %.1f s (%s)", time.monotonic() - t0, why)
            return True

    def _run(self, jobs: list[tuple], coding: bool = True) -> list:
        """[fn(*args) for (worker, fn, *args) in jobs], each in its worker. A worker that dies
        under them costs one rerun on new workers; dying again raises WorkerLost, saying how.
        coding: False for warming's jobs, which wait for the coding ones (Quiet)."""
        with self._quiet.coding() if coding else contextlib.nullcontext():
            for attempt in (1, 2):
                pool, futures = self._pool, []
                try:
                    futures = [pool[k].submit(_job, *job) for k, *job in jobs]
                    return [f.result() for f in futures]
                except BrokenProcessPool as e:
                    cf.wait(futures)
                    lost = self._lost
                    why = (lost[1] if lost is not None and lost[0] is pool else self._dead(pool)) \
                        or f"a codec worker process died ({e})"
                    self._replace(pool, why)
                    if attempt == 2:
                        raise WorkerLost(f"{why}, twice under the same job; the job is failed") from None
                    log.warning("%s; running the job again on new workers", why)
                except BaseException:
                    cf.wait(futures)  # the others still write into the job's segments
                    raise
            raise AssertionError("unreachable")

    def add_profile(self, path, warm_levels: tuple[str, ...] | None = None) -> None:
        """Teach every worker the profile in the file `path`, as if the pool had been started with
        it: registered, and its tables warmed at warm_levels (default: the pool's), now and in any
        workers started later (a replacement loads it at start). A profile the workers know
        already (the same content, from any file) costs nothing: so one pool can serve several
        coders that each name their profile, and learn profiles after it started."""
        prof = Profile.load(path)
        with self._learning:  # one at a time: a profile is learnt once
            if prof.id in self._profile_ids:
                return
            with self._lock:  # not while workers are replaced: they start with the paths as they are
                paths, at = self._initargs
                self._initargs = (paths + (str(path),), at)
            at = tuple(at if warm_levels is None else warm_levels)
            self._run([(k, learn_profile, k, self.workers, str(path), at) for k in range(self.workers)])
            self._profile_ids.add(prof.id)

    def table_steps(self, profile: Profile) -> list[list[tuple[int, float]]]:
        """Per worker, the (stream, step) pairs of `profile` it holds rANS tables for."""
        return self._run([(k, table_steps, profile.id) for k in range(self.workers)])

    def streams_with_tables(self, profile: Profile) -> list[list[int]]:
        """Per worker, the streams of `profile` it has built entropy models for."""
        return self._run([(k, streams_with_tables, profile.id) for k in range(self.workers)])

    def decode(self, data: bytes | memoryview, profile: Profile | None = None) -> torch.Tensor:
        return self.decode_many([data], profile)[0]

    def decode_many(self, chunks: list[bytes | memoryview], profile: Profile | None = None) -> list[torch.Tensor]:
        """Decode several chunks at once: every worker stays busy across chunk boundaries,
        which is how a fetch's decode stage sees them. Validation happens before any work."""
        headers = [named.read(data, profile)[0] for data in chunks]
        for h in headers:
            self.warm_for_chunk(h)
        taken, jobs = [], []
        try:
            for data, h in zip(chunks, headers):
                out_bytes = int(np.prod(h.shape)) * h.dtype.itemsize
                name, mm = self._arena.take(out_bytes + len(data))
                taken.append((name, mm, out_bytes))
                mm[out_bytes:out_bytes + len(data)] = data
                jobs += [(k, _decode_part, name, len(mm), out_bytes, len(data), run)
                         for k, run in enumerate(split(2 * h.layers, self.workers))]
            self._run(jobs)  # a failed chunk: _run lets the others finish before the segments are reused
        except BaseException:
            for name, mm, _ in taken:
                self._arena.give(name, mm)
            raise
        results = []
        for (name, mm, out_bytes), h in zip(taken, headers):
            # numpy holds the mapping and torch holds the array: when the last view of the
            # result goes, the array does, and the segment returns to the arena.
            arr = np.frombuffer(mm, np.uint8, count=out_bytes)
            weakref.finalize(arr, self._arena.give, name, mm)
            out = torch.from_numpy(arr).view(h.dtype).view(h.shape)
            decoder.fill_sink(h, out)
            results.append(out)
        return results

    def decode_into(self, data: bytes | memoryview, out: torch.Tensor, segment: str, base: torch.Tensor,
                    profile: Profile | None = None) -> None:
        """Decode one chunk into `out`, a view of `base` (the whole shared-memory segment
        `segment` as one tensor) shaped as the chunk: the workers write there directly, and
        nothing is copied after them. The values are decode()'s, in out's dtype. CodecError,
        before any write, for a chunk that does not decode or is not of out's shape."""
        h = named.read(data, profile)[0]
        self.warm_for_chunk(h)
        if tuple(h.shape) != tuple(out.shape):
            raise CodecError(f"chunk is {list(h.shape)}, its destination {list(out.shape)}")
        if h.dtype not in (out.dtype, torch.float32):
            # The decoder computes in float32: written straight into a wider buffer, a chunk
            # of fp16 would skip its own rounding, and decode() rounds to the chunk's dtype.
            out.copy_(self.decode_many([data], profile)[0])
            return
        dest = Destination.of(out, segment, base)
        name, mm = self._arena.take(len(data))
        try:
            mm[:len(data)] = data
            self._run([(k, _decode_into, dest, name, len(mm), len(data), run)
                       for k, run in enumerate(split(2 * h.layers, self.workers))])
        except FileNotFoundError:
            # The segment's name is gone (its owner let it go mid-fetch) but out's mapping is
            # still good: decode as decode() does and copy, as if nothing had happened.
            out.copy_(self.decode_many([data], profile)[0])
            return
        finally:
            self._arena.give(name, mm)
        decoder.fill_sink(h, out)

    @contextlib.contextmanager
    def staged(self, shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """A tensor in one of the pool's segments, for the caller to fill: encode() codes it
        where it lies, at every level asked, with no copy (what a put does with each chunk it
        reads from the client). The tensor must not be used after the block."""
        nbytes = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        name, mm = self._arena.take(nbytes)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
        self._staged[t.data_ptr()] = (name, len(mm))
        try:
            yield t
        finally:
            del self._staged[t.data_ptr()]
            del t
            self._arena.give(name, mm)

    def encode(self, kv: torch.Tensor, level: str = "balanced", profile: Profile | None = None, start: int = 0,
               scale: float | None = None, token_classes: np.ndarray | None = None) -> bytes:
        """codec.encode's chunk, its streams coded by the workers."""
        lv = levels.get(level)
        if lv.name not in levels.LEVELS:
            raise ValueError("the pool encodes named levels only")
        if profile is None:
            raise ValueError("encode needs the model's profile")
        profile.check_shape(kv.shape[0], kv.shape[3], kv.shape[4])
        kv = kv.contiguous()
        staged = self._staged.get(kv.data_ptr())
        taken = None
        if staged is None:  # copied into a segment of the pool's for the workers to read
            raw = kv.view(torch.uint8).reshape(-1).numpy()
            taken = self._arena.take(max(raw.nbytes, 1))
            np.frombuffer(taken[1], np.uint8, count=raw.nbytes)[:] = raw
            staged = (taken[0], len(taken[1]))
        try:
            h = cachegen.header_of(kv, named.coding(lv, profile, scale, token_classes), profile, start)
            h.substreams = [s for part in self._run([(k, _encode_part, *staged, tuple(kv.shape), bs.DTYPE_CODES[kv.dtype],
                                                      h.transforms, h.steps, h.anchor_step, profile.id, h.layer_ids,
                                                      start, h.sink_tokens, run, h.token_classes)
                                                     for k, run in enumerate(split(2 * h.layers, self.workers))])
                            for s in part]
        finally:
            if taken is not None:
                self._arena.give(*taken)
        return bs.pack(h)

    def close(self) -> None:
        self._closed = True  # before the workers go: the watcher must not replace them
        self._quiet.stop()  # warming stops waiting
        with self._lock:
            for pool in self._pool:
                pool.shutdown(wait=True, cancel_futures=True)
        self._arena.close()

    def __enter__(self) -> "CodecPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
