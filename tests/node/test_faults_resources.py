"""A worker or a resource fault degrades a node, never breaks it: a killed codec worker is
replaced and its job run again, a full disk is a 507 that says which chunks are on disk and
which in memory only, and /healthz, /v1/status and /metrics say what is degraded until the
fault goes away by itself. Real processes (the daemon's codec workers, a daemon process), a
real 1 MiB tmpfs as the store's disk (needs root), the real API socket."""
from __future__ import annotations

import asyncio
import errno
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

import codec
from tests.fixtures import synthetic_daemon, synthetic_kv
from kvstreamd import config as config_mod
from kvstreamd.client import AsyncClient, ClientError
from kvstreamd.node.daemon import Daemon
from kvstreamd.lab.daemons import wait_for

MODEL = "synthetic-test-model"
CHUNK = 256  # the inprocess fixture's chunk_tokens


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


def context(n: int, seed: int = 0, first: int = 1000) -> tuple[list[int], torch.Tensor]:
    return list(range(first, first + n)), synthetic_kv(n, seed=seed).half()


def decoded(kv: torch.Tensor, prof, s: int, e: int, level: str) -> torch.Tensor:
    """What chunk [s, e) of kv decodes to at level (the pure codec the pool runs)."""
    return codec.decode(codec.encode(kv[:, :, s:e].contiguous(), level, prof, start=s))


async def fetched(c: AsyncClient, tokens: list[int]) -> tuple[list, torch.Tensor | None]:
    f = await c.fetch(MODEL, tokens, deadline_ms=30_000)
    async with f:
        evs = [ev async for ev in f]
        return evs, (f.kv.clone() if f.kv is not None else None)


async def until_replaced(d, c: AsyncClient, restarts: int, timeout: float = 60.0) -> list[dict]:
    """Poll /healthz until the daemon's codec pool has replaced its workers `restarts` times and
    health is ok again; returns every degraded answer seen on the way."""
    seen, t0 = [], time.monotonic()
    while True:
        h = await c.health()
        if h["status"] != "ok":
            seen.append(h)
        elif d.coder.pool.restarts >= restarts:
            return seen
        assert time.monotonic() - t0 < timeout, f"workers not replaced; health said {seen[-3:]}"
        await asyncio.sleep(0.01)


# -- a killed codec worker ---------------------------------------------------------------------

@pytest.mark.system  # codec worker processes of its own, one SIGKILLed and replaced
async def test_a_killed_codec_worker_is_degraded_health_until_replaced(inprocess):
    (a,) = await inprocess(["a"], own_pool=True)  # its worker is killed
    victim = a.coder.pool.pids()[0]
    async with client(a) as ca:
        os.kill(victim, signal.SIGKILL)
        seen = await until_replaced(a, ca, 1)
        assert seen, "/healthz never said the node was degraded"
        assert seen[0]["status"] == "degraded"
        assert [d["reason"] for d in seen[0]["degraded"]] == ["codec_workers"]
        assert str(victim) in seen[0]["degraded"][0]["message"]
        assert await ca.health() == {"status": "ok", "node_id": "a"}
        st = await ca.status()
        assert st["health"] == {"status": "ok", "degraded": []}
        assert st["codec"]["restarts"] == 1 and st["codec"]["last_loss"] == \
            f"codec worker process {victim} was killed by SIGKILL"
        text = await ca.metrics()
    assert 'kvstreamd_degraded{reason="codec_workers"} 0.0' in text
    assert "kvstreamd_codec_worker_restarts_total 1.0" in text


@pytest.mark.system  # codec worker processes of its own, one SIGKILLed and replaced
async def test_after_a_codec_worker_is_killed_the_next_put_and_fetch_succeed(inprocess, small_profile):
    (a,) = await inprocess(["a"], own_pool=True)  # its worker is killed
    tokens, kv = context(600)
    async with client(a) as ca:
        os.kill(a.coder.pool.pids()[0], signal.SIGKILL)
        put = await ca.put(MODEL, tokens, kv)  # whether or not the workers were replaced yet
        assert put["stored_chunks"] == 3 and put["placement"] == ["disk"] * 3
        evs, got = await fetched(ca, tokens)
    assert [ev.kind for ev in evs] == ["kv"] * 3
    for ev in evs:
        assert torch.equal(got[:, :, ev.start:ev.end], decoded(kv, small_profile, ev.start, ev.end, ev.level))


@pytest.mark.system  # codec worker processes of its own, one SIGKILLed and replaced
async def test_a_put_racing_a_worker_kill_is_stored_or_fails_with_the_real_error(inprocess, small_profile):
    (a,) = await inprocess(["a"], own_pool=True)  # its worker is killed
    n = 96  # ~0.5 s of encoding on an idle machine (48 chunks once finished inside the 0.3 s this waited)
    tokens, kv = context(n * CHUNK, seed=4)
    async with client(a) as ca:
        put = asyncio.ensure_future(ca.put(MODEL, tokens, kv))
        await asyncio.sleep(0.1)  # chunks are being encoded
        assert not put.done()
        os.kill(a.coder.pool.pids()[0], signal.SIGKILL)
        try:
            stored = (await put)["stored_chunks"]
        except ClientError as e:  # allowed, if it names what happened
            assert e.code == "codec_unavailable" and "codec worker process" in e.message, e
            stored = None
        await until_replaced(a, ca, 1)
        evs, got = await fetched(ca, tokens)
    held = [ev for ev in evs if ev.kind == "kv"]
    assert stored is None or (stored, len(held)) == (n, n)
    for ev in held:
        assert torch.equal(got[:, :, ev.start:ev.end], decoded(kv, small_profile, ev.start, ev.end, ev.level))


@pytest.mark.system  # a daemon process
def test_a_daemon_process_replaces_a_codec_worker_killed_by_sigkill(tmp_path, small_profile):
    d = synthetic_daemon(tmp_path, "solo", small_profile, codec={"chunk_tokens": CHUNK, "workers": 2})
    d.start()
    try:
        kids = psutil.Process(d.proc.pid).children()
        workers = [p for p in kids if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in kids]
        workers[0].kill()
        c = d.client(timeout=30)
        wait_for(lambda: c.status()["codec"]["restarts"] == 1 and c.health()["status"] == "ok", timeout=60,
                 what="the killed worker replaced")
        assert f"codec worker process {workers[0].pid} was killed by SIGKILL" == c.status()["codec"]["last_loss"]
        new = [p for p in psutil.Process(d.proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(new) == 2 and workers[0].pid not in {p.pid for p in new}
        tokens, kv = context(600, seed=8)
        assert c.put(MODEL, tokens, kv)["stored_chunks"] == 3
        with c.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            assert [ev.kind for ev in f] == ["kv"] * 3
    finally:
        d.stop()


# -- a full disk -------------------------------------------------------------------------------

def fill(mnt: Path) -> Path:
    """Fill the file system up with one file; returns it (unlink it to make room)."""
    path = mnt / "filler"
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return path


async def restarted(d: Daemon) -> Daemon:
    """Stop a daemon and start a new one from the same config file (its store reopened)."""
    await d.stop()
    new = Daemon(config_mod.load(d.cfg.source))
    await new.start()
    return new


async def test_a_put_on_a_full_disk_is_507_saying_which_chunks_are_on_disk_and_which_in_memory(
        inprocess, small_disk):
    (a,) = await inprocess(["a"], store={"dir": str(small_disk / "store"), "memory_budget": "1MiB"})
    tokens, kv = context(5 * CHUNK)
    async with client(a) as ca:
        first = await ca.put(MODEL, tokens[:3 * CHUNK], kv[:, :, :3 * CHUNK])
        assert first["placement"] == ["disk"] * 3
        filler = fill(small_disk)
        with pytest.raises(ClientError) as err:
            await ca.put(MODEL, tokens, kv)
    e = err.value
    assert (e.status, e.code) == (507, "disk_full")
    assert "chunks 3-4 of 5 are held in memory only" in e.message and "No space left" in e.message
    assert e.detail["put"]["placement"] == ["disk"] * 3 + ["memory"] * 2
    assert (e.detail["put"]["stored_chunks"], e.detail["put"]["already_held"]) == (2, 3)
    filler.unlink()


async def test_a_chunk_only_the_full_disk_could_hold_is_refused_with_507_not_a_500(inprocess, small_disk):
    (a,) = await inprocess(["a"], store={"dir": str(small_disk / "store"), "memory_budget": "1KiB"})
    tokens, kv = context(3 * CHUNK)
    async with client(a) as ca:
        fill(small_disk)
        with pytest.raises(ClientError) as err:
            await ca.put(MODEL, tokens, kv)
        e = err.value
        assert (e.status, e.code) == (507, "disk_full"), e
        assert "chunk 0 of 3" in e.message and "refused" in e.message and "No space left" in e.message
        assert e.detail["put"]["placement"] == [None] * 3
        assert (await ca.lookup(MODEL, tokens))["local_tokens"] == 0


async def test_a_restart_after_a_full_disk_loses_no_chunk_the_put_said_was_on_disk(inprocess, small_disk):
    (a,) = await inprocess(["a"], store={"dir": str(small_disk / "store"), "memory_budget": "1MiB"})
    tokens, kv = context(6 * CHUNK, seed=2)
    async with client(a) as ca:
        await ca.put(MODEL, tokens[:2 * CHUNK], kv[:, :, :2 * CHUNK])
        filler = fill(small_disk)
        with pytest.raises(ClientError) as err:
            await ca.put(MODEL, tokens, kv)
    placement = err.value.detail["put"]["placement"]
    on_disk = placement.index("memory")
    assert placement == ["disk"] * on_disk + ["memory"] * (6 - on_disk)
    b = await restarted(a)
    try:
        async with client(b) as cb:
            assert (await cb.lookup(MODEL, tokens))["local_tokens"] == on_disk * CHUNK
    finally:
        await b.stop()
    filler.unlink()


async def test_a_full_disk_is_degraded_health_until_room_is_made(inprocess, small_disk):
    (a,) = await inprocess(["a"], store={"dir": str(small_disk / "store"), "memory_budget": "1MiB"})
    tokens, kv = context(2 * CHUNK, seed=3)
    async with client(a) as ca:
        filler = fill(small_disk)
        with pytest.raises(ClientError):
            await ca.put(MODEL, tokens, kv)
        h = await ca.health()
        assert h["status"] == "degraded" and [d["reason"] for d in h["degraded"]] == ["disk_full"]
        assert str(small_disk / "store") in h["degraded"][0]["message"]
        assert (await ca.status())["health"] == {"status": "degraded", "degraded": h["degraded"]}
        assert 'kvstreamd_degraded{reason="disk_full"} 1.0' in await ca.metrics()
        filler.unlink()  # room again: health recovers with no put needed
        assert await ca.health() == {"status": "ok", "node_id": "a"}
        assert 'kvstreamd_degraded{reason="disk_full"} 0.0' in await ca.metrics()
        other, kv2 = context(CHUNK, seed=5, first=50_000)
        assert (await ca.put(MODEL, other, kv2))["placement"] == ["disk"]


async def test_a_put_again_once_room_is_made_writes_the_chunks_held_in_memory_only(inprocess, small_disk):
    (a,) = await inprocess(["a"], store={"dir": str(small_disk / "store"), "memory_budget": "1MiB"})
    tokens, kv = context(3 * CHUNK, seed=6)
    async with client(a) as ca:
        filler = fill(small_disk)
        with pytest.raises(ClientError) as err:
            await ca.put(MODEL, tokens, kv)
        assert err.value.detail["put"]["placement"] == ["memory"] * 3
        filler.unlink()
        again = await ca.put(MODEL, tokens, kv)
    assert (again["already_held"], again["placement"]) == (3, ["disk"] * 3)
    b = await restarted(a)
    try:
        async with client(b) as cb:
            assert (await cb.lookup(MODEL, tokens))["local_tokens"] == 3 * CHUNK
    finally:
        await b.stop()
