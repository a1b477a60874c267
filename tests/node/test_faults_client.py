"""Faults a local client or a bad setup can cause (issue 13, classes 1, 5 and 6): a client that
truncates its put segment while the daemon reads it, request fields out of any sane range,
bodies nested without end, names a megabyte long, a chunk the local store finds corrupt, and a
(start-up faults: test_startup.py). Each is answered with a status and a message naming
the cause, and the daemon goes on serving everyone else."""
from __future__ import annotations

import json
import logging
import os
import threading

import aiohttp
import pytest

from tests.fixtures import SMALL, synthetic_daemon, synthetic_kv, system_fixture
from kvstreamd.client import AsyncClient, ClientError
from kvstreamd.lab.daemons import wait_for
from kvstreamd.handoff.shm import Segment

MODEL = "synthetic-test-model"
CHUNK = 256  # the inprocess fixture's chunk_tokens


def shape(t: int) -> list[int]:
    return [SMALL["layers"], 2, t, SMALL["heads"], SMALL["head_dim"]]


async def error_of(d, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, str, str]:
    """(status, error code, message) of a request to d's API socket that must fail with a JSON error."""
    data = raw if raw is not None else json.dumps(body).encode()
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(d.cfg.api.socket))) as s:
        async with s.request(method, f"http://kvstreamd{path}", data=data,
                             headers={"Content-Type": "application/json"}) as r:
            status, ctype, out = r.status, r.content_type, await r.read()
    assert ctype == "application/json", (status, ctype, out[:200])
    err = json.loads(out)["error"]
    return status, err["code"], err["message"]


# -- class 1: a client's put segment cannot fault the daemon ----------------------------------------

@pytest.fixture
@system_fixture
def daemon(tmp_path, small_profile):
    """One real daemon process coding with the small synthetic profile."""
    d = synthetic_daemon(tmp_path, "a", small_profile, codec={"chunk_tokens": CHUNK})
    d.start()
    yield d
    d.stop()


def test_a_client_truncating_its_put_segment_mid_put_gets_bad_buffer_and_the_daemon_lives_on(daemon):
    """The client ftruncates its segment to 4 KiB once the daemon has stored the first chunk of a
    64-chunk put, so the daemon is mid-read. A mapping of it would SIGBUS the daemon."""
    n = 64 * CHUNK
    kv = synthetic_kv(n).half()
    seg = Segment.create(kv.numel() * 2, mode=0o640)
    view = seg.tensor(tuple(kv.shape), "float16")
    view.copy_(kv)
    del view
    body = {"model_id": MODEL, "tokens": list(range(n)), "buffer": seg.name, "shape": list(kv.shape),
            "dtype": "float16"}
    answer: dict = {}

    def put() -> None:
        try:
            answer["reply"] = daemon.client(timeout=120)._call("POST", "/v1/contexts", body)
        except (ClientError, OSError) as e:
            answer["error"] = e

    try:
        t = threading.Thread(target=put)
        t.start()
        wait_for(lambda: daemon.client().status()["store"]["chunks"] >= 1, interval=0.01, what="a first chunk")
        os.truncate(f"/dev/shm/{seg.name}", 4096)
        t.join(120)
    finally:
        seg.unlink()
        seg.close()
    assert daemon.alive(), f"the daemon died (exit {daemon.proc.returncode}):\n{daemon.log()[-2000:]}"
    assert "reply" not in answer, f"the put ended before the truncation: {answer}"
    err = answer["error"]
    assert isinstance(err, ClientError) and (err.status, err.code) == (400, "bad_buffer"), err
    assert seg.name in err.message and "truncated" in err.message, err.message
    other = daemon.client()
    assert other.health()["status"] == "ok"
    tokens, kv2 = list(range(7000, 7000 + 300)), synthetic_kv(300, seed=3).half()
    assert other.put(MODEL, tokens, kv2)["stored_chunks"] == 2
    with other.fetch(MODEL, tokens, deadline_ms=30_000) as f:
        assert [ev.kind for ev in f] == ["kv", "kv"]


# -- class 5: every numeric request field has a bound, checked at the door --------------------------

GOOD_FETCH = {"model_id": MODEL, "tokens": [1, 2, 3]}


async def test_a_deadline_of_1e30_ms_is_refused_naming_deadline_ms(inprocess):
    (a,) = await inprocess(["a"])
    for deadline in (10**30, 3_600_001):
        status, code, message = await error_of(a, "POST", "/v1/fetch", {**GOOD_FETCH, "deadline_ms": deadline})
        assert (status, code) == (400, "bad_request") and "deadline_ms" in message, (deadline, message)
    async with AsyncClient(a.cfg.api.socket) as c:  # the largest allowed is served
        async with await c.fetch(MODEL, [1, 2, 3], deadline_ms=3_600_000) as f:
            assert f.start.found_tokens == 0


async def test_a_recompute_rate_that_is_infinite_or_absurd_is_refused_naming_the_field(inprocess):
    (a,) = await inprocess(["a"])
    for raw in (b"1e999", b"1e300", b"Infinity", b"NaN"):
        body = json.dumps(GOOD_FETCH)[:-1].encode() + b', "recompute_tokens_per_s": ' + raw + b"}"
        status, code, message = await error_of(a, "POST", "/v1/fetch", raw=body)
        assert status == 400 and code in ("bad_request", "bad_json"), (raw, code, message)
        assert "recompute_tokens_per_s" in message or code == "bad_json" and "not JSON" in message, (raw, message)


async def test_more_tokens_than_a_context_may_have_are_refused_naming_tokens(inprocess):
    (a,) = await inprocess(["a"])
    for path in ("/v1/lookup", "/v1/fetch"):
        status, code, message = await error_of(a, "POST", path, {"model_id": MODEL, "tokens": [1] * (2**20 + 1)})
        assert (status, code) == (400, "bad_request") and "'tokens'" in message and len(message) < 200, message


async def test_a_shape_that_is_not_a_few_sizes_is_refused_naming_shape_without_echoing_it(inprocess):
    (a,) = await inprocess(["a"])
    for bad in ([1e30, 2, 2, 2, 8], [-1, 2, 2, 2, 8], [3, 2, 2, 2, "8"], [3] * 100_000, [2**63, 2, 2, 2, 8]):
        body = {"model_id": MODEL, "tokens": [1, 2], "buffer": "kvstreamd-1-abc", "shape": bad, "dtype": "float16"}
        status, code, message = await error_of(a, "POST", "/v1/contexts", body)
        assert (status, code) == (400, "bad_request") and "'shape'" in message and len(message) < 300, message


async def test_levels_naming_a_level_twice_or_a_huge_list_are_refused_without_echoing_them(inprocess):
    (a,) = await inprocess(["a"])
    for levels in (["fast", "fast"], ["fast"] * 1_000_000, ["x" * 1_000_000]):
        status, code, message = await error_of(a, "POST", "/v1/fetch", {**GOOD_FETCH, "levels": levels})
        assert (status, code) == (400, "bad_request") and "levels" in message and len(message) < 300, message


# -- class 6: bad input and a bad setup say so in one line -----------------------------------------

async def test_a_json_body_nested_100000_deep_is_bad_json_not_an_internal_error(inprocess):
    (a,) = await inprocess(["a"])
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        for path in ("/v1/lookup", "/v1/contexts", "/v1/fetch"):
            status, code, message = await error_of(a, "POST", path, raw=raw)
            assert (status, code) == (400, "bad_json") and "nested" in message, (path, status, code, message)
    async with AsyncClient(a.cfg.api.socket) as c:
        assert (await c.health())["status"] == "ok"


async def test_a_megabyte_model_id_is_never_echoed_whole_into_the_error_or_the_log(inprocess, caplog):
    (a,) = await inprocess(["a"])
    huge = "m" * 2**20
    caplog.set_level(logging.DEBUG)
    for path, body in (("/v1/lookup", {"model_id": huge, "tokens": [1, 2]}),
                       ("/v1/fetch", {"model_id": huge, "tokens": [1, 2]}),
                       ("/v1/contexts", {"model_id": huge, "tokens": [1, 2], "buffer": "kvstreamd-1-abc",
                                         "shape": shape(2), "dtype": "float16"})):
        status, code, message = await error_of(a, "POST", path, body)
        assert status == 400 and "model_id" in message and len(message) < 300, (path, code, message[:300])
    assert all(len(r.getMessage()) < 2000 for r in caplog.records), max(len(r.getMessage()) for r in caplog.records)


async def test_a_buffer_name_a_megabyte_long_is_not_echoed_whole(inprocess):
    (a,) = await inprocess(["a"])
    body = {"model_id": MODEL, "tokens": [1, 2], "buffer": "kvstreamd-" + "b" * 2**20, "shape": shape(2),
            "dtype": "float16"}
    status, code, message = await error_of(a, "POST", "/v1/contexts", body)
    assert (status, code) == (400, "bad_buffer") and len(message) < 300, message[:300]


def damage(d, key: bytes) -> None:
    """Flip one byte in the middle of the file d's store keeps chunk `key` in."""
    [path] = [p for p in d.cfg.store.dir.rglob(f"*{key.hex()}*") if p.is_file()]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_a_chunk_the_local_store_found_corrupt_is_reported_as_corrupt_not_evicted(inprocess):
    """memory_budget 0 keeps every chunk on disk only, so the fetch reads (and checks) the file."""
    (a,) = await inprocess(["a"], store={"memory_budget": 0})
    tokens, kv = list(range(1000, 1600)), synthetic_kv(600).half()
    async with AsyncClient(a.cfg.api.socket) as c:
        keys = [bytes.fromhex(k) for k in (await c.put(MODEL, tokens, kv))["keys"]]
        damage(a, keys[1])
        async with await c.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = [ev async for ev in f]
    assert [ev.kind for ev in events] == ["kv", "text", "kv"]
    assert "corrupt" in events[1].error and "evicted" not in events[1].error, events[1].error


PUT_600000_COSTS = """
import sys
from kvstreamd.client import Client
from tests.fixtures import synthetic_kv
tokens = list(range(40_000, 40_512))
costs = [[1e-4 * (1 + i % 7), 2e-4] for i in range(600_000)]
print(Client(sys.argv[1], timeout=120).put(sys.argv[2], tokens, synthetic_kv(512, seed=5).half(), costs=costs)["stored_chunks"])
"""


async def test_a_put_with_600000_chunk_costs_leaves_healthz_answering_throughout(daemon):
    """Issue 49, item 5: chunk_costs may list up to 2^20 chunks (a context's whole costs, sent with
    each of its pieces). A 512-token put with 600,000 of them is legal; its body was parsed and
    checked on the event loop, which held every /healthz for 5.6 s. The put comes from a process
    of its own, so that only the daemon's time is measured."""
    import asyncio
    import sys
    import time

    from tests.fixtures import REPO

    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", PUT_600000_COSTS, str(daemon.socket), MODEL,
                                                cwd=REPO, stdout=asyncio.subprocess.PIPE)
    worst = 0.0
    async with AsyncClient(daemon.socket, timeout=30) as c:
        while proc.returncode is None:
            t = time.monotonic()
            assert (await c.health())["status"] == "ok"
            worst = max(worst, time.monotonic() - t)
            try:
                await asyncio.wait_for(proc.wait(), 0.02)
            except TimeoutError:
                pass
        assert (await proc.stdout.read()).strip() == b"2"
        assert (await c.lookup(MODEL, list(range(40_000, 40_512))))["local_tokens"] == 2 * CHUNK
    print(f"slowest /healthz during the put: {worst * 1000:.0f} ms")
    # 1.98-2.02 s with the body parsed on the loop, 0.87-0.91 s by json's C parser in a thread;
    # 0.18-0.24 s now, on a 2-core machine where the client builds its body beside it (the
    # issue's floor is 0.1 s: not met by this case yet). The bound leaves room for a loaded CI.
    assert worst < 1.0, f"/healthz took {worst:.2f} s during the put"
