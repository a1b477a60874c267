"""Real chunks for `kvstreamd bench stream`: one WikiText-2 test context prefilled chunk by
chunk with the real model (timing each chunk's prefill: the cost a TEXT chunk makes the
receiver pay), each chunk encoded at every level, and the receiver's decode time per level."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from codec import baselines
from codec.pool.parallel import CodecPool

from .. import models
from ..lab import corpus
from . import profile_and_pool

LEVELS = ["fp16", "int8", "high", "balanced", "fast"]  # best quality first; "text" is the last resort
PROFILE_FILE = "profile.kvprofile"  # the profile the chunks were coded with, kept beside them for the receiver


def encode_level(pool: CodecPool, chunk: torch.Tensor, level: str, profile, start: int) -> bytes:
    if level in baselines.SCHEMES:
        return baselines.SCHEMES[level].encode(chunk)
    return pool.encode(chunk, level, profile, start=start)


def decode_level(pool: CodecPool, data: bytes, level: str) -> torch.Tensor:
    if level in baselines.SCHEMES:
        return baselines.SCHEMES[level].decode(data)
    return pool.decode(data)


def prepare(out_dir: str | Path, tokens: int = 4096, chunk_tokens: int = 1024, log=print,
            model: str | None = None, profile_path: str | Path | None = None) -> dict:
    """Write chunk{i}.{level} files and manifest.json into out_dir, coded with the model's
    profile (the file `profile_path`, else the registry's choice), a copy of which goes there
    as PROFILE_FILE; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = models.load(model)
    profile, pool = profile_and_pool(lm.model_id, profile_path)
    profile.save(out / PROFILE_FILE)
    ids = corpus.windows(lm.tokenizer, "test", 1, tokens + 1)[0]
    kv = None
    chunks = []
    with pool:
        for i, start in enumerate(range(0, tokens, chunk_tokens)):
            part = ids[start:start + chunk_tokens]
            t0 = time.perf_counter()
            _, kv = models.prefill(lm, part, kv, all_logits=False)
            recompute = time.perf_counter() - t0
            chunk = kv[:, :, start:].to(torch.float16).contiguous()
            entry = {"i": i, "start": start, "tokens": part, "recompute_s": round(recompute, 3), "bytes": {},
                     "decode_s": {}}
            for level in LEVELS:
                data = encode_level(pool, chunk, level, profile, start)
                (out / f"chunk{i}.{level}").write_bytes(data)
                decode_level(pool, data, level)  # warm
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    decode_level(pool, data, level)
                    times.append(time.perf_counter() - t0)
                entry["bytes"][level] = len(data)
                entry["decode_s"][level] = round(statistics.median(times), 4)
            log(f"chunk {i}: recompute {recompute:.2f} s, bytes " +
                ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in entry["bytes"].items()))
            chunks.append(entry)
    manifest = {"model": lm.model_id, "model_name": lm.name, "profile": profile.id.hex(), "tokens": tokens,
                "chunk_tokens": chunk_tokens, "levels": LEVELS, "chunks": chunks}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest
