"""`kvstreamd bench gpu`: how fast codec/gpu.py decodes one whole context of a 7B-sized model
(default 32 layers x 8 KV heads x 128, 8192 tokens: 1 GiB of fp16 KV), and whether it decodes
exactly what the CPU codec does.

No 7B model runs here, so the KV is synthetic, made to give the entropy coder the symbol
statistics of a real model -- the shipped SmolLM2 profile's:
- per (layer, K/V) stream, PCA component standard deviations follow that profile's pca_sigma
  spectra, interpolated (in log) across layers and across relative component index to the new
  shape, so per-element variance and the spectrum's decay are SmolLM2's;
- each component's values are drawn from the pooled shape SmolLM2 measured for the nearest
  layer (pca_cdf, by inverse CDF: kurtosis 3 to 6, heavier-tailed than Gaussian);
- components are rotated into channels by a random orthonormal basis per stream and get
  SmolLM2's channel means (pca_mean, resampled per head); keys are made at position 0 and
  rotated to their absolute positions with rope.rerotate, as a model's cache holds them;
- a profile is fitted (codec.profile.fit) on a separate synthetic calibration set, with
  sensitivities chosen so its base steps are SmolLM2's interpolated ones, and SmolLM2's
  level scales. Channel weights are uniform (a random basis would average any out), so
  every component of a stream gets its step. The set holds twice as many tokens as a stream
  has channels: with as many tokens as channels the PCA never sees its trailing components
  and `high` costs ~4.5 bits/element; 2x gives ~2.6-2.9 (SmolLM2 itself: ~2.8), 4x ~2.4 for
  twice the fitting time.
Encoding uses all cores (a CodecPool); only the decode is timed. The output rate counts fp16
bytes of decoded KV. The decoded KV is compared with the CPU codec's in fp16, where 1e-3 of the
largest magnitude is about one unit in the last place of it.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from codec import gpu, profile as profiles, rope
from codec.tuning import registry, tuned
from codec.pool.parallel import CodecPool

from . import write_json

SOURCE_PROFILE = registry.SHIPPED_DIR / "smollm2-135m-instruct.kvprofile"
ROPE_THETA = 500000.0  # Llama-3-8B's; the codec un-rotates with whatever the profile says
QUANTILES = 1 << 16  # inverse-CDF table per stream: resolves tails to ~1e-5


def _resample(a: np.ndarray, n: int, axis: int) -> np.ndarray:
    """a resampled to n points along axis, linear in relative position (both ends kept). C-contiguous:
    safetensors writes an array's memory as it lies, so a strided one would land transposed in
    the profile file (and in the profile id, so nothing would notice)."""
    old, new = np.linspace(0.0, 1.0, a.shape[axis]), np.linspace(0.0, 1.0, n)
    return np.ascontiguousarray(np.apply_along_axis(lambda v: np.interp(new, old, v), axis, a.astype(np.float64)))


class SyntheticKV:
    """Post-RoPE KV [L, 2, T, H, D] with a real model's per-stream statistics (module docstring)."""

    def __init__(self, source: profiles.Profile, layers: int, heads: int, head_dim: int, seed: int = 0):
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.kl_budget, self.level_scales = float(source.meta["kl_budget"]), tuned.Tuning.of(source).level_scales
        L, C = layers, heads * head_dim
        t = source.tensors
        self.sigma = torch.from_numpy(np.exp(_resample(_resample(np.log(t["pca_sigma"]), L, 0), C, 2))).float()
        self.steps = np.exp(_resample(np.log(t["base_step"]), L, 0))  # [L, 2]
        mean = t["pca_mean"].reshape(source.layers, 2, source.heads, source.head_dim)
        mean = _resample(_resample(mean, L, 0), head_dim, 3)[:, :, np.arange(heads) % source.heads]
        self.mean = torch.from_numpy(mean.reshape(L, 2, C)).float()
        # Inverse CDFs of the nearest source layer's pooled shape, at the midpoints of QUANTILES
        # equal-probability bins (the grid's ends, +-24 sigma, are never drawn).
        grid = profiles.grid()
        nearest = np.rint(np.linspace(0, source.layers - 1, L)).astype(int)
        probs = (np.arange(QUANTILES) + 0.5) / QUANTILES
        tables = np.empty((L, 2, QUANTILES), np.float32)
        for layer, r in enumerate(nearest):
            for kv in range(2):
                cdf = t["pca_cdf"][r, kv].astype(np.float64)
                cdf = cdf + np.arange(cdf.size) * 1e-12  # strictly increasing, as interp needs
                tables[layer, kv] = np.interp(probs, cdf, grid)
        self.tables = torch.from_numpy(tables)
        g = torch.Generator().manual_seed(seed)
        self.bases = torch.empty(L, 2, C, C)
        for layer in range(L):
            for kv in range(2):
                q, r = torch.linalg.qr(torch.randn(C, C, generator=g, dtype=torch.float64))
                self.bases[layer, kv] = (q * torch.sign(torch.diagonal(r))).float()

    def kv(self, start: int, tokens: int, seed: int) -> torch.Tensor:
        """[L, 2, tokens, H, D] fp16 at absolute positions start..start+tokens."""
        g = torch.Generator().manual_seed(seed)
        H, D = self.heads, self.head_dim
        out = torch.empty(self.layers, 2, tokens, H, D, dtype=torch.float16)
        for layer in range(self.layers):
            for kv in range(2):
                u = torch.rand(tokens, H * D, generator=g) * (QUANTILES - 1)
                lo = u.long().clamp_max(QUANTILES - 2)
                table = self.tables[layer, kv]
                z = torch.lerp(table[lo], table[lo + 1], u - lo)
                x = torch.addmm(self.mean[layer, kv], z * self.sigma[layer, kv], self.bases[layer, kv].T)
                out[layer, kv] = rope.rerotate(x.view(tokens, H, D), start, rope.default_inv_freq(ROPE_THETA, D)) if kv == 0 else x.view(tokens, H, D)
        return out

    def fit(self, tokens: int, chunk_tokens: int, seed: int) -> profiles.Profile:
        """A profile calibrated on `tokens` fresh synthetic tokens, with the source's steps."""
        samples = [(self.kv(s, min(chunk_tokens, tokens - s), seed + s), s) for s in range(0, tokens, chunk_tokens)]
        # equal_slope_steps gives sqrt(12 kl / (n w)): invert it for the steps wanted.
        sens = 12.0 * self.kl_budget / (self.steps.size * self.steps ** 2)
        prof = profiles.fit(samples, model_id=f"synthetic-L{self.layers}-H{self.heads}-D{self.head_dim}",
                            rope_theta=ROPE_THETA, sensitivity=sens, kl_budget=self.kl_budget,
                            source=f"kvstreamd.bench.gpu synthetic, {tokens} tokens")
        tuned.write(prof, level_scales=dict(self.level_scales))
        return prof


def _numpy(x) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _encode_all(synth: SyntheticKV, pool: CodecPool, prof: profiles.Profile, tokens: int, chunk_tokens: int,
                level: str, seed: int, progress: bool) -> list[bytes]:
    """Every chunk of the context, in token order. The next chunk is synthesised while the pool
    encodes the last ones; at most a few raw chunks are held at once, never the whole context."""
    starts = list(range(0, tokens, chunk_tokens))
    chunks, pending = [], deque()
    with cf.ThreadPoolExecutor(2) as calls, tqdm(total=len(starts), unit="chunk", desc="encode",
                                                   disable=not progress) as bar:
        for i, start in enumerate(starts):
            kv = synth.kv(start, min(chunk_tokens, tokens - start), seed + start)
            pending.append(calls.submit(pool.encode, kv, level, prof, start))
            while len(pending) > 2 or (i == len(starts) - 1 and pending):
                chunks.append(pending.popleft().result())
                bar.update()
    return chunks


def run(layers: int = 32, heads: int = 8, head_dim: int = 128, tokens: int = 8192, chunk_tokens: int = 256,
        level: str = "high", device: str | None = None, reps: int = 10, json_path: str | None = None,
        fit_tokens: int | None = None, workers: int | None = None, seed: int = 0, progress: bool = True,
        log=print) -> dict:
    ok, why = gpu.available()
    device = device or ("cuda" if ok else "cpu")
    if device.startswith("cuda") and not ok:
        raise RuntimeError(f"cannot decode on {device}: {why}")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    C = heads * head_dim
    fit_tokens = fit_tokens or max(256, 2 * C)

    t0 = time.perf_counter()
    synth = SyntheticKV(profiles.Profile.load(SOURCE_PROFILE), layers, heads, head_dim, seed)
    prof = registry.register(synth.fit(fit_tokens, chunk_tokens, seed=seed + 1_000_000_007))
    log(f"synthetic profile for L={layers} H={heads} D={head_dim} fitted on {fit_tokens} tokens "
        f"in {time.perf_counter() - t0:.1f} s")
    with tempfile.TemporaryDirectory() as tmp, \
            CodecPool(workers or os.cpu_count(), profile_paths=(prof.save(Path(tmp) / "synthetic.kvprofile"),),
                      warm_levels=(level,)) as pool:
        t0 = time.perf_counter()
        chunks = _encode_all(synth, pool, prof, tokens, chunk_tokens, level, seed, progress)
        encode_s = time.perf_counter() - t0
        elements = layers * 2 * tokens * C
        out_bytes = elements * 2  # fp16
        bits = sum(map(len, chunks)) * 8 / elements
        log(f"{tokens} tokens at {level}: {bits:.3f} bits/element, {sum(map(len, chunks)) / 2**20:.1f} MiB "
            f"in {len(chunks)} chunks, encoded in {encode_s:.1f} s")

        dec = gpu.device_decoder(prof, device)
        prep = dec.prepare(chunks)
        del synth  # its bases are a quarter GiB at the default shape
        for _ in range(2):  # first calls compile kernels and size allocators
            out = dec.run(prep)
            del out
            dec.decode_many(chunks)
        sync()
        runs = []
        def timed(fn, *args) -> float:
            sync()
            t0 = time.perf_counter()
            out = fn(*args)
            sync()
            dt = time.perf_counter() - t0
            del out
            return dt

        for rep in tqdm(range(reps), desc="decode", disable=not progress):
            run_s, decode_s = timed(dec.run, prep), timed(dec.decode_many, chunks)
            runs.append({"rep": rep, "run_s": round(run_s, 6), "run_GBps": round(out_bytes / run_s / 1e9, 4),
                         "decode_s": round(decode_s, 6), "decode_GBps": round(out_bytes / decode_s / 1e9, 4)})

        # Correctness, once: the device's entropy decode against the C library's, bit for bit,
        # and the decoded KV against the CPU codec (the pool's decode is codec.decode's, split
        # by stream across processes, bit for bit).
        identical = True
        for i, (got, data) in enumerate(zip(dec.symbols(prep), chunks)):
            if got is None:  # the decoder handed this chunk to the CPU codec
                log(f"chunk {i}: not entropy-decoded on the device")
                identical = False
                continue
            a, b = _numpy(got), _numpy(gpu.cpu_symbols(data, prof))
            if a.shape != b.shape or not np.array_equal(a, b):
                log(f"chunk {i}: device symbols {a.shape} differ from the C library's {b.shape}")
                identical = False
        out = dec.run(prep)
        max_rel, differing = 0.0, 0
        batch = max(1, pool.workers)
        for first in range(0, len(chunks), batch):
            for i, ref in enumerate(pool.decode_many(chunks[first:first + batch], prof), first):
                got = out[:, :, i * chunk_tokens:i * chunk_tokens + ref.shape[2]].cpu().float()
                ref = ref.float()
                max_rel = max(max_rel, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
                differing += int((got != ref).sum())
        del out

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    report = {"device": device, "gpu_name": name,
              "shape": {"layers": layers, "heads": heads, "head_dim": head_dim},
              "tokens": tokens, "chunk_tokens": chunk_tokens, "level": level,
              "bits_per_element": round(bits, 4),
              "decode_GBps": statistics.median(r["run_GBps"] for r in runs),
              "decode_GBps_end_to_end": statistics.median(r["decode_GBps"] for r in runs),
              "symbols_identical": identical, "max_rel_err": max_rel, "elements_differing": differing,
              "reps": reps, "runs": runs,
              "output_bytes": out_bytes, "compressed_bytes": sum(map(len, chunks)), "fit_tokens": fit_tokens,
              "encode_s": round(encode_s, 3), "source_profile": SOURCE_PROFILE.name}
    write_json(report, json_path)
    # After the JSON is written: a failing run leaves its evidence.
    if not identical:
        raise AssertionError("device symbols differ from the C library's")
    if not max_rel < 1e-3:
        raise AssertionError(f"device decode differs from codec.decode: max relative error {max_rel:.3g}")
    return report


def summary(report: dict) -> str:
    s = report["shape"]
    return (f"{report['gpu_name']} ({report['device']}): L={s['layers']} H={s['heads']} D={s['head_dim']}, "
            f"{report['tokens']} tokens in chunks of {report['chunk_tokens']}, level {report['level']}, "
            f"{report['bits_per_element']:.3f} bits/element\n"
            f"decode on the device  {report['decode_GBps']:8.2f} GB/s of fp16 (median of {report['reps']})\n"
            f"parse + upload + decode {report['decode_GBps_end_to_end']:6.2f} GB/s\n"
            f"symbols bit-identical to the C library: {report['symbols_identical']}, "
            f"max relative error vs codec.decode {report['max_rel_err']:.2e}")

