"""Benchmark and calibration text: WikiText-2 (valid.txt for tuning, test.txt for figures),
cut into token windows taken from well-separated parts of the file."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wikitext_dir() -> Path:
    """$KVSTREAMD_DATA, else ../shared/data/wikitext-2 beside the checkout."""
    candidates = [os.environ.get("KVSTREAMD_DATA"), REPO.parent / "shared/data/wikitext-2",
                  REPO / "shared/data/wikitext-2"]
    for c in candidates:
        if c and (Path(c) / "test.txt").is_file():
            return Path(c)
    raise FileNotFoundError("WikiText-2 not found: set KVSTREAMD_DATA to the folder holding test.txt and valid.txt")


def windows(tokenizer, split: str, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens, spread evenly over the split's file."""
    ids = tokenizer.encode((wikitext_dir() / f"{split}.txt").read_text(encoding="utf-8"))
    if len(ids) < count * length:
        raise ValueError(f"{split}.txt has {len(ids)} tokens, fewer than {count} x {length}")
    stride = (len(ids) - length) // max(count - 1, 1) if count > 1 else 0
    return [ids[i * stride:i * stride + length] for i in range(count)]
