"""A per-model profile: what encoder and decoder both know, so chunks need not carry it.

It holds, per (layer, K/V): the PCA mean and basis of the (un-rotated) channels, each
component's standard deviation and the pooled shape of their distribution (for the entropy
coder), the same statistics for CacheGen's anchor/delta configuration, the measured
sensitivity of the model to errors there, and the steps that sensitivity implies.
Calibrate once from sample KV, save as a safetensors file (no pickle), ship it;
codec.tuning.registry finds the files and says which profile each model codes with.

It is the method's, its fit included: the statistics are those of the method's own transforms
on sample KV (fit runs pca, anchor, rope), the data encoder and decoder run on. What is tuned
against the model on held-out text (level scales, rate control, token steps, level costs) it
only carries in its meta, for codec.tuning.tuned to read and write.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch

from . import anchor, pca, quantize, rope
from .entropy import ComponentModels, block_probs, build_models
from .rans import RansModels
from .errors import CodecError
from .layout import Layout

FORMAT = "kvstreamd-profile"
FORMAT_VERSION = 1
GRID_EXTENT = 24.0  # standard deviations covered by the shape CDF; beyond it, escapes
GRID_POINTS = 769


def grid() -> np.ndarray:
    return np.linspace(-GRID_EXTENT, GRID_EXTENT, GRID_POINTS)


@dataclass
class Profile:
    meta: dict
    tensors: dict[str, np.ndarray]
    _models: dict = field(default_factory=dict, repr=False)
    _basis: dict = field(default_factory=dict, repr=False)
    _derived: dict = field(default_factory=dict, repr=False)  # rope kinds, layer subsets
    _id: bytes | None = field(default=None, repr=False)
    path: Path | None = field(default=None, compare=False)  # where it was loaded from, if anywhere

    # -- identity and shape -------------------------------------------------------------
    @property
    def id(self) -> bytes:
        """16-byte content hash: a chunk names the exact profile it was coded with."""
        if self._id is None:
            self._id = hashlib.blake2b(self.to_bytes(), digest_size=16).digest()
        return self._id

    @property
    def model_id(self) -> str:
        return self.meta["model_id"]

    @property
    def layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def heads(self) -> int:
        return int(self.meta["num_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.meta["head_dim"])

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: None where it holds every token of a prefix, W where it attends to (and a
        model's cache keeps) only the last W tokens: the sliding-window layers of hybrid models."""
        w = self.meta.get("layer_windows") or [None] * self.layers
        return tuple(None if x is None else int(x) for x in w)

    @property
    def layout(self) -> Layout:
        return Layout(self.layer_windows)

    @property
    def unrotates_keys(self) -> bool:
        """False for a model whose rotary scheme the codec cannot invert (dynamic NTK, longrope:
        the angles depend on the sequence length); its keys are coded as they are."""
        return bool(self.meta.get("unrotate_keys", True))

    def inv_freq(self, layer: int) -> torch.Tensor:
        """[head_dim/2] float64: the rotary frequencies layer `layer`'s keys were rotated by."""
        if "rope_inv_freq" in self.tensors:
            return torch.from_numpy(self.tensors["rope_inv_freq"][layer].astype(np.float64))
        return rope.default_inv_freq(float(self.meta["rope_theta"]), self.head_dim)

    def rope_kind(self, layer: int) -> int:
        """Layers with one kind share their rotary frequencies (and so their angle tables)."""
        return self._rope_kinds()[layer]

    def _rope_kinds(self) -> list[int]:
        if "rope_kinds" not in self._derived:
            seen: dict[bytes, int] = {}
            self._derived["rope_kinds"] = [seen.setdefault(self.inv_freq(i).numpy().tobytes(), len(seen))
                                           for i in range(self.layers)]
        return self._derived["rope_kinds"]

    def subset(self, layers: tuple[int, ...]) -> "Profile":
        """This profile restricted to some of its layers (in order): what codes and decodes a
        chunk that holds only those layers. It keeps this profile's id, which chunks name."""
        layers = tuple(int(i) for i in layers)
        if layers == tuple(range(self.layers)):
            return self
        key = ("subset", layers)
        if key not in self._derived:
            if not layers or sorted(set(layers)) != list(layers) or layers[-1] >= self.layers or layers[0] < 0:
                raise CodecError(f"layers {list(layers)} are not increasing indices below {self.layers}")
            idx = list(layers)
            tensors = {k: v[idx] for k, v in self.tensors.items() if k not in ("rope_inv_freq",)}
            tensors["rope_inv_freq"] = np.stack([self.inv_freq(i).numpy() for i in idx])
            meta = dict(self.meta, num_layers=len(idx),
                        layer_windows=[self.layer_windows[i] for i in idx], subset_of=list(idx))
            sub = Profile(meta, tensors, path=self.path)
            sub._id = self.id
            sub._derived["whole"] = self
            self._derived[key] = sub
        return self._derived[key]

    def whole(self) -> "Profile":
        """The profile a subset was cut from (itself where it is not one)."""
        return self._derived.get("whole", self)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """The parent profile's layer of each of this profile's layers (itself: 0..L-1)."""
        return tuple(self.meta.get("subset_of") or range(self.layers))

    @property
    def sink_tokens(self) -> int:
        return int(self.meta["sink_tokens"])

    @property
    def group(self) -> int:
        return int(self.meta["anchor_group"])

    @property
    def base_step(self) -> np.ndarray:
        return self.tensors["base_step"]

    def set_sensitivity(self, sensitivity: np.ndarray) -> None:
        """Take a new sensitivity [L, 2] (KL per unit of per-element squared error of each
        stream) and the base steps it sets at the profile's kl_budget; the profile's id changes."""
        self.tensors["sensitivity"] = np.asarray(sensitivity, np.float32).reshape(self.layers, 2)
        self.tensors["base_step"] = quantize.equal_slope_steps(self.tensors["sensitivity"], float(self.meta["kl_budget"]))
        self.changed()

    def changed(self) -> None:
        """Its meta or tensors were changed in place: its id, the hash of its bytes, is taken
        afresh (codec.tuning.tuned.write)."""
        self._id = None

    def channel_scale(self, layer: int, kv: int) -> torch.Tensor | None:
        """[C] float32: the weights' roots a stream's channels are scaled by before the rotation
        (pca's weighted KLT), or None for a profile fitted without them (the plain rotation)."""
        t = self.tensors.get("pca_channel_scale")
        return None if t is None else torch.from_numpy(np.ascontiguousarray(t[layer, kv], np.float32))

    def component_steps(self, layer: int, kv: int, step: float) -> torch.Tensor:
        """[C] float32: the step of each PCA component of a stream whose header step is `step`."""
        return torch.from_numpy(self.tensors["pca_step_scale"][layer, kv].astype(np.float64) * step).to(torch.float32)

    def check_shape(self, layers: int, heads: int, head_dim: int) -> None:
        if (layers, heads, head_dim) != (self.layers, self.heads, self.head_dim):
            raise CodecError(
                f"KV shape L={layers} H={heads} D={head_dim} does not match profile for "
                f"{self.model_id} (L={self.layers} H={self.heads} D={self.head_dim})")

    # -- what the coder uses -----------------------------------------------------------
    def _owner(self, layer: int) -> tuple["Profile", int]:
        """Where layer `layer`'s tables are kept: a subset's are its whole profile's (the same
        numbers, built once, whichever layer subsets chunks come in), at the whole's index."""
        whole = self._derived.get("whole")
        return (self, layer) if whole is None else (whole, self.layer_indices[layer])

    def basis(self, layer: int, kv: int) -> torch.Tensor:
        """Orthonormal bases [blocks, b, b] of one stream (stored fp16, re-orthonormalised in
        float64 so the encoder's rotation and the decoder's inverse match exactly)."""
        owner, layer = self._owner(layer)
        if owner is not self:
            return owner.basis(layer, kv)
        key = (layer, kv)
        if key not in self._basis:
            b = torch.from_numpy(self.tensors["pca_basis"][layer, kv].astype(np.float64))
            q, r = torch.linalg.qr(b)
            q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
            self._basis[key] = q.to(torch.float32).contiguous()
        return self._basis[key]

    def models(self, kind: str, layer: int, kv: int, step: float) -> ComponentModels:
        """constriction entropy models of one (layer, K/V) for kind 'pca' (step per stream),
        or 'anchor' / 'delta' (step as a multiple of each channel's standard deviation). Cached."""
        owner, layer = self._owner(layer)
        if owner is not self:
            return owner.models(kind, layer, kv, step)
        key = (kind, layer, kv, float(step))
        if key not in self._models:
            self._models[key] = build_models(*self._model_inputs(kind, layer, kv, step))
        return self._models[key]

    def rans_models(self, layer: int, kv: int, step: float) -> RansModels:
        """The same distributions as models('pca', ...), as lane rANS's integer tables. Cached."""
        owner, layer = self._owner(layer)
        if owner is not self:
            return owner.rans_models(layer, kv, step)
        key = ("rans", layer, kv, float(step))
        if key not in self._models:
            halves, probs, offsets = block_probs(*self._model_inputs("pca", layer, kv, step))
            self._models[key] = RansModels.from_block(probs, offsets, halves)
        return self._models[key]

    def _model_inputs(self, kind: str, layer: int, kv: int, step: float):
        sigma = self.tensors[f"{kind}_sigma"][layer, kv]
        steps = step * (sigma if kind != "pca" else self.tensors["pca_step_scale"][layer, kv].astype(np.float64))
        return sigma, steps, grid(), self.tensors[f"{kind}_cdf"][layer, kv]

    # -- files --------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        meta = {"profile": json.dumps(self.meta, sort_keys=True)}
        # contiguous: safetensors writes an array's memory as it lies, so a strided one would load transposed
        tensors = {k: np.ascontiguousarray(v) for k, v in sorted(self.tensors.items())}
        return safetensors.numpy.save(tensors, metadata=meta)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(path)
        return path

    @classmethod
    def from_bytes(cls, data: bytes | mmap.mmap, origin: str = "<bytes>") -> "Profile":
        """A profile over `data` (a file's bytes, or a private mapping of it): its tensors are
        views of data, not copies. CodecError, naming `origin`, for anything that is not a whole,
        finite profile: a header over HEADER_MAX, numbers JSON cannot hold as finite floats, a
        nesting too deep to parse, NaN or infinite statistics."""
        if isinstance(data, bytes):
            data = bytearray(data)  # writable, as the arrays of a fitted profile are
        try:
            tensors, meta = _views(data)
            meta = _strict_json(meta["profile"])
            if not isinstance(meta, dict):
                raise ValueError("its metadata is not a JSON object")
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
            raise CodecError(f"{origin}: not a readable profile file ({type(e).__name__}: {e})") from None
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise CodecError(f"{origin}: profile format {meta.get('format')!r} v{meta.get('version')} "
                             f"is not {FORMAT!r} v{FORMAT_VERSION}")
        missing = [k for k in REQUIRED_TENSORS if k not in tensors]
        if missing:
            raise CodecError(f"{origin}: profile lacks tensors {missing}")
        # min and max: NaN and +-inf show there, and no mask as large as the tensor is made (a
        # Llama-3-8B shape's PCA bases are 134 MB, loaded by the daemon and each codec worker)
        bad = [k for k, t in sorted(tensors.items())
               if t.dtype.kind == "f" and t.size and not (np.isfinite(t.min()) and np.isfinite(t.max()))]
        if bad:
            raise CodecError(f"{origin}: profile tensors {bad} hold NaN or infinite values")
        return cls(meta, tensors)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """The profile in `path`, its tensors mapped from the file: the daemon and each of its
        codec workers load the same profile, and mapped they share its pages (a Llama-3-8B
        shape's PCA bases are 134 MB) where each would otherwise hold a copy. A path that is
        not a regular file (a FIFO, a device, a folder) is refused before it is read."""
        path = Path(path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open does not wait
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CodecError(f"{path}: not a regular file")
            # copy-on-write: pages stay the file's (shared) unless a process writes one
            data = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if st.st_size else b""
        finally:
            os.close(fd)
        prof = cls.from_bytes(data, str(path))
        prof.path = path
        return prof


HEADER_MAX = 4 << 20  # a profile file's JSON header, at most (the shipped ones are ~2 KB)


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"the number {text[:40]} is not finite")
    return x


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a profile holds")


def _strict_json(text: str | bytes):
    """JSON whose numbers are all finite (Python's json takes NaN, Infinity and 1e999)."""
    return json.loads(text, parse_float=_finite, parse_constant=_no_constant)


# The safetensors container (what Profile.to_bytes writes, through the safetensors library):
# u64 little-endian header length, a JSON header naming each tensor's dtype, shape and byte
# range, then the data. Read here as views, which the library's numpy loader does not give.
_SAFETENSORS_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "U8": np.uint8,
                       "I16": np.int16, "U16": np.uint16, "I32": np.int32, "U32": np.uint32, "I64": np.int64,
                       "U64": np.uint64, "BOOL": np.bool_}


def _views(data) -> tuple[dict[str, np.ndarray], dict]:
    """(name -> array over data, the header's __metadata__); ValueError if malformed."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > HEADER_MAX:
        raise ValueError(f"a header of {n} bytes (at most {HEADER_MAX} are read)")
    if n > len(data) - 8:
        raise ValueError(f"header of {n} bytes in a {len(data)}-byte file")
    header = _strict_json(bytes(data[8:8 + n]))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    body = 8 + n
    tensors = {}
    for name, info in header.items():
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        shape = tuple(int(x) for x in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(data) - body or end - begin != count * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: bytes {begin}..{end} do not hold {shape} {dtype}")
        tensors[name] = np.frombuffer(data, dtype, count, body + begin).reshape(shape)
    return tensors, meta


REQUIRED_TENSORS = ("pca_mean", "pca_basis", "pca_sigma", "pca_cdf", "pca_step_scale", "channel_weight",
                    "chan_mean", "anchor_sigma", "anchor_cdf", "delta_sigma", "delta_cdf", "sensitivity",
                    "base_step")
STEP_SCALE_RANGE = (1 / 8, 8.0)
# The weighted KLT's channel scales (each weight's root, weights of mean 1) are kept in this
# range: a channel the model seems not to read (Gemma-3's keys have query pairs of energy 0)
# is still coded, as coarsely as the plain rotation's coarsest component step codes one.
CHANNEL_SCALE_RANGE = STEP_SCALE_RANGE


# -- calibration -------------------------------------------------------------------------
def _pooled_cdf(u: torch.Tensor) -> np.ndarray:
    """Empirical CDF of standardised values u (any shape) on the grid."""
    flat = np.sort(u.reshape(-1).numpy().astype(np.float64))
    return (np.searchsorted(flat, grid(), side="right") / max(flat.size, 1)).astype(np.float32)


def _stream_rows(kv: torch.Tensor, start: int, layer: int, k_or_v: int, sink: int, inv_freq: torch.Tensor,
                 unrotate: bool) -> torch.Tensor:
    """[T', C] float32 rows of one stream, the sink tokens dropped, keys optionally un-rotated."""
    x = kv[layer, k_or_v].to(torch.float32)
    skip = max(0, sink - start)
    x = x[skip:]
    if unrotate and k_or_v == 0:
        x = rope.unrotate(x, start + skip, inv_freq)
    return x.reshape(x.shape[0], -1)


def fit(samples: list[tuple[torch.Tensor, int]], *, model_id: str, sensitivity: np.ndarray,
        rope_theta: float | None = None, inv_freq: np.ndarray | None = None, unrotate_keys: bool = True,
        rope_info: list | None = None, layer_windows: list[int | None] | None = None,
        channel_weight: np.ndarray | None = None, kl_budget: float = 1e-3,
        sink_tokens: int = 1, anchor_group: int = 10, pca_block: int | None = None, weighted: bool = True,
        source: str = "") -> Profile:
    """Calibrate a profile from sample KV tensors [L, 2, T, H, D] with their start positions.

    Rotary frequencies: `inv_freq` [L, D/2] (each layer's own, as the model computes them), or
    plain RoPE at `rope_theta`; `unrotate_keys` False where the model's scheme cannot be
    inverted. `rope_info` says in words what was used (recorded). `layer_windows`: per layer,
    None or its sliding window (samples hold every layer's every token: see models.prefill).

    sensitivity[l, kv]: KL per unit of per-element squared error in that stream (measured
    with the model by kvstreamd.lab.calibrate); it sets the base steps at kl_budget.
    channel_weight[l, kv, c]: how much an error in channel c counts relative to the stream's
    other channels (for keys, the queries' energy in that rotary pair; for values, the output
    projection's column norms). `weighted` (the default): the rotation is fitted to the channels
    scaled by the weights' roots (pca's weighted KLT), and every component takes the stream's
    step: its error then falls where it costs least. On SmolLM2's keys, at equal weighted error,
    that took 7-33% fewer bits than the plain rotation (docs/benchmarks.md). Without it (the
    profiles before): the plain rotation, components stepped by equal slope within the stream,
    step_c ~ 1/sqrt(weight_c), the weight of a component being sum_i basis_ic^2 weight_i.
    """
    L, _, _, H, D = samples[0][0].shape
    C = H * D
    if inv_freq is None:
        if rope_theta is None:
            raise ValueError("fit needs the model's rotary frequencies: inv_freq or rope_theta")
        inv_freq = np.stack([rope.default_inv_freq(rope_theta, D).numpy()] * L)
    inv_freq = np.asarray(inv_freq, np.float64).reshape(L, D // 2)
    windows = list(layer_windows) if layer_windows is not None else [None] * L
    # One rotation over all heads' channels by default: on SmolLM2 it takes ~13% fewer bits
    # at equal KL than one rotation per head (docs/benchmarks.md), for a larger profile.
    block = pca_block or C
    t = {k: np.zeros((L, 2, C), np.float32) for k in ("pca_mean", "pca_sigma", "chan_mean", "anchor_sigma", "delta_sigma")}
    t["pca_basis"] = np.zeros((L, 2, C // block, block, block), np.float16)
    cw = np.ones((L, 2, C)) if channel_weight is None else np.asarray(channel_weight, np.float64).reshape(L, 2, C)
    t["channel_weight"] = (cw / cw.mean(-1, keepdims=True)).astype(np.float32)
    t["pca_step_scale"] = np.ones((L, 2, C), np.float32)
    if weighted:
        t["pca_channel_scale"] = np.sqrt(t["channel_weight"]).clip(*CHANNEL_SCALE_RANGE).astype(np.float32)
    for k in ("pca_cdf", "anchor_cdf", "delta_cdf"):
        t[k] = np.zeros((L, 2, GRID_POINTS), np.float32)
    for layer in range(L):
        f = torch.from_numpy(inv_freq[layer])
        for kv in range(2):
            # PCA over un-rotated channels, the sink excluded (it is kept exact and would
            # dominate the covariance).
            x = torch.cat([_stream_rows(s, st, layer, kv, sink_tokens, f, unrotate_keys) for s, st in samples])
            scale = torch.from_numpy(t["pca_channel_scale"][layer, kv]) if weighted else None
            mean, basis = pca.fit(x, block, scale)
            if not weighted:
                b16 = basis.to(torch.float16).to(torch.float64)  # what the file will hold
                wc = torch.cat([(b16[i] ** 2).T @ torch.from_numpy(t["channel_weight"][layer, kv][i * block:(i + 1) * block]).double()
                                for i in range(C // block)])
                t["pca_step_scale"][layer, kv] = torch.sqrt(wc.mean() / wc.clamp_min(1e-12)).clamp(*STEP_SCALE_RANGE).numpy()
            y = pca.forward(x, mean, basis.to(torch.float32), scale)
            sigma = y.std(0).clamp_min(1e-6)
            t["pca_mean"][layer, kv] = mean.numpy()
            t["pca_basis"][layer, kv] = basis.numpy().astype(np.float16)
            t["pca_sigma"][layer, kv] = sigma.numpy()
            t["pca_cdf"][layer, kv] = _pooled_cdf(y / sigma)

            # CacheGen's configuration: raw channels, anchors and deltas against them.
            raw = torch.cat([_stream_rows(s, st, layer, kv, 0, f, False) for s, st in samples])
            cmean = raw.mean(0)
            a = torch.cat([_stream_rows(s, st, layer, kv, 0, f, False)[anchor.anchor_rows(s.shape[2], anchor_group)]
                           for s, st in samples]) - cmean
            d = torch.cat([anchor.deltas(r := _stream_rows(s, st, layer, kv, 0, f, False),
                                         r[anchor.anchor_rows(r.shape[0], anchor_group)], anchor_group)
                           for s, st in samples])
            asig, dsig = a.std(0).clamp_min(1e-6), d.std(0).clamp_min(1e-6)
            t["chan_mean"][layer, kv] = cmean.numpy()
            t["anchor_sigma"][layer, kv] = asig.numpy()
            t["delta_sigma"][layer, kv] = dsig.numpy()
            t["anchor_cdf"][layer, kv] = _pooled_cdf(a / asig)
            t["delta_cdf"][layer, kv] = _pooled_cdf(d / dsig)
    t["rope_inv_freq"] = inv_freq
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "model_id": model_id, "num_layers": L,
            "num_kv_heads": H, "head_dim": D, "rope_theta": rope_theta, "rope": rope_info or [],
            "unrotate_keys": unrotate_keys, "layer_windows": windows, "sink_tokens": sink_tokens,
            "anchor_group": anchor_group, "kl_budget": kl_budget, "source": source,
            "calibration_tokens": int(sum(s.shape[2] for s, _ in samples))}
    prof = Profile(meta, t)
    prof.set_sensitivity(sensitivity)
    return prof
