"""Lasting pins: contexts (preloaded ones, or any a client pins) whose chunks eviction passes
over until they are unpinned or deleted, and the bytes they hold against [store] pin_budget.

Bookkeeping, not thread-safe: the store keeps one `Pins` under its lock and asks it, as it
evicts, whether a chunk is pinned. A pin is named by its context's last chunk key; contexts that
share a prefix share its chunks, which count once against the budget and stay pinned while any
pin names them. `save` and `restore` keep the pins' chunk keys in a small JSON file beside the
chunks, so that a pin outlasts a restart (and the eviction at the store's open).
"""
from __future__ import annotations

import collections
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from kvstreamd.store.files import fsync_dir
from kvstreamd.store.keys import KEY_BYTES

log = logging.getLogger(__name__)
FILE_VERSION = 1


class PinRefused(Exception):
    """A pin the store cannot grant: over the pin budget, or a chunk of it not held."""


@dataclass(frozen=True)
class Pin:
    key: bytes  # the context's last chunk key
    chunks: int  # chunks along it
    nbytes: int  # payload bytes of those chunks still held


class Pins:
    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError("the pin budget must be >= 0")
        self.budget = budget
        self.bytes = 0  # payload bytes of the distinct pinned chunks
        self._contexts: dict[bytes, tuple[bytes, ...]] = {}  # pin (last key) -> its chunk keys
        self._count: collections.Counter[bytes] = collections.Counter()  # chunk -> pins naming it
        self._sizes: dict[bytes, int] = {}  # pinned chunk -> its payload bytes (held chunks only)

    def __contains__(self, chunk: bytes) -> bool:
        """Whether a pin holds this chunk."""
        return chunk in self._count  # (counts that reach 0 are deleted)

    def pinned(self, context: bytes) -> bool:
        return context in self._contexts

    def add(self, chunks: Sequence[bytes], sizes: Mapping[bytes, int]) -> int:
        """Pin the context made of `chunks` (its last key names the pin; sizes: each held chunk's
        payload bytes). Pinning a pinned context again changes nothing. Returns the bytes newly
        pinned; PinRefused, with nothing pinned, when that would take the pinned bytes over the
        budget or a chunk is not in `sizes` (not held)."""
        if not chunks:
            raise PinRefused("a pin needs at least one chunk")
        context = chunks[-1]
        if context in self._contexts:
            return 0
        missing = [i for i, k in enumerate(chunks) if k not in sizes]
        if missing:
            raise PinRefused(f"chunk {missing[0]} of the {len(chunks)} is not held here (evicted, or never "
                             f"stored): only a context held whole can be pinned")
        new = sum(sizes[k] for k in set(chunks) if k not in self._sizes)  # (a lost chunk held again counts again)
        if self.bytes + new > self.budget:
            raise PinRefused(f"pinning {new} more bytes would take the pinned bytes over the pin budget: "
                             f"{self.bytes} bytes are pinned and [store] pin_budget is {self.budget} bytes")
        self._contexts[context] = tuple(chunks)
        for k in chunks:
            self._sizes.setdefault(k, sizes[k])
            self._count[k] += 1
        self.bytes += new
        return new

    def remove(self, context: bytes) -> list[bytes] | None:
        """Unpin a context; returns the chunks no pin holds any more, or None when it was not pinned."""
        chunks = self._contexts.pop(context, None)
        if chunks is None:
            return None
        freed = []
        for k in chunks:
            self._count[k] -= 1
            if self._count[k] <= 0:
                del self._count[k]
                self.bytes -= self._sizes.pop(k, 0)
                freed.append(k)
        return freed

    def lost(self, chunk: bytes) -> None:
        """A pinned chunk left the store all the same (its file was found damaged): its bytes no
        longer count, and its pins stay until unpinned."""
        self.bytes -= self._sizes.pop(chunk, 0)

    def save(self, path: Path) -> bool:
        """Write every pin's chunk keys (hex) to `path`, whole or not at all (temp file, fsync,
        rename); False, logged, when that fails (the pins hold until a restart all the same)."""
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "w") as f:
                pins = [[k.hex() for k in chain] for chain in self._contexts.values()]
                json.dump({"version": FILE_VERSION, "pins": pins}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)  # the rename itself survives a crash
        except OSError as e:
            log.warning("could not save the pins to %s: %s; they will not outlast a restart", path, e)
            tmp.unlink(missing_ok=True)
            return False
        return True

    def restore(self, path: Path, sizes: Mapping[bytes, int]) -> None:
        """Pin again what `save` wrote to `path` (sizes: every held chunk's payload bytes); a pin
        whose chunks are not all held, or over the budget now, is dropped, logged, and the file
        rewritten without it. A file that is not one is logged and left as it is."""
        try:
            chains = _read(path)
        except ValueError as e:
            log.warning("pins not restored: %s", e)
            return
        for chain in chains:
            try:
                self.add(chain, sizes)
            except PinRefused as e:
                log.warning("pin of context %s dropped: %s", chain[-1].hex()[:16], e)
        if len(self._contexts) < len(chains):
            self.save(path)
        if chains:
            log.info("%d of %d pins restored from %s", len(self._contexts), len(chains), path)

    def contexts(self) -> list[Pin]:
        return [Pin(key, len(chunks), sum(self._sizes.get(k, 0) for k in chunks))
                for key, chunks in self._contexts.items()]


def _read(path: Path) -> list[tuple[bytes, ...]]:
    """The chains Pins.save wrote; [] when there is no file. ValueError, saying what is wrong, for a
    file that is not one."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable: {e}") from None
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION or not isinstance(data.get("pins"), list):
        raise ValueError(f"{path}: not a version {FILE_VERSION} pins file")
    try:
        chains = [tuple(bytes.fromhex(k) for k in c) for c in data["pins"]]
    except (TypeError, ValueError):
        raise ValueError(f"{path}: a pin is not a list of hex chunk keys") from None
    if not all(c and all(len(k) == KEY_BYTES for k in c) for c in chains):
        raise ValueError(f"{path}: a pin is not a list of {KEY_BYTES}-byte chunk keys")
    return chains
