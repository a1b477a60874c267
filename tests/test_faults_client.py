"""Faults a local client or a bad setup can cause (issue 13, classes 1, 5 and 6): a client that
truncates its put segment while the daemon reads it, request fields out of any sane range,
bodies nested without end, names a megabyte long, a chunk the local store finds corrupt, and a
start-up whose configuration cannot work. Each is answered with a status and a message naming
the cause, and the daemon goes on serving everyone else."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest

from conftest import SMALL, synthetic_kv
from kvstreamd.client import AsyncClient, Client, ClientError
from kvstreamd.lab.daemons import DaemonProcess, wait_for
from kvstreamd.shm import Segment

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
def daemon(tmp_path, small_profile):
    """One real daemon process coding with the small synthetic profile."""
    profile_path = tmp_path / "synthetic.kvprofile"
    small_profile.save(profile_path)
    d = DaemonProcess("a", tmp_path / "a", extra={"codec": {"chunk_tokens": CHUNK, "workers": 1,
                                                            "profile": str(profile_path)}})
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
