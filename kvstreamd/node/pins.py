"""A node's lasting pins: a context held here whole stays out of eviction until it is unpinned
or deleted, within [store] pin_budget (store/pins.py keeps them across restarts)."""
from __future__ import annotations

import asyncio
from typing import Callable

from codec.profile import Profile

from kvstreamd.node.errors import RequestError
from kvstreamd.store.keys import chunk_keys
from kvstreamd.store.pins import PinRefused
from kvstreamd.store.store import Store


class Pins:
    def __init__(self, store: Store, chunk_tokens: int, profile_for: Callable[[str], Profile]) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.profile_for = profile_for  # model id -> its profile; RequestError for an unknown model

    async def pin(self, model_id: str, tokens: list[int]) -> dict:
        """Pin the context held here whole for these tokens: eviction passes its chunks over
        until it is unpinned or deleted. 409 pin_refused when a chunk is not held or the pin
        would go over [store] pin_budget."""
        self.profile_for(model_id)
        keys = chunk_keys(model_id, tokens, self.chunk_tokens)
        new = await self.pin_keys(keys)
        u = self.store.usage()
        return {"key": keys[-1].hex(), "chunks": len(keys), "pinned": new, "pinned_bytes": u.pinned_bytes,
                "pin_budget": u.pin_budget}

    async def pin_keys(self, keys: list[bytes], detail: dict | None = None) -> int:
        """Pin the context of these chunk keys; `detail`: a put's reply, when a put pins."""
        try:
            return await asyncio.to_thread(self.store.pin_context, keys)
        except PinRefused as e:
            raise RequestError(409, "pin_refused", f"pin refused: {e}"
                               + ("; the context is stored, unpinned" if detail else ""), detail) from None

    def room_to_pin(self, key: bytes) -> None:
        """A put to pin is refused before any encoding when the pin budget is spent already."""
        u = self.store.usage()
        if u.pinned_bytes >= u.pin_budget and not self.store.is_pinned(key):
            raise RequestError(409, "pin_refused", f"pin refused: {u.pinned_bytes} bytes are pinned and "
                                                   f"[store] pin_budget is {u.pin_budget} bytes")

    async def unpin(self, key: bytes) -> None:
        if not await asyncio.to_thread(self.store.unpin_context, key):
            raise RequestError(404, "not_found", f"no pinned context ends at chunk {key.hex()}")

    async def list(self) -> list[dict]:
        return [{"key": p.key.hex(), "chunks": p.chunks, "bytes": p.nbytes}
                for p in await asyncio.to_thread(self.store.pins)]
