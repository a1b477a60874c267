"""The node in-process: daemons in the test's own event loop, talked to through the real API
socket with the AsyncClient, peered over real loopback TCP. No subprocess, no root."""
from __future__ import annotations

import asyncio
import time

import torch

import codec
from tests.fixtures import synthetic_kv
from kvstreamd.client import AsyncClient

MODEL = "synthetic-test-model"


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


async def connected(*daemons, timeout: float = 20.0) -> None:
    """Until every daemon has a connection to every other one."""
    want = {d.node_id for d in daemons}
    t0 = time.monotonic()
    while not all(set(d.peers.connected()) >= want - {d.node_id} for d in daemons):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("peers did not connect")
        await asyncio.sleep(0.05)


async def advertised(d, peer: str, keys: int, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while d.directory.counts().get(peer, 0) < keys:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{d.node_id} never learnt {keys} keys of {peer}")
        await asyncio.sleep(0.05)


async def test_a_configured_cachegen_paper_level_is_sent_at_that_level_not_as_text(inprocess, small_profile):
    """Level names are checked against the codec's levels; the sender must price every one of
    them, not only the ones its quality table happened to list."""
    a, b = await inprocess(["a", "b"], codec={"levels": ["cachegen-paper"]})
    await connected(a, b)
    kv = synthetic_kv(600, seed=3).half()
    tokens = list(range(1000, 1600))
    async with client(a) as ca, client(b) as cb:
        put = await ca.put(MODEL, tokens, kv)
        assert put["stored_chunks"] == 3
        await advertised(b, "a", 3)
        f = await cb.fetch(MODEL, tokens, deadline_ms=30_000)
        async with f:
            events = [ev async for ev in f]
            assert [ev.kind for ev in events] == ["kv"] * 3, events
            assert {ev.level for ev in events} == {"cachegen-paper"}
            for ev in events:
                want = codec.decode(codec.encode(kv[:, :, ev.start:ev.end].contiguous(), "cachegen-paper",
                                                 small_profile, start=ev.start))
                assert torch.equal(f.kv[:, :, ev.start:ev.end], want)


async def test_metrics_answer_while_a_gpu_fetch_buffer_is_held(inprocess):
    """GET /metrics sums the bytes of every buffer held for a client, whatever memory it is in.
    A CUDA buffer is held here without its device allocation (this machine has no GPU): what
    the gauge reads of it is the part under test."""
    from kvstreamd.handoff.cuda_ipc import CudaBuffer

    (a,) = await inprocess(["a"])
    buf = CudaBuffer.__new__(CudaBuffer)  # the allocation (cudaMalloc) needs a GPU; nothing else does
    buf.nbytes, buf.device, buf.ptr, buf.name, buf._closed = 4096, 0, 0, "cuda-test", True
    a.node.hold_buffer(buf)
    async with client(a) as ca:
        text = await ca._call("GET", "/metrics")
    assert "kvstreamd_buffer_bytes 4096.0" in text
    a.node.buffers.clear()  # nothing to free: it was never allocated
