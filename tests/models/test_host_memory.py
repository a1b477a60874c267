"""models.host_memory.Recycled: a block is handed out again only once no tensor views it."""
from __future__ import annotations

import gc

import torch

from kvstreamd.models.host_memory import Recycled


def test_a_block_comes_back_when_its_last_view_is_gone_and_serves_the_next_request():
    mem = Recycled()
    a = mem.empty((4, 1000), torch.float32)
    ptr = a.data_ptr()
    view = a[1:3].permute(1, 0)  # a view of a view keeps the block
    del a
    gc.collect()
    b = mem.empty((4, 1000), torch.float32)
    assert b.data_ptr() != ptr and mem.reused == 0  # `view` still reads the first block
    view.fill_(1.0)
    del view
    gc.collect()
    assert mem.free_bytes == 16000
    c = mem.empty((2, 2, 1000), torch.float32)  # the same bytes in another shape
    assert c.data_ptr() == ptr and mem.reused == 1 and mem.free_bytes == 0
    c.fill_(2.0)
    assert (b.shape, c.shape) == ((4, 1000), (2, 2, 1000))


def test_a_small_request_does_not_pin_a_large_block_and_free_blocks_are_bounded():
    mem = Recycled(keep_bytes=20000)
    big = mem.empty((4000,), torch.float32)  # 16000 bytes
    ptr = big.data_ptr()
    del big
    small = mem.empty((100,), torch.float32)
    assert small.data_ptr() != ptr  # 400 bytes would pin 16000
    other = mem.empty((3000,), torch.float16)  # 6000 bytes: not a fit for the 16000 block either
    del small, other
    gc.collect()
    assert mem.free_bytes <= 20000  # the oldest dropped past keep_bytes


def test_of_several_free_blocks_the_smallest_that_fits_is_taken():
    mem = Recycled()
    blocks = [mem.empty((n,), torch.uint8) for n in (1000, 4000, 2000)]
    ptrs = [b.data_ptr() for b in blocks]
    del blocks
    gc.collect()
    taken = [mem.empty((n,), torch.uint8) for n in (1800, 3000, 900)]
    assert [t.data_ptr() for t in taken] == [ptrs[2], ptrs[1], ptrs[0]]
    assert mem.free_bytes == 0


def test_off_the_host_it_is_torch_empty():
    t = Recycled().empty((3, 3), torch.float32, device="meta")
    assert t.device.type == "meta" and t.shape == (3, 3)
