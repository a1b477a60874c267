"""Where a paged KV cache keeps each token's K and V, learned at start-up by a probe through the
attention backend's own cache-write op rather than guessed: the layouts are not documented and
differ by backend and CPU ISA (vLLM's CPU cache is [blocks, H, block_size, 2*D] per layer, and
its AVX-512 kernel stores K transposed within each (block, head)).

The probe writes numbered values into two free blocks through the write op and reads back where
each landed: the offset of every (K or V, slot in block, head, dim) from its block's start, and
the distance from one block to the next. Numbers are written in base-128 digits, one pass per
digit, so that they are exact in fp16 and bf16 caches too. Loads go through the write op
itself; saves gather by the probed offsets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# write(key [n, H, D], value [n, H, D], slots [n] int64): the backend's op that stores tokens
# into the cache at slots (block * block_size + offset)
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
DIGIT = 128  # exact in every float dtype a cache may have (bf16 keeps integers to 256)


class LayoutUnknown(Exception):
    """The probe could not account for every K and V element: the cache is not a layout a
    gather can read (say so; load and save nothing)."""


@dataclass(frozen=True)
class PagedLayout:
    offsets: torch.Tensor  # [2, block_size, H, D] int64: flat index of K/V (slot, head, dim) in block 0
    block_stride: int  # flat elements from one block to the next
    block_size: int

    @classmethod
    def probe(cls, cache: torch.Tensor, write: Write, block_size: int, heads: int, head_dim: int,
              blocks: tuple[int, int] = (0, 1)) -> PagedLayout:
        """Learn the layout of `cache` (one layer's paged cache, contiguous) by writing through
        `write` into `blocks` (two blocks no request uses: vLLM's null block 0 and a free one,
        before any request runs). The cache is left as it was."""
        if not cache.is_contiguous():
            raise LayoutUnknown(f"the cache {tuple(cache.shape)} is not contiguous")
        flat = cache.view(-1)
        saved = flat.clone()
        n = 2 * block_size * heads * head_dim
        try:
            first = cls._where(flat, write, blocks[0], block_size, heads, head_dim, n)
            second = cls._where(flat, write, blocks[1], block_size, heads, head_dim, n)
        finally:
            flat.copy_(saved)
        strides = (second - first).unique()
        if strides.numel() != 1:
            raise LayoutUnknown(f"block {blocks[1]} is not block {blocks[0]} moved by a constant")
        stride = int(strides.item()) // (blocks[1] - blocks[0])
        return cls((first - blocks[0] * stride).view(2, block_size, heads, head_dim), stride, block_size)

    @staticmethod
    def _where(flat: torch.Tensor, write: Write, block: int, block_size: int, heads: int, head_dim: int,
               n: int) -> torch.Tensor:
        """Flat index of each of the block's n K and V elements, numbered (K, slot, head, dim)."""
        ids = torch.arange(n, dtype=torch.int64)
        slots = torch.arange(block_size, dtype=torch.int64) + block * block_size
        where: torch.Tensor | None = None
        number = torch.zeros(n, dtype=torch.int64)
        place = 1
        while place < n:
            digit = (ids // place) % DIGIT + 1  # 1..128: never the 0 the cache is cleared to
            kv = digit.to(flat.dtype).view(2, block_size, heads, head_dim)
            flat.zero_()
            write(kv[0].contiguous(), kv[1].contiguous(), slots)
            hit = flat.nonzero().view(-1)
            if hit.numel() != n or (where is not None and not torch.equal(hit, where)):
                raise LayoutUnknown(f"the write op put {hit.numel()} values for {n} K and V elements")
            where = hit
            got = flat[hit].round().to(torch.int64) - 1
            if got.min() < 0 or got.max() >= DIGIT:
                raise LayoutUnknown("the write op changed the values it stored (a quantized cache?)")
            number += got * place
            place *= DIGIT
        if number.max() >= n:
            raise LayoutUnknown("the write op changed the values it stored (a quantized cache?)")
        out = torch.full((n,), -1, dtype=torch.int64)
        out[number] = where
        if (out < 0).any():
            raise LayoutUnknown("the write op stored some K/V elements twice and others not at all")
        return out

    def index(self, slots: torch.Tensor) -> torch.Tensor:
        """[2, n, H, D] flat indices of the K and V of the tokens at `slots`."""
        blocks, within = slots // self.block_size, slots % self.block_size
        return self.offsets[:, within] + (blocks * self.block_stride).view(1, -1, 1, 1)

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """[2, n, H, D]: the K and V of the tokens at `slots`, copied out of `cache`."""
        return cache.view(-1)[self.index(slots)]
