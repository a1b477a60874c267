"""Benchmark and calibration text: WikiText-2 (valid.txt for tuning, test.txt for figures),
cut into token windows taken from well-separated parts of the file."""
from __future__ import annotations

import os
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "wikitext-2"  # a copy ships with the package (README there)


def wikitext_dir() -> Path:
    """$KVSTREAMD_DATA (a folder holding test.txt and valid.txt), else the shipped copy."""
    override = os.environ.get("KVSTREAMD_DATA")
    d = Path(override) if override else SHIPPED
    if not (d / "test.txt").is_file():
        raise FileNotFoundError(f"WikiText-2 not found: {d} holds no test.txt (KVSTREAMD_DATA names the folder)")
    return d


def windows(tokenizer, split: str, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens, spread evenly over the split's file; for a model
    that needs a BOS, each window starts with it (as every context the model sees does)."""
    ids = tokenizer.encode((wikitext_dir() / f"{split}.txt").read_text(encoding="utf-8"))
    if len(ids) < count * length:
        raise ValueError(f"{split}.txt has {len(ids)} tokens, fewer than {count} x {length}")
    stride = (len(ids) - length) // max(count - 1, 1) if count > 1 else 0
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    return [bos + ids[i * stride:i * stride + length - len(bos)] for i in range(count)]
