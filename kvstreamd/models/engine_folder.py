"""A model folder a serving engine (vLLM) loads, for the same weights kvstreamd's HF side uses,
so that both file their contexts under one model id: the plain copy's weights and tokenizer
(linked, not copied), its config with the `architectures` an engine needs, a
tokenizer_config.json, and kvstreamd.json (kvstreamd.limits.MODEL_META) naming the model id
(engines/options.py reads it)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..limits import MODEL_META
from . import weights
from .adapter import model_id, plain_folder
from .registry import resolve


def engine_folder(model: str | Path | None, out: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Make (or refresh) `out` for `model` (a shipped name, a .gguf or a folder); returns it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    spec = resolve(model)
    root = Path(cache_dir) if cache_dir is not None else weights.cache_dir()
    mid = model_id(model, root)
    source = plain_folder(spec, mid, root)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    if not config.get("architectures"):
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
        if arch is None:
            raise ValueError(f"{source}: no causal-LM class for model_type {config.get('model_type')!r}")
        config["architectures"] = [arch]
    for item in source.iterdir():
        if item.suffix == ".safetensors" or item.name in ("tokenizer.json", "tokenizer.model", "special_tokens_map.json",
                                                          "generation_config.json"):
            link = out / item.name
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(item.resolve(), link)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tc = source / "tokenizer_config.json"
    if tc.is_file():
        tokenizer_config = json.loads(tc.read_text())
    else:  # a GGUF's plain copy: its BOS/EOS are in its kvstreamd.json (a plain folder: none)
        meta = source / weights.COPY_META
        special = json.loads(meta.read_text()) if meta.is_file() else {}
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special.get("bos"),
                            "eos_token": special.get("eos"), "add_bos_token": bool(special.get("bos"))}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / MODEL_META).write_text(json.dumps({"model_id": mid, "source": str(spec.name)}, indent=2) + "\n")
    return out
