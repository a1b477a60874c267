"""PagedLayout against real cache-write ops, in plain torch, for three layouts vLLM backends use:
the probe learns where each token's K and V land, a gather reads back exactly what the op
wrote, the probe leaves the cache as it found it, and an op the probe cannot account for is a
LayoutUnknown that says why."""
from __future__ import annotations

import pytest
import torch

from kvstreamd.engines.paged import LayoutUnknown, PagedLayout

BLOCK, H, D, BLOCKS = 16, 2, 8, 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _split(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return slots // BLOCK, slots % BLOCK


def cpu_cache(dtype, heads=H, dim=D):
    """vLLM CPU's cache: [blocks, H, block_size, 2*D] as allocated; its op views it as
    [blocks, H, 2*block_size, D], K the first half of dim 2 and V the second."""
    cache = torch.randn(BLOCKS, heads, BLOCK, 2 * dim).to(dtype)

    def write(key, value, slots):
        kv = cache.view(BLOCKS, heads, 2 * BLOCK, dim)
        b, o = _split(slots)
        kv[b, :, o, :] = key
        kv[b, :, BLOCK + o, :] = value
    return cache, write


def cpu_k_transposed_cache(dtype):
    """The same cache as the AVX-512 kernel fills it: within each (block, head), K is stored
    [D, block_size] (transposed) and V [block_size, D]."""
    cache = torch.randn(BLOCKS, H, BLOCK, 2 * D).to(dtype)

    def write(key, value, slots):
        per_head = cache.view(BLOCKS, H, 2 * BLOCK * D)
        k = per_head[:, :, :BLOCK * D].unflatten(2, (D, BLOCK))
        v = per_head[:, :, BLOCK * D:].unflatten(2, (BLOCK, D))
        b, o = _split(slots)
        k[b, :, :, o] = key
        v[b, :, o, :] = value
    return cache, write


def flash_cache(dtype):
    """FlashAttention's cache: [2, blocks, block_size, H, D], all K before all V, so a block's K
    and V are far apart and the block stride is a K block's size."""
    cache = torch.randn(2, BLOCKS, BLOCK, H, D).to(dtype)

    def write(key, value, slots):
        b, o = _split(slots)
        cache[0, b, o] = key
        cache[1, b, o] = value
    return cache, write


LAYOUTS = {"cpu": cpu_cache, "cpu_k_transposed": cpu_k_transposed_cache, "flash": flash_cache}
STRIDES = {"cpu": H * BLOCK * 2 * D, "cpu_k_transposed": H * BLOCK * 2 * D, "flash": BLOCK * H * D}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_gather_reads_back_exactly_what_the_write_op_stored(name, dtype):
    cache, write = LAYOUTS[name](dtype)
    layout = PagedLayout.probe(cache, write, BLOCK, H, D)
    assert layout.block_stride == STRIDES[name]
    slots = torch.tensor([3, 17, 40, 95, 66, 127, 16, 31], dtype=torch.int64)
    key, value = torch.randn(2, len(slots), H, D).to(dtype)
    write(key, value, slots)
    got = layout.gather(cache, slots)
    assert got.shape == (2, len(slots), H, D) and got.dtype == dtype
    assert torch.equal(got[0], key) and torch.equal(got[1], value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LAYOUTS)
def test_the_probe_leaves_the_cache_as_it_was(name, dtype):
    cache, write = LAYOUTS[name](dtype)
    before = cache.clone()
    PagedLayout.probe(cache, write, BLOCK, H, D)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_probe_through_blocks_apart_learns_the_same_layout(name):
    cache, write = LAYOUTS[name](torch.float16)
    near = PagedLayout.probe(cache, write, BLOCK, H, D)
    far = PagedLayout.probe(cache, write, BLOCK, H, D, blocks=(2, 5))
    assert far.block_stride == near.block_stride
    assert torch.equal(far.offsets, near.offsets)


def test_a_write_op_that_drops_the_values_is_a_layout_unknown():
    cache, write = cpu_cache(torch.float32)

    def keys_only(key, value, slots):
        write(key, torch.zeros_like(value), slots)
    with pytest.raises(LayoutUnknown, match=f"put {BLOCK * H * D} values for {2 * BLOCK * H * D} K and V"):
        PagedLayout.probe(cache, keys_only, BLOCK, H, D)


def test_a_write_op_that_stores_the_keys_twice_is_a_layout_unknown():
    cache, write = cpu_cache(torch.float32)
    before = cache.clone()

    def keys_as_values(key, value, slots):
        write(key, key, slots)
    with pytest.raises(LayoutUnknown, match="twice"):
        PagedLayout.probe(cache, keys_as_values, BLOCK, H, D)
    assert torch.equal(cache, before)


def test_a_write_op_that_rounds_what_it_stores_is_a_layout_unknown():
    # a coarser cache than the values (a quantized one): every stored value is rounded up to even;
    # with D=10 the high digits run 1..5, and 5 stored as 6 names an element past the block
    dim = 10
    cache, write = cpu_cache(torch.float32, dim=dim)

    def rounding(key, value, slots):
        write(torch.ceil(key / 2) * 2, torch.ceil(value / 2) * 2, slots)
    with pytest.raises(LayoutUnknown, match="changed the values"):
        PagedLayout.probe(cache, rounding, BLOCK, H, dim)


def test_a_cache_that_is_not_contiguous_is_a_layout_unknown():
    cache, write = flash_cache(torch.float32)
    with pytest.raises(LayoutUnknown, match="not contiguous"):
        PagedLayout.probe(cache.transpose(3, 4), write, BLOCK, H, D)
