"""The local API and its client, in-process: each route's answer, each malformed request's 4xx
JSON error, and the client's round trips, buffer release and errors. The daemon runs in the
test's event loop; requests go over its real Unix socket, raw (aiohttp) where the request must
be malformed, through kvstreamd.client otherwise. No subprocess, no root."""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import logging
import struct
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

import codec
from tests.fixtures import SMALL, synthetic_kv
from kvstreamd.client import AsyncClient, Client, ClientError

MODEL = "synthetic-test-model"
CHUNK = 256  # the inprocess fixture's chunk_tokens
SHAPE = [SMALL["layers"], 2, 0, SMALL["heads"], SMALL["head_dim"]]  # T at index 2


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


def context(n: int, seed: int = 0, first: int = 1000) -> tuple[list[int], torch.Tensor]:
    return list(range(first, first + n)), synthetic_kv(n, seed=seed).half()


def shape(t: int) -> list[int]:
    return [*SHAPE[:2], t, *SHAPE[3:]]


def keys_hex(tokens: list[int], model_id: str = MODEL) -> list[str]:
    """Chunk keys as README defines them: blake2b-256 chained over the parent key, len(model
    id), model id and the chunk's token ids (u32 little-endian)."""
    out, parent = [], b""
    m = model_id.encode()
    for s in range(0, len(tokens), CHUNK):
        part = tokens[s:s + CHUNK]
        parent = hashlib.blake2b(parent + struct.pack("<I", len(m)) + m + struct.pack(f"<{len(part)}I", *part),
                                 digest_size=32).digest()
        out.append(parent.hex())
    return out


async def request(d, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one raw request to d's API socket."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(d.cfg.api.socket))) as s:
        async with s.request(method, f"http://kvstreamd{path}", data=data,
                             headers={"Content-Type": "application/json"} if data is not None else {}) as r:
            return r.status, r.content_type, await r.read()


async def error_of(d, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, str]:
    """(status, error code) of a request that must fail with a JSON error."""
    status, ctype, data = await request(d, method, path, body, raw)
    assert ctype == "application/json", (status, ctype, data[:200])
    err = json.loads(data)["error"]
    assert set(err) == {"code", "message"} and err["message"], err
    return status, err["code"]


def shm_exists(name: str) -> bool:
    return Path("/dev/shm", name).exists()


# -- each route's answer ---------------------------------------------------------------------------

async def test_healthz_answers_ok_and_the_node_id(inprocess):
    (a,) = await inprocess(["a"])
    status, ctype, data = await request(a, "GET", "/healthz")
    assert (status, ctype) == (200, "application/json")
    assert json.loads(data) == {"status": "ok", "node_id": "a"}


async def test_status_reports_the_node_its_store_and_what_is_in_flight(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        st = await ca.status()
    assert st["node_id"] == "a" and st["api_socket"] == str(a.cfg.api.socket)
    assert isinstance(st["peer_port"], int) and st["peer_port"] > 0
    assert st["chunk_tokens"] == CHUNK and st["levels"] == ["high", "balanced", "fast"]
    assert st["fetches_active"] == 0 and st["buffers_held"] == 0 and st["peers_connected"] == []
    assert st["store"]["chunks"] == 3 and st["store"]["memory_bytes"] > 0


async def test_put_stores_the_chunks_and_answers_their_keys(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        reply = await ca.put(MODEL, tokens, kv)
        again = await ca.put(MODEL, tokens, kv)
    assert reply["keys"] == keys_hex(tokens)
    assert (reply["stored_chunks"], reply["already_held"]) == (3, 0)
    assert (again["stored_chunks"], again["already_held"]) == (0, 3)  # same keys: nothing re-encoded
    assert again["keys"] == reply["keys"] and reply["seconds"] >= 0


async def test_contexts_lists_each_stored_chain(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        keys = (await ca.put(MODEL, tokens, kv))["keys"]
        listed = await ca.contexts()
    assert len(listed) == 1
    c = listed[0]
    assert (c["key"], c["model_id"], c["tokens"], c["chunks"], c["complete"]) == (keys[-1], MODEL, 600, 3, True)
    assert c["bytes"] > 0 and c["created"] > 0


async def test_deleting_a_context_by_its_last_key_removes_its_chunks(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        keys = (await ca.put(MODEL, tokens, kv))["keys"]
        status, ctype, data = await request(a, "DELETE", f"/v1/contexts/{keys[-1]}")
        assert (status, json.loads(data)) == (200, {"deleted_chunks": 3})
        assert await ca.contexts() == []
        assert (await ca.lookup(MODEL, tokens))["found_tokens"] == 0


async def test_peers_lists_configured_and_connected_peers(inprocess):
    a, b = await inprocess(["a", "b"])
    async with client(a) as ca, client(b) as cb:
        await cb.put(MODEL, *context(600))
        for _ in range(400):
            peers = await ca.peers()
            if peers and peers[0]["connected"] and peers[0]["keys"] == 3:
                break
            await asyncio.sleep(0.05)
        port = (await cb.status())["peer_port"]
    assert len(peers) == 1
    p = peers[0]
    assert (p["node_id"], p["address"], p["configured"], p["connected"], p["keys"]) == (
        "b", f"127.0.0.1:{port}", True, True, 3)


async def test_lookup_answers_prompt_chunk_and_found_token_counts(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
    status, _, data = await request(a, "POST", "/v1/lookup", {"model_id": MODEL, "tokens": tokens[:512] + [1, 2]})
    assert status == 200
    assert json.loads(data) == {"prompt_tokens": 514, "chunks": 3, "local_tokens": 512, "peers": {},
                                "found_tokens": 512}


async def test_fetch_streams_ndjson_start_then_a_chunk_per_chunk_then_end(inprocess, small_profile):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
    prompt = tokens + [1, 2, 3]
    status, ctype, data = await request(a, "POST", "/v1/fetch", {"model_id": MODEL, "tokens": prompt,
                                                                  "deadline_ms": 30_000})
    assert (status, ctype) == (200, "application/x-ndjson")
    lines = [json.loads(line) for line in data.splitlines() if line.strip()]
    assert [ev["event"] for ev in lines] == ["start", "chunk", "chunk", "chunk", "end"]
    start, chunks, end = lines[0], lines[1:4], lines[4]
    assert start["shape"] == shape(600) and start["dtype"] == "float16" and start["device"] == "cpu"
    assert (start["prompt_tokens"], start["found_tokens"], start["local_tokens"], start["chunk_tokens"]) == (
        603, 600, 600, CHUNK)
    assert start["buffer"] and start["lease_s"] > 0
    assert [(c["i"], c["start"], c["end"], c["kind"], c["source"]) for c in chunks] == [
        (0, 0, 256, "kv", "local"), (1, 256, 512, "kv", "local"), (2, 512, 600, "kv", "local")]
    assert all(c["level"] in ("high", "balanced", "fast") and c["bytes"] > 0 and c["t_ms"] >= 0 for c in chunks)
    assert (end["found_tokens"], end["kv_tokens"], end["text_tokens"], end["text_ranges"]) == (600, 600, 0, [])
    assert (end["prefill_from"], end["prefill_tokens"]) == (600, 3)
    assert end["levels"] == [c["level"] for c in chunks] and end["errors"] == []
    assert set(end["timings"]) >= {"total_s", "receive_s", "decode_s", "fill_s"}
    # the buffer holds the KV until released; this raw client never mapped it
    from kvstreamd.handoff.shm import Attached
    with Attached.open(start["buffer"], tuple(start["shape"]), "float16") as att:
        for c in chunks:
            want = codec.decode(codec.encode(kv[:, :, c["start"]:c["end"]].contiguous(), c["level"], small_profile,
                                             start=c["start"]))
            assert torch.equal(att.tensor[:, :, c["start"]:c["end"]], want)
    await request(a, "DELETE", f"/v1/buffers/{start['buffer']}")


async def test_releasing_a_fetch_buffer_unlinks_it_where_no_spares_are_kept(inprocess):
    (a,) = await inprocess(["a"], api={"spare_buffer_bytes": 0})
    tokens, kv = context(300)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
    _, _, data = await request(a, "POST", "/v1/fetch", {"model_id": MODEL, "tokens": tokens})
    name = json.loads(data.splitlines()[0])["buffer"]
    assert shm_exists(name)
    status, _, body = await request(a, "DELETE", f"/v1/buffers/{name}")
    assert (status, json.loads(body)) == (200, {"released": name})
    assert not shm_exists(name)
    async with client(a) as ca:
        assert (await ca.status())["buffers_held"] == 0
    assert await error_of(a, "DELETE", f"/v1/buffers/{name}") == (404, "not_found")  # only once


async def test_a_released_buffer_is_kept_for_the_next_fetch_that_fits_and_holds_that_fetchs_kv(
        inprocess, small_profile):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    other, other_kv = context(300, seed=1, first=5000)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        await ca.put(MODEL, other, other_kv)
        async with await ca.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            name, nbytes = f.start.buffer, 2 * math.prod(f.start.shape)
            [ev async for ev in f]
        st = await ca.status()
        assert shm_exists(name) and (st["buffers_held"], st["buffers_spare"]) == (0, 1)
        assert f"kvstreamd_buffer_spare_bytes {float(nbytes)}" in await ca.metrics()
        async with await ca.fetch(MODEL, other, deadline_ms=30_000) as f:  # a smaller one fits in it
            assert f.start.buffer == name and (await ca.status())["buffers_spare"] == 0
            for ev in [ev async for ev in f]:
                want = codec.decode(codec.encode(other_kv[:, :, ev.start:ev.end].contiguous(), ev.level, small_profile,
                                                 start=ev.start))
                assert torch.equal(f.kv[:, :, ev.start:ev.end], want)
        assert (await ca.status())["buffers_spare"] == 1
    a.node.release_all()  # as at shutdown: the spares go too
    assert not shm_exists(name)


async def test_a_fetch_buffer_has_the_dtype_asked_for(inprocess, small_profile):
    (a,) = await inprocess(["a"])
    tokens, kv = context(300)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        async with await ca.fetch(MODEL, tokens, dtype=torch.float32) as f:
            events = [ev async for ev in f]
            assert f.start.dtype == "float32" and f.kv.dtype == torch.float32
            for ev in events:
                want = codec.decode(codec.encode(kv[:, :, ev.start:ev.end].contiguous(), ev.level, small_profile,
                                                 start=ev.start))
                assert torch.equal(f.kv[:, :, ev.start:ev.end], want.float())



async def test_a_fetch_asking_for_gpu_memory_on_a_daemon_without_one_uses_shared_memory_and_says_why(inprocess):
    (a,) = await inprocess(["a"], codec={"device": "cpu"})
    tokens, kv = context(300)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        async with await ca.fetch(MODEL, tokens, device="cuda") as f:
            await f.wait()
            assert f.start.device == "cpu" and f.start.gpu_unavailable
            assert f.kv is not None and not f.kv.is_cuda and f.end.kv_tokens == 300


# -- malformed requests: 4xx with a JSON error code --------------------------------------------------

GOOD_FETCH = {"model_id": MODEL, "tokens": [1, 2, 3]}


async def test_an_unknown_model_is_unknown_model(inprocess):
    (a,) = await inprocess(["a"])
    for path in ("/v1/lookup", "/v1/fetch"):
        assert await error_of(a, "POST", path, {"model_id": "no-such-model", "tokens": [1, 2]}) == (
            400, "unknown_model"), path
    body = {"model_id": "no-such-model", "tokens": [1, 2], "buffer": "kvstreamd-1-abc", "shape": shape(2),
            "dtype": "float16"}
    assert await error_of(a, "POST", "/v1/contexts", body) == (400, "unknown_model")


async def test_a_put_whose_shape_is_not_the_models_for_its_tokens_is_bad_shape(inprocess):
    (a,) = await inprocess(["a"])
    for bad in ([1, 2, 3], shape(3), [SMALL["layers"] + 1, 2, 2, SMALL["heads"], SMALL["head_dim"]], "3x2x2x2x8"):
        body = {"model_id": MODEL, "tokens": [1, 2], "buffer": "kvstreamd-1-abc", "shape": bad, "dtype": "float16"}
        code = "bad_request" if not isinstance(bad, list) else "bad_shape"
        assert await error_of(a, "POST", "/v1/contexts", body) == (400, code), bad


async def test_a_put_naming_a_segment_that_cannot_be_mapped_is_bad_buffer(inprocess):
    from kvstreamd.handoff.shm import Segment

    (a,) = await inprocess(["a"])
    small = Segment.create(16)  # far smaller than [3, 2, 2, 2, 8] fp16
    try:
        for name in ("kvstreamd-1-nothere", "../etc/passwd", small.name):
            body = {"model_id": MODEL, "tokens": [1, 2], "buffer": name, "shape": shape(2), "dtype": "float16"}
            assert await error_of(a, "POST", "/v1/contexts", body) == (400, "bad_buffer"), name
    finally:
        small.unlink()
        small.close()


async def test_releasing_a_buffer_that_is_not_held_is_not_found(inprocess):
    (a,) = await inprocess(["a"])
    assert await error_of(a, "DELETE", "/v1/buffers/kvstreamd-1-000000000000") == (404, "not_found")


async def test_deleting_a_context_not_held_is_not_found_and_a_key_not_in_hex_is_bad_request(inprocess):
    (a,) = await inprocess(["a"])
    assert await error_of(a, "DELETE", f"/v1/contexts/{'ab' * 32}") == (404, "not_found")
    assert await error_of(a, "DELETE", "/v1/contexts/zz") == (400, "bad_request")


async def test_a_rejected_request_leaves_no_buffer_and_is_counted(inprocess):
    (a,) = await inprocess(["a"])
    await error_of(a, "POST", "/v1/fetch", {**GOOD_FETCH, "levels": ["ultra"]})
    async with client(a) as ca:
        assert (await ca.health())["status"] == "ok"
        assert (await ca.status())["buffers_held"] == 0
    _, _, text = await request(a, "GET", "/metrics")
    assert 'kvstreamd_errors_total{kind="api_bad_request"} 1.0' in text.decode()


# -- the client ------------------------------------------------------------------------------------

async def test_the_blocking_client_puts_looks_up_lists_fetches_and_deletes(inprocess, small_profile):
    """Client blocks, so it runs in a thread while the daemon serves in this loop."""
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    c = Client(a.cfg.api.socket, timeout=60)

    def round_trip():
        put = c.put(MODEL, tokens, kv)
        assert put["stored_chunks"] == 3
        assert c.lookup(MODEL, tokens + [5])["found_tokens"] == 600
        [ctx] = c.contexts()
        assert ctx["tokens"] == 600 and ctx["key"] == put["keys"][-1]
        with c.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = list(f)
            assert f.found_tokens == 600 and [ev.kind for ev in events] == ["kv"] * 3
            for ev in events:
                want = codec.decode(codec.encode(kv[:, :, ev.start:ev.end].contiguous(), ev.level, small_profile,
                                                 start=ev.start))
                assert torch.equal(f.kv[:, :, ev.start:ev.end], want)
        assert c.delete_context(ctx["key"]) == 3
        assert c.contexts() == [] and c.lookup(MODEL, tokens)["found_tokens"] == 0

    await asyncio.to_thread(round_trip)


async def test_the_async_client_puts_looks_up_lists_fetches_and_deletes(inprocess, small_profile):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        put = await ca.put(MODEL, tokens, kv)
        assert (await ca.lookup(MODEL, tokens))["local_tokens"] == 600
        assert [c["key"] for c in await ca.contexts()] == [put["keys"][-1]]
        async with await ca.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = [ev async for ev in f]
            assert [(ev.start, ev.end) for ev in events] == [(0, 256), (256, 512), (512, 600)]
            for ev in events:
                want = codec.decode(codec.encode(kv[:, :, ev.start:ev.end].contiguous(), ev.level, small_profile,
                                                 start=ev.start))
                assert torch.equal(f.kv[:, :, ev.start:ev.end], want)
        assert f.end.kv_tokens == 600
        assert await ca.delete_context(put["keys"][-1]) == 3
        assert await ca.contexts() == [] and (await ca.lookup(MODEL, tokens))["found_tokens"] == 0


async def test_the_async_client_has_every_method_of_the_blocking_client(inprocess):
    """kvstreamd/client.py: "AsyncClient has the same methods as coroutines"."""
    (a,) = await inprocess(["a"])
    tokens, kv = context(300)
    public = lambda cls: {n for n in vars(cls) if not n.startswith("_")}  # noqa: E731
    assert public(Client) - public(AsyncClient) == set()
    async with client(a) as ca:
        put = await ca.put(MODEL, tokens, kv)
        assert "kvstreamd_fetch_seconds" in await ca.metrics()
        assert await ca.delete_context(put["keys"][-1]) == 2


async def test_a_fetch_used_as_a_context_manager_releases_its_buffer(inprocess):
    (a,) = await inprocess(["a"], api={"spare_buffer_bytes": 0})
    tokens, kv = context(600)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        async with await ca.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            name = f.start.buffer
            assert shm_exists(name) and (await ca.status())["buffers_held"] == 1
            [ev async for ev in f]
        assert not shm_exists(name)
        assert (await ca.status())["buffers_held"] == 0
        assert f.kv is None


async def test_a_fetch_block_left_by_an_exception_still_releases_its_buffer(inprocess):
    (a,) = await inprocess(["a"], api={"spare_buffer_bytes": 0})
    tokens, kv = context(600)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        with pytest.raises(RuntimeError, match="model crashed"):
            async with await ca.fetch(MODEL, tokens, deadline_ms=30_000) as f:
                name = f.start.buffer
                async for _ in f:
                    raise RuntimeError("model crashed")
        assert not shm_exists(name)
        for _ in range(100):  # the daemon may still be finishing the fetch it was streaming
            st = await ca.status()
            if st["buffers_held"] == 0 and st["fetches_active"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (st["buffers_held"], st["fetches_active"]) == (0, 0)
        assert (await ca.health())["status"] == "ok"


async def test_a_client_leaving_a_fetch_early_is_not_an_error_in_the_daemons_log(inprocess, caplog):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        caplog.clear()
        async with await ca.fetch(MODEL, tokens, deadline_ms=30_000):
            pass  # leaves before any chunk event is read
        for _ in range(100):
            if (await ca.status())["fetches_active"] == 0:
                break
            await asyncio.sleep(0.05)
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


async def test_metrics_answer_prometheus_text_that_counts_fetches(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(300)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        async with await ca.fetch(MODEL, tokens) as f:
            await f.wait()
    status, ctype, data = await request(a, "GET", "/metrics")
    assert (status, ctype) == (200, "text/plain")
    text = data.decode()
    assert 'kvstreamd_fetch_seconds_count{arm="control"} 1.0' in text
    assert 'kvstreamd_prompt_tokens_total{arm="control",source="local"} 300.0' in text


async def test_a_client_error_carries_the_daemons_code_and_http_status(inprocess):
    (a,) = await inprocess(["a"])
    async with client(a) as ca:
        with pytest.raises(ClientError) as e:
            await ca.lookup("no-such-model", [1, 2])
        assert (e.value.code, e.value.status) == ("unknown_model", 400) and e.value.message
        with pytest.raises(ClientError) as e:
            await ca.fetch(MODEL, [1, 2], levels=["ultra"])
        assert (e.value.code, e.value.status) == ("bad_request", 400)
    c = Client(a.cfg.api.socket, timeout=10)
    with pytest.raises(ClientError) as e:
        await asyncio.to_thread(c.delete_context, "ab" * 32)
    assert (e.value.code, e.value.status) == ("not_found", 404)


async def test_a_socket_nobody_listens_on_is_unreachable(tmp_path):
    path = tmp_path / "nobody.sock"
    async with AsyncClient(path, timeout=5) as ca:
        for call in (ca.health(), ca.lookup(MODEL, [1]), ca.fetch(MODEL, [1])):
            with pytest.raises(ClientError) as e:
                await call
            assert e.value.code == "unreachable" and e.value.status is None
    with pytest.raises(ClientError) as e:
        Client(path, timeout=5).health()
    assert e.value.code == "unreachable" and e.value.status is None


# -- a long context put piece by piece (POST /v1/contexts with start) --------------------------------

async def _fetched(c: AsyncClient, tokens: list[int]) -> torch.Tensor:
    async with await c.fetch(MODEL, tokens, levels=["high"]) as f:
        await f.wait()
        return f.kv.clone()


async def test_a_context_put_in_pieces_is_the_context_put_whole(inprocess):
    a, b = await inprocess(["a", "b"])
    tokens, kv = context(700)
    async with client(a) as ca, client(b) as cb:
        whole = await cb.put(MODEL, tokens, kv)
        first = await ca.put(MODEL, tokens[:512], kv[:, :, :512])
        rest = await ca.put(MODEL, tokens, kv[:, :, 512:], start=512)
        assert (first["stored_chunks"], rest["stored_chunks"], rest["already_held"]) == (2, 1, 0)
        assert rest["keys"] == whole["keys"] == keys_hex(tokens) and len(rest["placement"]) == 3
        assert (await ca.lookup(MODEL, tokens))["local_tokens"] == 700
        assert torch.equal(await _fetched(ca, tokens), await _fetched(cb, tokens))


async def test_a_put_from_start_needs_a_chunk_boundary_and_the_chunks_before_it(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(700)
    async with client(a) as ca:
        await ca.put(MODEL, tokens[:256], kv[:, :, :256])
        for start, code in ((100, "bad_start"), (700, "bad_start"), (512, "missing_prefix")):
            with pytest.raises(ClientError) as e:
                await ca.put(MODEL, tokens, kv[:, :, start:], start=start)
            assert e.value.code == code and e.value.status == (409 if code == "missing_prefix" else 400), start
        with pytest.raises(ClientError) as e:
            await ca.put(MODEL, tokens, kv, start=256)  # the KV of all 700 tokens, not of 256..700
        assert e.value.code == "bad_shape"
        assert (await ca.status())["store"]["chunks"] == 1
    assert await error_of(a, "POST", "/v1/contexts", {"model_id": MODEL, "tokens": tokens, "buffer": "x",
                                                      "shape": shape(700), "start": -256}) == (400, "bad_request")


@pytest.mark.parametrize("sync", [False, True])
async def test_a_put_larger_than_a_piece_goes_as_several_requests_of_whole_chunks(inprocess, monkeypatch, sync):
    from kvstreamd import client as client_mod
    a, b = await inprocess(["a", "b"])
    tokens, kv = context(1100)
    per_chunk = kv[:, :, :CHUNK].numel() * 2
    monkeypatch.setattr(client_mod, "PUT_PIECE_BYTES", 2 * per_chunk + 1)  # two chunks a request
    sent = []
    real = client_mod._put_segment

    def counted(model_id, toks, piece, start=0, costs=None, token_classes=None):
        sent.append((start, len(toks), piece.shape[2]))
        return real(model_id, toks, piece, start, costs, token_classes)

    monkeypatch.setattr(client_mod, "_put_segment", counted)
    async with client(a) as ca, client(b) as cb:
        if sync:
            reply = await asyncio.to_thread(Client(a.cfg.api.socket, timeout=60).put, MODEL, tokens, kv)
        else:
            reply = await ca.put(MODEL, tokens, kv)
        assert sent == [(0, 512, 512), (512, 1024, 512), (1024, 1100, 76)]
        assert (reply["stored_chunks"], reply["already_held"], reply["keys"]) == (5, 0, keys_hex(tokens))
        monkeypatch.setattr(client_mod, "PUT_PIECE_BYTES", 2**40)
        await cb.put(MODEL, tokens, kv)
        assert torch.equal(await _fetched(ca, tokens), await _fetched(cb, tokens))
        again = await ca.put(MODEL, tokens, kv)
        assert (again["stored_chunks"], again["already_held"]) == (0, 5)


# -- per-chunk rate control (chunk_costs, codec.tuning.rate) ---------------------------------------------------

def _steps(d, key_hex: str, level: str):
    """The [L, 2] steps chunk `key_hex` is stored with at `level` (its header's)."""
    from codec import bitstream
    return bitstream.unpack(d.store.get(bytes.fromhex(key_hex)).levels[level]).steps


@pytest.fixture
def tuned_profile(small_profile):
    """The small profile with rate control's targets (codec.tuning.rate): per-chunk steps are on."""
    rc = {"targets": {"high": 2e-3, "balanced": 5e-3, "fast": 2e-2}, "bounds": [0.5, 3.0]}
    return codec.Profile(dict(small_profile.meta, rate_control=rc), dict(small_profile.tensors))


async def test_a_put_with_chunk_costs_codes_each_chunk_at_the_steps_its_costs_give_it(inprocess, tuned_profile):
    from codec.tuning import rate
    (a,) = await inprocess(["a"], profile=tuned_profile)
    (b,) = await inprocess(["b"])  # the small profile as it is: not tuned for rate control
    tokens, kv = context(700)
    other, other_kv = context(700, seed=1, first=5000)
    costs = [[1e-6, 1e-4], [1e-6, 2e-3], [1e-3, 1e-3]]  # cheap; dear only to a prompt ending there; dear
    async with client(a) as ca, client(b) as cb:
        reply = await ca.put(MODEL, tokens, kv, costs=costs)
        plain = await ca.put(MODEL, other, other_kv)
        untuned = await cb.put(MODEL, tokens, kv, costs=costs)
        for level in ("high", "fast"):
            want = rate.scales(level, tuned_profile, [rate.ChunkCost(*c) for c in costs])
            assert want[0] > max(want[1:]) and want[1] < want[2] * 1.5
            for key, scale in zip(reply["keys"], want):
                assert np.allclose(_steps(a, key, level), tuned_profile.base_step * scale)
            fixed = codec.tuning.levels.get(level).steps(tuned_profile)
            assert all((_steps(a, key, level) == fixed).all() for key in plain["keys"])  # no costs: as before
            assert all((_steps(b, key, level) == fixed).all() for key in untuned["keys"])  # no targets: as before
        got = await _fetched(ca, tokens)  # the chunks decode as any others: the steps are in their headers
        assert got.shape == kv.shape and torch.isfinite(got).all()


async def test_chunk_costs_that_are_malformed_or_too_few_are_refused_and_nothing_is_stored(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        with pytest.raises(ClientError) as e:
            await ca.put(MODEL, tokens, kv, costs=[[1e-4, 1e-4]] * 2)  # three chunks
        assert (e.value.status, e.value.code) == (400, "bad_chunk_costs")
        assert (await ca.status())["store"]["chunks"] == 0
    body = {"model_id": MODEL, "tokens": tokens, "buffer": "x", "shape": shape(600), "dtype": "float16"}
    for bad in ([], [[1e-4]], [[1e-4, -1.0]] * 3, [["a", 1e-4]] * 3, [[1e-4, True]] * 3, [1e-4] * 3, "many"):
        assert await error_of(a, "POST", "/v1/contexts", {**body, "chunk_costs": bad}) == (400, "bad_request"), bad
