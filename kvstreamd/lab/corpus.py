"""Benchmark and calibration text, of several kinds: each kind is a folder holding valid.txt
(for tuning) and test.txt (held out, for reported figures), cut into token windows taken from
well-separated parts of the file. WikiText-2 is the reference kind; the others are text of
another kind than encyclopaedia prose, so that what is tuned on one kind is checked on others.
One kind (`manual`) is never tuned on at all (`Kind.tuned` False): it holds test.txt only, and
checks the tuning on text of a kind that no tuning has seen. `TUNED` names the kinds tuned on.
Each folder ships with the package, with a README giving its source, licence and sha256s."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIPPED = HERE / "wikitext-2"  # a copy ships with the package (README there)
SPLITS = ("valid", "test")  # valid.txt: tuning; test.txt: reported figures only


@dataclass(frozen=True)
class Kind:
    name: str
    title: str  # what the text is, for tables and logs
    folder: Path  # the shipped copy
    tuned: bool = True  # False: held out from all tuning; the folder holds test.txt only

    @property
    def splits(self) -> tuple[str, ...]:
        return SPLITS if self.tuned else ("test",)


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("wikitext", "WikiText-2 (Wikipedia articles; CC BY-SA 3.0)", SHIPPED),
    Kind("legal", "software licence agreements (GPL, MPL, Apache, ...; verbatim copying allowed)", HERE / "legal"),
    Kind("code", "Python source (CPython 3.11 standard library; PSF License)", HERE / "code"),
    Kind("manual", "technical manual prose (GNU Coreutils 9.1 manual; GFDL 1.3; never tuned on)", HERE / "manual",
         tuned=False),
)}
DEFAULT = "wikitext"
# The kinds tuned on (their valid.txt): what calibration tunes the codec on (calibrate.TUNING_TEXTS).
TUNED: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.tuned)


def get(kind: str) -> Kind:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown text kind {kind!r}; known: {', '.join(KINDS)}") from None


def wikitext_dir() -> Path:
    """$KVSTREAMD_DATA (a folder holding test.txt and valid.txt), else the shipped copy."""
    override = os.environ.get("KVSTREAMD_DATA")
    d = Path(override) if override else SHIPPED
    if not (d / "test.txt").is_file():
        raise FileNotFoundError(f"WikiText-2 not found: {d} holds no test.txt (KVSTREAMD_DATA names the folder)")
    return d


def kind_dir(kind: str = DEFAULT) -> Path:
    """The folder of a kind's splits (for WikiText, $KVSTREAMD_DATA when set)."""
    return wikitext_dir() if kind == "wikitext" else get(kind).folder


def path(split: str, kind: str = DEFAULT) -> Path:
    """The file of a kind's split; an unknown split or kind, or the valid split of a kind held
    out from tuning, is refused before anything is read (a caller checks its kinds up front)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    k = get(kind)
    if split not in k.splits:
        raise ValueError(f"text kind {kind!r} is held out from tuning: it has no {split} split, only "
                         f"{', '.join(k.splits)} (the kinds tuned on: {', '.join(TUNED)})")
    return kind_dir(kind) / f"{split}.txt"


def text(split: str, kind: str = DEFAULT) -> str:
    return path(split, kind).read_text(encoding="utf-8")


def tokens(tokenizer, split: str, kind: str = DEFAULT) -> list[int]:
    t = text(split, kind)  # a missing file or a bad name is said before any tokenizing
    return tokenizer.encode(t)


def fit(tokenizer, split: str, length: int, kind: str = DEFAULT) -> int:
    """How many windows of `length` tokens the split holds."""
    return len(tokens(tokenizer, split, kind)) // length


def windows(tokenizer, split: str, count: int, length: int, kind: str = DEFAULT) -> list[list[int]]:
    """`count` windows of `length` tokens, spread evenly over the kind's split; for a model
    that needs a BOS, each window starts with it (as every context the model sees does)."""
    ids = tokens(tokenizer, split, kind)
    if len(ids) < count * length:
        raise ValueError(f"{kind} {split}.txt has {len(ids)} tokens, fewer than {count} x {length}")
    stride = (len(ids) - length) // max(count - 1, 1) if count > 1 else 0
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    return [bos + ids[i * stride:i * stride + length - len(bos)] for i in range(count)]
