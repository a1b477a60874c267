"""Any HuggingFace causal LM through transformers' Cache API: load it, take its KV out of a
cache, put KV back in, and run tokens on top of it.

What the codec needs to know of a model is read from the model itself: layers, KV heads and
head dim from its config; which layers slide over which window (`layer_types` and
`sliding_window`, as Gemma-2/3, Mistral and Qwen configs say it); and the rotary frequencies of
each layer from the model's own rotary-embedding module (transformers' code for default,
linear, yarn and llama3 RoPE, one set per layer type where a model has several). A scheme whose
angles depend on the sequence length (dynamic NTK, longrope) cannot be inverted: such a model's
keys are coded without un-rotation, and its profile says so.

KV comes out of `prefill` with every layer's every token (what a store keeps, so that any prefix
of a context can be served), even for a sliding layer whose cache would keep only its window:
tokens run in blocks no longer than the smallest window, and each block's KV is read from the
cache before it slides out."""
from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from codec.layout import Layout, PrefixKV

from . import attention, packed_linear, registry, weights
from .spec import ModelSpec
from .tokenizer import Tokenizer

# Both "eager" and "sdpa" make logits on an injected cache agree with one long pass to ~5e-5
# (fp32 GEMM rounding differs with the number of query rows; not bit-identical with either),
# and sdpa is the faster on CPU: 2,048 SmolLM2 tokens in 7 s on one core where eager takes 18 s.
# Models load with sdpa whose grouped queries are packed per KV head (attention.py).
ATTN_IMPLEMENTATION = attention.NAME
# Bounds peak memory of one forward pass: the logits of a block are block x vocab fp32.
PREFILL_BLOCK = 2048
INVERTIBLE_ROPE = ("default", "linear", "yarn", "llama3")  # angles fixed per position


@dataclass
class Rotary:
    """Each layer's rotary frequencies, as the model computes them, and what they are."""

    inv_freq: np.ndarray  # [L, head_dim / 2] float64
    invertible: bool
    info: list[dict] = field(default_factory=list)  # per layer type: {"layer_type", "rope_type", ...}


@dataclass
class LoadedModel:
    """The model ready to run (fp32, eval, CPU), its tokenizer, and what the KV layout needs."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    model_id: str  # name + hash of the weights: a KV cache is valid only for these weights
    name: str  # what --model said (a shipped name or a path)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    layout: Layout  # which tokens each layer holds
    rotary: Rotary
    weights_dir: Path  # the folder the model was loaded from
    spec: ModelSpec | None = None

    @property
    def layer_windows(self) -> list[int | None]:
        return list(self.layout.windows)


def _copy_dir(mid: str, root: Path) -> Path:
    """Where a GGUF's plain copy lives: one folder per model id and copy format."""
    return root / "models" / f"{mid.replace(':', '-')}-v{weights.COPY_FORMAT}"


def model_id(model: str | Path | None = None, cache_dir: str | Path | None = None) -> str:
    """The name a KV cache of this model is filed under: its name + 16 hex of its weights' blake2b."""
    spec = registry.resolve(model)
    root = Path(cache_dir) if cache_dir is not None else weights.cache_dir()
    if spec.gguf is not None:
        files = [spec.gguf()]
    else:
        files = sorted(spec.folder.glob("*.safetensors")) + [spec.folder / "config.json"]
    return f"{spec.model_name}:{weights.digest(files, root)[:16]}"


def plain_folder(spec: ModelSpec, mid: str, root: Path) -> Path:
    """The folder a model's weights load from: a GGUF's plain copy in `root` (converted on first
    use, 20-70 s), else the model's own folder."""
    if spec.gguf is None:
        return spec.folder
    folder = _copy_dir(mid, root)
    if not (folder / "model.safetensors").is_file():
        weights.convert_gguf(spec.gguf(), folder, spec.tokenizer_json)
    return folder


def load(model: str | Path | None = None, cache_dir: str | Path | None = None) -> LoadedModel:
    """Load a model (a shipped name, a .gguf file or a model folder; None: SmolLM2-135M) fp32,
    eval, on the CPU. A GGUF is converted on the first call only (20-70 s); later calls read the
    plain copy in `cache_dir` (default: weights.cache_dir()) in about a second."""
    from transformers import AutoModelForCausalLM

    spec = registry.resolve(model)
    root = Path(cache_dir) if cache_dir is not None else weights.cache_dir()
    mid = model_id(model, root)
    folder = plain_folder(spec, mid, root)
    attention.register()
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION)
    lm.eval()
    packed_linear.pack(lm)
    cfg = lm.config
    special = _special_tokens(folder, cfg)
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json", eos=special.get("eos"), bos=special.get("bos"))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = cfg.num_hidden_layers
    return LoadedModel(
        model=lm, tokenizer=tokenizer, model_id=mid, name=spec.name, num_layers=layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim=head_dim,
        max_positions=cfg.max_position_embeddings, layout=Layout(tuple(layer_windows(cfg))),
        rotary=rotary(lm, layers, head_dim), weights_dir=folder, spec=spec)


def _special_tokens(folder: Path, cfg) -> dict:
    meta = folder / weights.COPY_META
    if meta.is_file():
        return json.loads(meta.read_text())
    tc = folder / "tokenizer_config.json"
    conf = json.loads(tc.read_text()) if tc.is_file() else {}
    bos = conf.get("bos_token") if conf.get("add_bos_token") else None
    return {"bos": bos if isinstance(bos, str) else None,
            "eos": conf.get("eos_token") if isinstance(conf.get("eos_token"), str) else None}


def layer_windows(cfg) -> list[int | None]:
    """Per layer: None (full attention) or its sliding window, from the config."""
    L = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if window and getattr(cfg, "use_sliding_window", True):
        return [int(window)] * L
    return [None] * L


def rotary(lm, layers: int, head_dim: int) -> Rotary:
    """Each layer's inverse frequencies from the model's rotary-embedding module."""
    emb = getattr(getattr(lm, "model", lm), "rotary_emb", None)
    types = getattr(lm.config, "layer_types", None) or ["full_attention"] * layers
    if emb is None:
        return Rotary(np.zeros((layers, head_dim // 2)), False, [{"rope_type": "unknown (no rotary_emb module)"}])
    kinds = emb.rope_type if isinstance(emb.rope_type, dict) else None
    freqs, info, invertible = [], {}, True
    for t in types:
        f = getattr(emb, f"{t}_inv_freq", None) if kinds is not None else emb.inv_freq
        rope_type = kinds[t] if kinds is not None else emb.rope_type
        if f is None or f.numel() * 2 != head_dim:
            return Rotary(np.zeros((layers, head_dim // 2)), False,
                          [{"layer_type": t, "rope_type": f"{rope_type} (partial rotary: not un-rotated)"}])
        invertible &= rope_type in INVERTIBLE_ROPE
        freqs.append(f.detach().to(torch.float64).cpu().numpy())
        params = getattr(lm.config, "rope_parameters", None) or {}
        params = params.get(t, params) if isinstance(params.get(t, None), dict) else params
        info.setdefault(t, {"layer_type": t, "rope_type": rope_type,
                            **{k: v for k, v in params.items() if isinstance(v, (int, float, str))}})
    return Rotary(np.stack(freqs), invertible, list(info.values()))


# -- the Cache API: KV out, KV in ----------------------------------------------------------------

def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def kv_from_cache(past_key_values) -> torch.Tensor:
    """A cache whose layers hold every token (per layer `[1, H, T, D]`, keys post-RoPE) as one
    `[L, 2, T, H, D]` tensor. A copy: later steps that grow the cache do not change it."""
    layers = _cache_layers(past_key_values)
    if layers[0][0].shape[0] != 1:
        raise ValueError(f"expected a batch of one sequence, got {layers[0][0].shape[0]}")
    if len({k.shape[2] for k, _ in layers}) != 1:
        raise ValueError("the cache's layers hold different token ranges: take the KV with prefill()")
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in layers])  # [L, 2, H, T, D]
    return kv.transpose(2, 3).contiguous()


def cache_from_kv(kv: torch.Tensor | PrefixKV, dtype: torch.dtype | None = None, config=None, copy: bool = True,
                  room: int = 0):
    """A `DynamicCache` holding `kv` (a `[L, 2, T, H, D]` tensor of every layer's tokens, or a
    PrefixKV), converted to `dtype` if given, ready to continue the model after it. `config`:
    the model's, so that its sliding layers keep only their window (as the model's own cache
    would); a windowed part is fed in at its true positions. The cache owns its copy, so running
    the model on it never writes into `kv`'s tokens; `room`: tokens the copy leaves space for
    after them, where the model's next tokens are written in place (AppendLayer) rather than
    the prefix copied anew at each step. copy=False: a part that already lies heads-first in
    `dtype` (PrefixKV.copy_heads_first) is held as it is, no copy, and appends into its own
    room (Part.room) -- past its tokens, never into them."""
    from transformers import DynamicCache

    prefix = kv if isinstance(kv, PrefixKV) else _dense_prefix(kv)
    if copy or not all(p.kv.dtype == (dtype or p.kv.dtype) and _roomy(p) is not None for p in prefix.parts):
        prefix = prefix.copy_heads_first(dtype=dtype, room=room)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    per_layer = {}
    for part in prefix.parts:
        heads_first = part.kv.permute(0, 1, 3, 2, 4)  # [L, 2, H, T, D], each head's rows contiguous
        roomy = _roomy(part)  # [L, 2, H, T + room, D]
        for j, layer in enumerate(part.layers):
            per_layer[layer] = (part.start, heads_first[j], roomy[j])
    for layer in range(len(per_layer)):
        start, kvl, spare = per_layer[layer]
        _hold(cache, layer, kvl[0].unsqueeze(0), kvl[1].unsqueeze(0), start,
              (spare[0].unsqueeze(0), spare[1].unsqueeze(0)))
    return cache


def _roomy(part) -> torch.Tensor | None:
    """The heads-first tensor `[L, 2, H, T + room, D]` whose first T rows per head are part.kv
    (seen heads-first), or None where part.kv is not laid out that way."""
    heads_first = part.kv.permute(0, 1, 3, 2, 4)
    L, two, H, T, D = heads_first.shape
    rows = T + part.room
    stride = (two * H * rows * D, H * rows * D, rows * D, D, 1)
    whole = heads_first.storage_offset() + L * two * H * rows * D
    if heads_first.is_contiguous() and not part.room:
        return heads_first
    if heads_first.stride() != stride or whole * heads_first.element_size() > heads_first.untyped_storage().nbytes():
        return None
    return heads_first.as_strided((L, two, H, rows, D), stride)


def _hold(cache, layer: int, k: torch.Tensor, v: torch.Tensor, start: int,
          room: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Layer `layer` of a fresh cache made to hold k, v `[1, H, T, D]`, tokens start..start+T of
    the prefix, the first T rows of `room` (keys', values' `[1, H, T + r, D]`). transformers' own
    dynamic layers are left as their update() would leave them, without its copy (update
    concatenates onto an empty tensor), a full-attention one appending into the room if there is
    any (AppendLayer); any other layer kind goes through update()."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    held = cache.layers[layer] if layer < len(cache.layers) else None
    kind = type(held)
    if kind is DynamicSlidingWindowLayer:
        held.lazy_initialization(k, v)
        # what update() keeps of a sliding layer: its last window - 1 tokens, and how many it saw
        keep = held.sliding_window - 1
        held.keys, held.values = k[:, :, -keep:], v[:, :, -keep:]
        held.cumulative_length = start + k.shape[2]
        return
    if kind is DynamicLayer and not start:
        if room[0].shape[2] > k.shape[2]:
            from .append_layer import AppendLayer

            cache.layers[layer] = AppendLayer(k, v, *room)
            return
        held.lazy_initialization(k, v)
        held.keys, held.values = k, v
        return
    cache.update(k, v, layer)
    if start:
        # The tokens before the window are never read, but they count (positions, masks): a
        # sliding layer is told how many it has seen; any other layer kind gets zeros in their place.
        held = cache.layers[layer]
        if getattr(held, "is_sliding", False) and hasattr(held, "cumulative_length"):
            held.cumulative_length = start + k.shape[2]
        else:
            pad = torch.zeros((1, k.shape[1], start, k.shape[3]), dtype=k.dtype, device=k.device)
            held.keys, held.values = torch.cat([pad, held.keys], 2), torch.cat([pad, held.values], 2)


def _dense_prefix(kv: torch.Tensor) -> PrefixKV:
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"expected a KV tensor [L, 2, T, H, D], got shape {tuple(kv.shape)}")
    return PrefixKV.from_dense(kv)


def cache_kwarg(model) -> str:
    """transformers 5.x names the forward's cache argument `cache` (and warns on the old name); 4.x `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate_cache_kwarg() -> str:
    import transformers

    return "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def _check_kv(lm: LoadedModel, kv: torch.Tensor | PrefixKV) -> int:
    """The prior's token count, after checking it fits the model."""
    if isinstance(kv, PrefixKV):
        H, D = kv.parts[0].kv.shape[3:]
        got, n = (kv.layers, 2, H, D), kv.tokens
    else:
        got = (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) if kv.dim() == 5 else tuple(kv.shape)
        n = kv.shape[2] if kv.dim() == 5 else 0
    want = (lm.num_layers, 2, lm.num_kv_heads, lm.head_dim)
    if got != want:
        raise ValueError(f"KV shape {got} does not fit {lm.model_id} ([{want[0]}, 2, T, {want[2]}, {want[3]}])")
    return n


def block_tokens(config) -> int:
    """Tokens per forward pass: short enough that a sliding layer's cache still holds a whole
    block after it (it keeps window - 1 tokens), so every layer's KV of it can be read."""
    windows = [w for w in layer_windows(config) if w is not None]
    return min([PREFILL_BLOCK, *[w - 1 for w in windows]])


def run(model, ids: torch.Tensor, cache, *, all_logits: bool, keep_kv: bool, rows: list[int] | None = None):
    """Run token ids [T] through a transformers model on top of `cache` (appended in place), in
    blocks of block_tokens(). Returns (logits: every token's [T, vocab] or the last's [1, vocab],
    fp32, or with `rows` (indices into ids, ascending) those tokens' only; every layer's KV of the
    new tokens `[L, 2, T, H, D]` if keep_kv else None)."""
    name = cache_kwarg(model)
    device = next(model.parameters()).device
    logits, new = [], []
    block = block_tokens(model.config)
    for start in range(0, ids.numel(), block):
        piece = ids[start:start + block].unsqueeze(0).to(device)
        n = piece.shape[1]
        # logits_to_keep skips the vocab projection (~1/5 of the FLOPs for SmolLM2, most of them
        # for Gemma's 262K vocabulary) of the tokens whose logits are not asked for.
        if rows is not None:
            local = [r - start for r in rows if start <= r < start + n]
            keep = {"logits_to_keep": torch.tensor(local if local else [n - 1], device=device)}
        else:
            local = None
            keep = {} if all_logits else {"logits_to_keep": 1}
        # The model appends to `cache` in place; positions continue after what it holds.
        out = model(input_ids=piece, use_cache=True, **{name: cache}, **keep)
        if local is None or local:
            logits.append(out.logits[0].float())
        del out
        if keep_kv:
            new.append(torch.stack([torch.stack([k[0, :, -n:], v[0, :, -n:]]) for k, v in _cache_layers(cache)]))
    kv_new = torch.cat(new, dim=3).transpose(2, 3).contiguous() if keep_kv else None  # [L, 2, H, T, D] -> [L, 2, T, H, D]
    if rows is not None:
        return (torch.cat(logits) if logits else torch.empty(0)), kv_new
    return (torch.cat(logits) if all_logits else logits[-1]), kv_new


@torch.no_grad()  # not inference_mode: its tensors cannot be edited in place later (codec work does)
def _forward(lm: LoadedModel, tokens, kv, all_logits: bool, keep_kv: bool, rows: list[int] | None = None):
    """Run `tokens` after `kv`; returns (logits, the cache, every layer's KV of the new tokens
    `[L, 2, T_new, H, D]` if keep_kv else None)."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("no tokens to run")
    prior = 0 if kv is None else _check_kv(lm, kv)
    if prior + ids.numel() > lm.max_positions:
        raise ValueError(f"{prior} + {ids.numel()} tokens exceed the model's {lm.max_positions} positions")
    config = lm.model.config
    # a decoded cache may come as fp16/bf16: the model runs in fp32
    cache = cache_from_kv(kv, torch.float32, config, room=ids.numel()) if kv is not None else empty_cache(config)
    logits, kv_new = run(lm.model, ids, cache, all_logits=all_logits, keep_kv=keep_kv, rows=rows)
    return logits, cache, kv_new


def empty_cache(config):
    """The cache the model would make itself: sliding layers keep their window only."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def prefill(lm: LoadedModel, tokens, kv: torch.Tensor | None = None, *, all_logits: bool = True,
            logits_at: list[int] | None = None):
    """Run `tokens` on top of an optional prior KV (`[L, 2, T, H, D]`, every layer's every token);
    positions continue after it. Returns (logits `[T, vocab]` fp32 for each new token, or
    `[1, vocab]` for the last if not `all_logits`, or `[len(logits_at), vocab]` for the new
    tokens at those indices (ascending), and the KV of prior + new tokens
    `[L, 2, T_total, H, D]`, every layer's every token, sliding layers included)."""
    logits, _, new = _forward(lm, tokens, kv, all_logits, keep_kv=True, rows=logits_at)
    return logits, new if kv is None else torch.cat([kv.to(new.dtype), new], dim=2)


@torch.no_grad()
def prefill_timed(lm: LoadedModel, tokens, step: int, on_step: Callable[[int], None] | None = None
                  ) -> tuple[torch.Tensor, list[tuple[int, int, float]]]:
    """Prefill `tokens` `step` at a time on one running cache, as a receiver computes a TEXT
    head (models.prefix), timing each step. Returns (the KV `[L, 2, T, H, D]`, as prefill gives
    it, and (start, tokens, seconds) of each step); `on_step(tokens)` after each. What a
    model's prefill rate is fitted to: prefill() in steps would time a copy of the growing
    prefix too, which a running cache does not make."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if not 0 < ids.numel() <= lm.max_positions:
        raise ValueError(f"{ids.numel()} tokens: a prefill takes 1 to the model's {lm.max_positions}")
    cache = empty_cache(lm.model.config)
    news, steps = [], []
    for start in range(0, ids.numel(), step):
        t0 = time.perf_counter()
        _, new = run(lm.model, ids[start:start + step], cache, all_logits=False, keep_kv=True)
        steps.append((start, new.shape[2], time.perf_counter() - t0))
        news.append(new)
        if on_step is not None:
            on_step(new.shape[2])
    return torch.cat(news, dim=2), steps


def extend(lm: LoadedModel, kv: PrefixKV, tokens) -> torch.Tensor:
    """Every layer's KV `[L, 2, T, H, D]` of `tokens` run after the prefix `kv`: what recomputing
    a TEXT chunk gives."""
    return _forward(lm, tokens, kv, all_logits=False, keep_kv=True)[2]


def continuation_logits(lm: LoadedModel, kv, tokens) -> torch.Tensor:
    """Logits `[T, vocab]` of `tokens` run on top of `kv` (exact or decompressed).
    What perplexity and KL against the exact cache are measured from."""
    return _forward(lm, tokens, kv, all_logits=True, keep_kv=False)[0]


@torch.no_grad()
def generate_greedy(lm: LoadedModel, kv, first_tokens, n: int, timings: dict | None = None) -> list[int]:
    """Greedy-decode `n` tokens after running `first_tokens` (at least one) on top of `kv`, in
    blocks (what bounds the memory of a long prompt's masks and logits). Returns the new token
    ids only; it does not stop at eos. `timings["first_token_s"]`: from the call to the first."""
    t0 = time.perf_counter()
    prior = 0 if kv is None else _check_kv(lm, kv)
    total = prior + torch.as_tensor(first_tokens).numel() + n - 1
    if total > lm.max_positions:
        raise ValueError(f"{total} tokens exceed the model's {lm.max_positions} positions")
    logits, cache, _ = _forward(lm, first_tokens, kv, all_logits=False, keep_kv=False)
    name = cache_kwarg(lm.model)
    out: list[int] = []
    for _ in range(n):
        token = int(logits[-1].argmax())
        if not out and timings is not None:
            timings["first_token_s"] = time.perf_counter() - t0
        out.append(token)
        if len(out) == n:
            break
        logits = lm.model(input_ids=torch.tensor([[token]]), use_cache=True, **{name: cache}).logits[0]
    return out
