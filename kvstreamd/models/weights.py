"""Where a model's weights come from and the plain copy kvstreamd loads: a GGUF is dequantized
once into a cached folder (config.json + model.safetensors + tokenizer.json), a local folder is
used as it is. A model id names the weights exactly: a name and 16 hex of their blake2b."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch

# Bump when what a converted copy holds changes, so an old copy is never reused.
COPY_FORMAT = 2
COPY_META = "kvstreamd.json"  # in a converted copy: the tokenizer's BOS/EOS tokens


def cache_dir() -> Path:
    """Where kvstreamd keeps converted model copies: $XDG_CACHE_HOME/kvstreamd or ~/.cache/kvstreamd."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvstreamd"


def digest(paths: list[Path], root: Path) -> str:
    """blake2b over the bytes of `paths` (in order), remembered under `root` by each file's path,
    size, mtime and inode. Hashing 250 MB costs ~0.4 s warm and more from a cold disk."""
    stamps = []
    for path in paths:
        st = path.stat()
        stamps.append(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}")
    memo = root / "digests" / hashlib.blake2b("\n".join(stamps).encode(), digest_size=16).hexdigest()
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.blake2b()
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    value = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{uuid.uuid4().hex}")
    tmp.write_text(value + "\n")
    os.replace(tmp, memo)
    return value


def _fsync_tree(folder: Path) -> None:
    for item in folder.iterdir():
        with open(item, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_config(cfg) -> dict:
    """The model's config as a plain copy's config.json: no GGUF quantization, fp32."""
    config = cfg.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["dtype"] = "float32"
    return config


def convert_gguf(gguf: Path, target: Path, tokenizer_json: Callable[[Path, Path], dict]) -> None:
    """Dequantize a GGUF once (20-70 s) into a plain copy at `target`. `tokenizer_json(gguf,
    path)` writes the tokenizer there and returns its {"bos": ..., "eos": ...} tokens. Written
    into a temp folder and renamed, so a crash never leaves a half copy behind."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    # Temp folders of conversions that died (their process is gone) would hold ~0.5-1 GB each.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        pid = stale.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = _plain_config(model.config)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)  # the embedding's tensor; safetensors refuses shared storage
    del model

    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        special = tokenizer_json(gguf, tmp / "tokenizer.json")
        (tmp / COPY_META).write_text(json.dumps({"source": gguf.name, **special}, indent=2) + "\n")
        _fsync_tree(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            # Another process finished the same conversion first; its copy is as good.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_tokenizer_json(gguf: Path, path: Path) -> dict:
    """transformers' own conversion of a GGUF's tokenizer, saved as tokenizer.json; BOS kept
    where the tokenizer puts one before a text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.backend_tokenizer.save(str(path))
    adds_bos = tok.bos_token_id is not None and tok("a").input_ids[:1] == [tok.bos_token_id]
    return {"bos": tok.bos_token if adds_bos else None, "eos": tok.eos_token}
