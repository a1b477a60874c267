"""`kvstreamd bench scale`: long contexts through two real daemons. Per shape and context length:
synthetic KV with a real model's statistics (kvstreamd.bench.gpu's SyntheticKV, a profile fitted
to it as `bench gpu` fits one) is put on daemon a through the client API, piece by piece, and
fetched by daemon b, which streams it from a over TCP on loopback into its shared-memory buffer.
Reported: seconds (put, fetch), bytes (fp16, stored, wire), peak memory of both daemons and of
the client, each phase apart (fresh daemons for every run), and the fetch's seconds per token.
Before the timed put and fetch, a WARMUP_CHUNKS-chunk context of its own goes through both
daemons: the codec workers build each stream's tables on first use, once per daemon.

Floors (pass/fail in the output and the JSON; the exit status is 1 when one fails):
- every fetch completes: all its tokens arrive as KV (in particular the longest, 100K tokens);
- receiver: b's peak memory during the fetch <= its buffer + 1.5 GiB;
- sender: a's peak memory (warm-up, put and fetch) <= the bytes it stores + 1.5 GiB;
- per token: the fetch's seconds per token at the longest context of the per-token shape are
  within 1.3x of those at its shortest (8K against 100K by default).

A daemon's memory is its process tree (the daemon and its codec workers): the peak of their
summed PSS (shared pages -- the fetch buffer, codec arenas, libraries -- split between the
processes that map them, so each byte counts once), sampled every SAMPLE_S from
/proc/PID/smaps_rollup. The summed RSS (shared pages counted once per process that maps them)
and the daemon process's own RSS and VmHWM are reported beside it.

The KV: POOL_CHUNKS distinct chunks of SyntheticKV (generated at positions 0..chunk_tokens,
so keys are post-RoPE), repeated along the context, each copy's keys rotated on to its own
absolute positions (RoPE is linear in position: moving a chunk from 0 to s turns every key by
the angles of s). Every chunk is coded on its own, so a copy costs what a fresh draw costs to
encode, store, send and decode, and the store keys chunks by their tokens (all distinct), not
their contents. Generating each chunk afresh takes minutes per GiB on two cores. Fitted
profiles are cached under $XDG_CACHE_HOME/kvstreamd/bench-scale/ (Llama-3-8B's shape takes
minutes to fit: 64 eigendecompositions of 1024 x 1024).

The file is long (~510 lines) because a synthetic 100K-token context has to be made, put, fetched
and measured on two cores within minutes, and each trick for that sits next to its reason."""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from codec import profile as profiles, rope

from .. import client as client_mod
from ..lab.daemons import DaemonProcess, wait_for
from ..limits import MAX_DEADLINE_MS
from ..store.keys import chunk_bounds
from .gpu import ROPE_THETA, SOURCE_PROFILE, SyntheticKV
from . import write_json

GiB = 2**30
SHAPES = {"small": (24, 2, 64), "llama8b": (32, 8, 128)}
DEFAULT_TOKENS = {"small": [8192, 32768, 102400], "llama8b": [8192, 32768]}
OTHER_TOKENS = [8192, 32768]  # a shape of the command line's own naming
SLACK = int(1.5 * GiB)  # the floors' allowance over the buffer (receiver) or store (sender)
PER_TOKEN_RATIO = 1.3
DEADLINE_MS = MAX_DEADLINE_MS  # the fetch moves the whole context at the one level, however long it takes
SAMPLE_S = 0.1
POOL_BYTES = 256 * 2**20  # distinct chunks kept: up to this many bytes of fp16 ...
POOL_CHUNKS = (2, 8)  # ... and between these many chunks
WARMUP_CHUNKS = 2


def parse_shape(text: str) -> tuple[str, tuple[int, int, int]]:
    """"small:24x2x64" -> ("small", (24, 2, 64)); "small" alone: SHAPES["small"]."""
    name, _, dims = text.partition(":")
    if not dims:
        if name not in SHAPES:
            raise ValueError(f"shape {text!r}: name:LAYERSxHEADSxHEAD_DIM, or one of {sorted(SHAPES)}")
        return name, SHAPES[name]
    try:
        layers, heads, head_dim = (int(x) for x in dims.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: name:LAYERSxHEADSxHEAD_DIM, e.g. small:24x2x64") from None
    if min(layers, heads, head_dim) < 1 or head_dim % 2:
        raise ValueError(f"shape {text!r}: sizes must be positive and the head dim even")
    return name, (layers, heads, head_dim)


def parse_tokens(items: list[str] | None, names: list[str]) -> dict[str, list[int]]:
    """--tokens entries: "small:8192,32768" for one shape, or plain counts for every shape that
    has no entry of its own. Shapes with neither get DEFAULT_TOKENS (or OTHER_TOKENS)."""
    own, common = {}, []
    for item in items or []:
        name, sep, counts = item.rpartition(":")
        values = [int(c) for c in counts.split(",") if c]
        if any(v < 1 for v in values) or not values:
            raise ValueError(f"--tokens {item!r}: token counts must be positive")
        if sep:
            if name not in names:
                raise ValueError(f"--tokens {item!r}: no shape named {name!r} (shapes: {names})")
            own.setdefault(name, []).extend(values)
        else:
            common.extend(values)
    return {n: own.get(n) or common or DEFAULT_TOKENS.get(n, OTHER_TOKENS) for n in names}


# -- memory ------------------------------------------------------------------------------------

def _rollup(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of one process; (0, 0) once it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return rss, pss


def vm_hwm(pid: int) -> int | None:
    """The process's lifetime peak RSS (VmHWM), bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Peaks:
    """Samples the named process trees in a thread; phase(name) keeps each phase's peaks apart:
    {name: {"rss": the root's own RSS, "tree_rss": summed RSS, "tree_pss": summed PSS}}. `alone`:
    processes measured without their children ({"rss", "pss"}: the client, whose children are
    the daemons)."""

    def __init__(self, pids: dict[str, int], alone: dict[str, int] | None = None, interval: float = SAMPLE_S) -> None:
        self.pids, self.alone, self.interval = pids, alone or {}, interval
        self.phases: dict[str, dict[str, dict[str, int]]] = {}
        self._current: dict[str, dict[str, int]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scale-rss", daemon=True)

    def sample(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, pid in self.pids.items():
            try:
                kids = [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                kids = []
            rss, pss = _rollup(pid)
            tree = [_rollup(k) for k in kids]
            out[name] = {"rss": rss, "tree_rss": rss + sum(r for r, _ in tree),
                         "tree_pss": pss + sum(p for _, p in tree), "processes": 1 + len(kids)}
        for name, pid in self.alone.items():
            rss, pss = _rollup(pid)
            out[name] = {"rss": rss, "pss": pss}
        return out

    def _record(self) -> None:
        s = self.sample()
        with self._lock:
            if self._current is None:
                return
            for name, vals in s.items():
                peak = self._current.setdefault(name, {})
                for k, v in vals.items():
                    peak[k] = max(peak.get(k, 0), v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._record()

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def phase(self, name: str):
        with self._lock:
            self._current = self.phases.setdefault(name, {})
        self._record()
        try:
            yield
        finally:
            self._record()
            with self._lock:
                self._current = None


# -- the KV ------------------------------------------------------------------------------------

def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvstreamd" / "bench-scale"


def fitted_profile(synth: SyntheticKV, fit_tokens: int, chunk_tokens: int, seed: int, cache: bool = True,
                   log=print) -> tuple[Path, profiles.Profile, float, bool]:
    """bench gpu's profile for this synthetic shape, from the cache when it was fitted before:
    (its file, the profile, seconds it took now, whether it came from the cache)."""
    source = profiles.Profile.load(SOURCE_PROFILE)
    key = hashlib.blake2b(repr((source.id.hex(), synth.layers, synth.heads, synth.head_dim, fit_tokens,
                                chunk_tokens, seed)).encode(), digest_size=8).hexdigest()
    path = _cache_dir() / f"L{synth.layers}-H{synth.heads}-D{synth.head_dim}-{key}.kvprofile"
    t0 = time.perf_counter()
    if cache and path.exists():
        try:
            return path, profiles.Profile.load(path), time.perf_counter() - t0, True
        except Exception as e:  # a torn file from an interrupted run: fit again
            log(f"cached profile {path} does not load ({e}); fitting again")
    prof = synth.fit(fit_tokens, chunk_tokens, seed=seed + 1_000_000_007)
    if not cache:
        path = Path(tempfile.mkdtemp(prefix="kvstreamd-scale-")) / path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    prof.save(tmp)
    os.replace(tmp, path)
    return path, profiles.Profile.load(path), time.perf_counter() - t0, False


class RepeatedKV:
    """A context's KV from a pool of distinct synthetic chunks (module docstring)."""

    def __init__(self, synth: SyntheticKV, chunk_tokens: int, seed: int) -> None:
        self.chunk_tokens = ct = chunk_tokens
        self.layers, self.heads, self.head_dim = synth.layers, synth.heads, synth.head_dim
        chunk_bytes = synth.layers * 2 * ct * synth.heads * synth.head_dim * 2
        n = min(max(POOL_BYTES // chunk_bytes, POOL_CHUNKS[0]), POOL_CHUNKS[1])
        self.pool = [synth.kv(0, ct, seed + i) for i in range(n)]

    @property
    def token_bytes(self) -> int:
        return self.layers * 2 * self.heads * self.head_dim * 2

    def chunk(self, i: int, tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk i (positions i*chunk_tokens ..), its first `tokens` tokens, written into out
        ([L, 2, tokens, H, D] fp16) when given."""
        src = self.pool[i % len(self.pool)][:, :, :tokens]
        out = torch.empty_like(src) if out is None else out
        out[:, 1] = src[:, 1]
        s = i * self.chunk_tokens
        half = self.head_dim // 2
        inv_freq = rope.default_inv_freq(ROPE_THETA, self.head_dim)
        angle = s * inv_freq  # float64: s up to ~1e5 times frequencies near 1
        cos, sin = angle.cos().float(), angle.sin().float()
        group = max(1, (32 << 20) // (tokens * self.heads * self.head_dim * 4))  # layers at once: small temporaries
        for l0 in range(0, self.layers, group):
            x = src[l0:l0 + group, 0].float()
            x1, x2 = x[..., :half], x[..., half:]
            out[l0:l0 + group, 0, ..., :half] = x1 * cos - x2 * sin
            out[l0:l0 + group, 0, ..., half:] = x2 * cos + x1 * sin
        return out

    def piece(self, start: int, stop: int) -> torch.Tensor:
        """KV of tokens start..stop (start on a chunk boundary)."""
        ct = self.chunk_tokens
        out = torch.empty(self.layers, 2, stop - start, self.heads, self.head_dim, dtype=torch.float16)
        for s in range(start, stop, ct):
            n = min(ct, stop - s)
            self.chunk(s // ct, n, out[:, :, s - start:s - start + n])
        return out


def _tokens(n: int, seed: int) -> list[int]:
    """n token ids, all chunks distinct (the keys chain over them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**17, (n,), generator=g).tolist()


# -- one run -----------------------------------------------------------------------------------

@dataclass
class Setup:
    name: str
    layers: int
    heads: int
    head_dim: int
    model_id: str
    profile_path: Path
    kv: RepeatedKV


def _daemons(root: Path, setup: Setup, level: str, chunk_tokens: int, workers: int):
    codec = {"chunk_tokens": chunk_tokens, "levels": [level], "workers": workers,
             "profile": str(setup.profile_path), "device": "cpu"}
    a = DaemonProcess("a", root / "a", extra={"codec": codec})
    b = DaemonProcess("b", root / "b", extra={"codec": codec})
    a.peers, b.peers = [b.addr], [a.addr]
    return a, b


def one(setup: Setup, tokens: int, root: Path, level: str, chunk_tokens: int, workers: int, seed: int,
        log=print) -> dict:
    """Put `tokens` tokens of setup's KV on a fresh daemon a, fetch them on a fresh daemon b."""
    ct = chunk_tokens
    toks = _tokens(tokens, seed + tokens)
    raw = tokens * setup.kv.token_bytes
    piece_tokens = max(1, client_mod.PUT_PIECE_BYTES // (setup.kv.token_bytes * ct)) * ct
    a, b = _daemons(root, setup, level, ct, workers)
    try:
        a.start(wait=0)
        b.start(wait=0)
        a.wait_healthy()
        b.wait_healthy()
        wait_for(lambda: b.client(timeout=10).status()["peers_connected"], timeout=60, what="b to connect to a")
        ca, cb = a.client(timeout=3600), b.client(timeout=3600)
        with Peaks({"a": a.proc.pid, "b": b.proc.pid}, alone={"client": os.getpid()}) as peaks:
            # -- warm-up: a short other context through both, so that what a daemon does once
            # (its codec workers build each stream's tables on first use: seconds for a
            # 1024-channel shape) is not in the timed put and fetch ---------------------------
            with peaks.phase("warmup"):
                t0 = time.perf_counter()
                wtoks = _tokens(WARMUP_CHUNKS * ct, seed - 1)
                ca.put(setup.model_id, wtoks, setup.kv.piece(0, len(wtoks)))
                wait_for(lambda: cb.lookup(setup.model_id, wtoks)["found_tokens"] == len(wtoks), timeout=60,
                         what="b to learn that a holds the warm-up context")
                with cb.fetch(setup.model_id, wtoks, deadline_ms=DEADLINE_MS, levels=[level]) as f:
                    f.wait()
                warmup_s = time.perf_counter() - t0
            log(f"  warm-up ({WARMUP_CHUNKS} chunks put and fetched): {warmup_s:.1f} s")
            # -- put: on a, piece by piece (each piece made just before its put) --------------
            put_s = synth_s = 0.0
            with peaks.phase("put"):
                for s in range(0, tokens, piece_tokens):
                    e = min(s + piece_tokens, tokens)
                    t0 = time.perf_counter()
                    piece = setup.kv.piece(s, e)
                    t1 = time.perf_counter()
                    reply = ca.put(setup.model_id, toks[:e], piece, start=s)
                    put_s += time.perf_counter() - t1
                    synth_s += t1 - t0
                    del piece
                    log(f"  put {e}/{tokens} tokens ({put_s:.1f} s in puts, {synth_s:.1f} s making KV)")
            stored_chunks = reply["stored_chunks"]
            contexts = ca.contexts()
            stored = sum(c["bytes"] for c in contexts)  # a's store: this context and the warm-up's
            context_bytes = max(contexts, key=lambda c: c["tokens"])["bytes"]
            store_a = ca.status()["store"]
            wait_for(lambda: cb.lookup(setup.model_id, toks)["found_tokens"] == tokens, timeout=60,
                     what="b to learn that a holds the context")
            # -- fetch: on b, from a, into b's buffer ------------------------------------------
            with peaks.phase("fetch"):
                t0 = time.perf_counter()
                with cb.fetch(setup.model_id, toks, deadline_ms=DEADLINE_MS, levels=[level]) as f:
                    first_event_s = time.perf_counter() - t0
                    end = f.wait()
                    fetch_s = time.perf_counter() - t0
                    buffer_bytes = math.prod(f.start.shape) * 2 if f.start.buffer else 0
                    sources = sorted({ev.source for ev in f.events})
                    n_chunks = len(f.events)
                    max_rel = _check(setup.kv, f.kv, tokens, ct) if f.kv is not None else None
                log(f"  fetch of {tokens} tokens: {fetch_s:.2f} s, {end.bytes / 2**20:.1f} MiB from {sources}")
        hwm = {"a": vm_hwm(a.proc.pid), "b": vm_hwm(b.proc.pid)}
    finally:
        for d in (b, a):
            d.stop()
    shutil.rmtree(root, ignore_errors=True)

    complete = end.kv_tokens == tokens and end.text_tokens == 0 and not end.errors and n_chunks == -(-tokens // ct)
    receiver_peak = peaks.phases["fetch"]["b"]["tree_pss"]
    sender_peak = max(peaks.phases[p]["a"]["tree_pss"] for p in ("warmup", "put", "fetch"))
    return {
        "shape": setup.name, "layers": setup.layers, "heads": setup.heads, "head_dim": setup.head_dim,
        "tokens": tokens, "chunks": n_chunks, "fp16_bytes": raw, "buffer_bytes": buffer_bytes,
        "stored_bytes": context_bytes, "store_bytes_a": stored, "stored_chunks": stored_chunks,
        "warmup_s": round(warmup_s, 3), "wire_bytes": end.bytes,
        "bits_per_element": round(context_bytes * 8 / (raw / 2), 4),
        "store_a": {k: store_a[k] for k in ("memory_bytes", "disk_bytes", "memory_chunks", "disk_chunks")},
        "make_kv_s": round(synth_s, 3), "put_s": round(put_s, 3), "put_requests": -(-tokens // piece_tokens),
        "fetch_s": round(fetch_s, 3), "fetch_first_event_s": round(first_event_s, 3),
        "fetch_s_per_token": fetch_s / tokens, "fetch_us_per_token": round(fetch_s / tokens * 1e6, 3),
        "fetch_timings": end.timings, "levels": sorted(set(end.levels)), "sources": sources,
        "kv_tokens": end.kv_tokens, "text_tokens": end.text_tokens, "errors": end.errors,
        "max_rel_err": max_rel, "peak": peaks.phases, "vm_hwm": hwm,
        "floors": {
            "fetch_complete": complete,
            "receiver_memory": {"peak": receiver_peak, "limit": buffer_bytes + SLACK,
                                "pass": receiver_peak <= buffer_bytes + SLACK},
            "sender_memory": {"peak": sender_peak, "limit": stored + SLACK, "pass": sender_peak <= stored + SLACK},
        },
    }


def _check(kv: RepeatedKV, got: torch.Tensor, tokens: int, ct: int) -> float:
    """Largest relative error of the first, a middle and the last chunk as fetched."""
    worst = 0.0
    bounds = chunk_bounds(tokens, ct)
    n = len(bounds)
    for i in sorted({0, n // 2, n - 1}):
        s, e = bounds[i]
        want = kv.chunk(i, e - s)
        scale = float(want.abs().max())
        for layer in range(want.shape[0]):  # a layer at a time: no float copy of a whole chunk
            diff = (got[layer, :, s:e].float() - want[layer].float()).abs().max()
            worst = max(worst, float(diff) / scale)
    return round(worst, 6)


# -- the benchmark -----------------------------------------------------------------------------

def run(shapes: list[tuple[str, tuple[int, int, int]]] | None = None, tokens: dict[str, list[int]] | None = None,
        level: str = "high", chunk_tokens: int = 1024, workers: int = 0, per_token_shape: str | None = None,
        fit_tokens: int | None = None, cache_profiles: bool = True, seed: int = 0, json_path: str | None = None,
        root: str | Path | None = None, log=print) -> dict:
    shapes = shapes or list(SHAPES.items())
    names = [n for n, _ in shapes]
    if len(set(names)) < len(names):
        raise ValueError(f"shape names must differ: {names}")
    tokens = tokens or parse_tokens(None, names)
    per_token_shape = per_token_shape or names[0]
    if per_token_shape not in names:
        raise ValueError(f"per-token shape {per_token_shape!r} is not one of {names}")
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    runs, shape_info = [], {}
    base = Path(root) if root else Path(tempfile.mkdtemp(prefix="kvstreamd-scale-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        for name, (layers, heads, head_dim) in shapes:
            C = heads * head_dim
            fit = fit_tokens or max(256, 2 * C)
            t0 = time.perf_counter()
            synth = SyntheticKV(profiles.Profile.load(SOURCE_PROFILE), layers, heads, head_dim, seed)
            path, prof, fit_s, cached = fitted_profile(synth, fit, chunk_tokens, seed, cache_profiles, log)
            kv = RepeatedKV(synth, chunk_tokens, seed)
            del synth
            setup_s = time.perf_counter() - t0
            log(f"{name} L={layers} H={heads} D={head_dim}: profile {'from the cache' if cached else 'fitted'} "
                f"({fit_s:.1f} s; {path}), {len(kv.pool)} distinct chunks; set up in {setup_s:.1f} s")
            shape_info[name] = {"layers": layers, "heads": heads, "head_dim": head_dim, "model_id": prof.model_id,
                                "fit_tokens": fit, "profile_cached": cached, "fit_s": round(fit_s, 3),
                                "setup_s": round(setup_s, 3), "pool_chunks": len(kv.pool)}
            setup = Setup(name, layers, heads, head_dim, prof.model_id, path, kv)
            del prof  # the daemons load it; here only its model id was wanted
            for n in tokens[name]:
                log(f"{name}, {n} tokens ({n * kv.token_bytes / GiB:.2f} GiB of fp16 KV):")
                runs.append(one(setup, n, base / f"{name}-{n}", level, chunk_tokens, workers, seed, log))
            del setup, kv
    finally:
        if root is None:
            shutil.rmtree(base, ignore_errors=True)

    report = {"level": level, "chunk_tokens": chunk_tokens, "workers": workers or os.cpu_count(),
              "cpus": os.cpu_count(), "memory_total": psutil.virtual_memory().total,
              "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
              "slack_bytes": SLACK, "memory_metric": "tree_pss", "shapes": shape_info, "runs": runs,
              "total_s": round(time.perf_counter() - t_start, 1)}
    report["per_token"], report["floors"] = _floors(runs, per_token_shape)
    report["pass"] = all(f["pass"] for f in report["floors"].values())
    write_json(report, json_path)
    return report


def _floors(runs: list[dict], shape: str) -> tuple[dict, dict]:
    mine = sorted((r for r in runs if r["shape"] == shape), key=lambda r: r["tokens"])
    per_token = {"shape": shape, "us_per_token": {str(r["tokens"]): r["fetch_us_per_token"] for r in mine}}
    floors: dict[str, dict] = {}
    if mine:
        lo, hi = mine[0], mine[-1]
        ratio = hi["fetch_s_per_token"] / lo["fetch_s_per_token"]
        per_token.update({"from_tokens": lo["tokens"], "to_tokens": hi["tokens"], "ratio": round(ratio, 4)})
        floors["fetch_completes_longest"] = {"shape": shape, "tokens": hi["tokens"],
                                             "pass": hi["floors"]["fetch_complete"]}
        floors["per_token"] = {"from_tokens": lo["tokens"], "to_tokens": hi["tokens"], "ratio": round(ratio, 4),
                               "limit": PER_TOKEN_RATIO, "pass": ratio <= PER_TOKEN_RATIO}
    floors["fetch_completes_all"] = {"failed": [f"{r['shape']}:{r['tokens']}" for r in runs
                                                if not r["floors"]["fetch_complete"]]}
    for k in ("receiver_memory", "sender_memory"):
        floors[k] = {"failed": [f"{r['shape']}:{r['tokens']}" for r in runs if not r["floors"][k]["pass"]]}
    for k in ("fetch_completes_all", "receiver_memory", "sender_memory"):
        floors[k]["pass"] = not floors[k]["failed"]
    return per_token, floors


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def table(report: dict) -> str:
    head = (f"{'shape':8} {'tokens':>7} {'fp16 GiB':>8} {'stored':>7} {'wire':>7} {'bits/el':>7} {'put s':>7} "
            f"{'fetch s':>7} {'us/tok':>7} | {'a put':>6} {'a fetch':>7} {'b fetch':>7} {'buffer':>6} "
            f"{'client':>6}  floors")
    lines = [head, "-" * len(head)]
    for r in report["runs"]:
        p = r["peak"]
        fl = r["floors"]
        ok = lambda b: "ok" if b else "FAIL"  # noqa: E731
        lines.append(
            f"{r['shape']:8} {r['tokens']:>7} {r['fp16_bytes'] / GiB:>8.2f} {_gib(r['stored_bytes']):>7} "
            f"{_gib(r['wire_bytes']):>7} {r['bits_per_element']:>7.3f} {r['put_s']:>7.1f} {r['fetch_s']:>7.2f} "
            f"{r['fetch_us_per_token']:>7.1f} | {_gib(p['put']['a']['tree_pss']):>6} "
            f"{_gib(p['fetch']['a']['tree_pss']):>7} {_gib(p['fetch']['b']['tree_pss']):>7} "
            f"{_gib(r['buffer_bytes']):>6} {_gib(max(p['put']['client']['rss'], p['fetch']['client']['rss'])):>6}  "
            f"complete {ok(fl['fetch_complete'])}, b {ok(fl['receiver_memory']['pass'])}, "
            f"a {ok(fl['sender_memory']['pass'])}")
    lines.append("(GiB; memory: peak PSS of the daemon and its codec workers, each phase apart; client: peak RSS)")
    pt = report["per_token"]
    if "ratio" in pt:
        lines.append(f"\nfetch us/token on {pt['shape']}: "
                     + ", ".join(f"{t}: {v:.1f}" for t, v in pt["us_per_token"].items())
                     + f"; {pt['to_tokens']} vs {pt['from_tokens']}: {pt['ratio']:.2f}x")
    lines.append("floors: " + ", ".join(f"{k} {'pass' if v['pass'] else 'FAIL'}" for k, v in report["floors"].items()))
    lines.append(f"load average {report['loadavg_start']} at the start, {report['loadavg_end']} at the end; "
                 f"{report['total_s']:.0f} s in all")
    return "\n".join(lines)
