"""The daemon as real processes: three daemons on loopback, each with its own config, store and
socket. A context stored on one is found and fetched by another; the KV that lands in the
shared-memory buffer is exactly the decode of the level each chunk was sent at."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from codec import gpu
from kvstreamd.client import AsyncClient, ClientError, _UnixHTTPConnection
from kvstreamd.lab.daemons import DaemonProcess, wait_for
from tests.fixtures import CHUNK, expected_chunk, real_context

pytestmark = pytest.mark.system  # daemon processes and subprocesses of the CLI, every test


@pytest.fixture(scope="module")
def context(lm):
    """A real 600-token WikiText-2 context (3 chunks of 256, 256, 88) and its fp16 KV."""
    return real_context(lm, 20_000, 600)


def check_fetched(f, kv, model_id) -> None:
    """Every kv chunk in the buffer is bit-exact the decode of its level."""
    for ev in f.events:
        assert ev.kind == "kv", ev
        got = f.kv[:, :, ev.start:ev.end]
        want = expected_chunk(kv, ev.i, ev.level, model_id)
        assert torch.equal(got, want), f"chunk {ev.i} at {ev.level} differs"
        del got


def nodes_for(tmp_path: Path, names: list[str], **extra) -> list[DaemonProcess]:
    # no tables built as a worker starts (warm_tables "lazy"): a put or fetch of the real model's
    # chunks builds SmolLM2's as it codes, and Gemma-3's, which these daemons never code, are not built
    codec = {"chunk_tokens": CHUNK, "workers": 1, "warm_tables": "lazy"}
    nodes = [DaemonProcess(n, tmp_path / n, extra={"codec": codec, **extra}) for n in names]
    for n in nodes:
        n.peers = [m.addr for m in nodes if m is not n]
    return nodes


@pytest.fixture
def cluster(tmp_path):
    started: list[DaemonProcess] = []

    def make(names, **extra):
        nodes = nodes_for(tmp_path, names, **extra)
        for n in nodes:
            n.start(wait=0)
        for n in nodes:
            n.wait_healthy()
        started.extend(nodes)
        return nodes

    try:
        yield make
    finally:
        for n in started:
            n.stop()
            # the daemons' own account, shown (pytest prints a test's captured output) when it fails
            print(n.account(4000))


def test_three_daemons_store_on_one_fetch_from_another(cluster, context):
    model_id, tokens, kv = context
    a, b, c = cluster(["a", "b", "c"])
    wait_for(lambda: len(b.client().status()["peers_connected"]) == 2, what="b connected to a and c")

    reply = a.client().put(model_id, tokens, kv)
    assert reply["stored_chunks"] == 3 and reply["already_held"] == 0
    again = a.client().put(model_id, tokens, kv)
    assert again["stored_chunks"] == 0 and again["already_held"] == 3  # keys match: nothing re-encoded

    # b learns of a's chunks from ADVERTISE; the prompt is the context plus a question
    prompt = tokens + [1, 2, 3, 4, 5]
    found = wait_for(lambda: b.client().lookup(model_id, prompt)["peers"].get("a"), what="b sees a's chunks")
    # the context's last chunk is partial (88 tokens): it still matches the start of the prompt's
    assert found == 600
    assert b.client().lookup(model_id, prompt)["local_tokens"] == 0
    assert b.client().lookup(model_id, tokens[:300] + [7] * 50)["found_tokens"] == 256

    with b.client().fetch(model_id, prompt, deadline_ms=30_000) as f:
        events = list(f)
        assert f.found_tokens == 600
        assert [e.source for e in events] == ["a", "a", "a"]
        check_fetched(f, kv, model_id)
        end = f.end
    assert end.kv_tokens == 600 and end.text_tokens == 0 and end.prefill_from == 600
    assert end.prefill_tokens == len(prompt) - 600
    assert set(end.timings) >= {"total_s", "receive_s", "decode_s", "fill_s"}

    # the whole context as the prompt: all three chunks, from c this time too, from a and from
    # b, which kept what it fetched and serves it onward
    with c.client().fetch(model_id, tokens) as f:
        list(f)
        assert f.found_tokens == 600 and {e.source for e in f.events} <= {"a", "b"}
        check_fetched(f, kv, model_id)

    # one level asked for: every chunk at exactly that level
    with c.client().fetch(model_id, tokens, levels=["fast"]) as f:
        list(f)
        assert [e.level for e in f.events] == ["fast"] * 3
        check_fetched(f, kv, model_id)

    # a serves itself from its store
    with a.client().fetch(model_id, tokens) as f:
        list(f)
        assert {e.source for e in f.events} == {"local"}
        check_fetched(f, kv, model_id)

    metrics = b.client().metrics()
    assert 'kvstreamd_peer_bytes_total{direction="in",peer="a"}' in metrics
    assert 'kvstreamd_fetch_seconds_count{arm="control"} 1.0' in metrics
    assert a.client().contexts()[0]["tokens"] == 600

    # deleting on a withdraws the keys from its peers
    key = a.client().contexts()[0]["key"]
    assert a.client().delete_context(key) == 3
    wait_for(lambda: {p["node_id"]: p["keys"] for p in b.client().peers()}.get("a") == 0, what="b saw the WITHDRAW")
    for n in (a, b, c):
        assert n.stop() == 0, n.log()[-2000:]


def test_sigterm_flushes_and_restart_rebuilds_the_index(cluster, context, tmp_path):
    model_id, tokens, kv = context
    (a,) = cluster(["a"])
    a.client().put(model_id, tokens, kv)
    assert a.stop() == 0
    assert not a.socket.exists()  # the socket is removed on the way out
    a.start()
    assert a.client().lookup(model_id, tokens)["local_tokens"] == 600
    with a.client().fetch(model_id, tokens) as f:
        list(f)
        check_fetched(f, kv, model_id)


def test_garbage_on_the_peer_port_and_the_api_socket(cluster, context):
    model_id, tokens, kv = context
    a, b = cluster(["a", "b"])
    a.client().put(model_id, tokens, kv)
    # the peer port: junk, HTTP, a huge length prefix, a frame that is not msgpack, a half handshake
    for junk in (os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\xff\xff\xff\xff" + b"x" * 100,
                 b"\x00\x00\x00\x05hello", b"\x00\x00\x00\x10"):
        with socket.create_connection(("127.0.0.1", a.port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            try:
                s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                pass
    # the API socket: raw junk, broken HTTP, bad JSON, wrong types, a shared-memory name that does not exist
    for raw in (os.urandom(2048), b"POST /v1/fetch HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n{",
                b"\x16\x03\x01\x00\xa5\x01\x00\x00"):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(a.socket))
            s.sendall(raw)
            s.settimeout(5)
            try:
                s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                pass
    cl = a.client()
    bad = [
        ("/v1/fetch", "not json", "bad_json"),
        ("/v1/fetch", [1, 2], "bad_request"),
        ("/v1/fetch", {"model_id": model_id}, "bad_request"),
        ("/v1/fetch", {"model_id": model_id, "tokens": ["x"]}, "bad_request"),
        ("/v1/fetch", {"model_id": "no-such-model", "tokens": [1]}, "unknown_model"),
        ("/v1/fetch", {"model_id": model_id, "tokens": [1], "deadline_ms": -5}, "bad_request"),
        ("/v1/fetch", {"model_id": model_id, "tokens": [1], "levels": ["ultra"]}, "bad_request"),
        ("/v1/fetch", {"model_id": model_id, "tokens": [1], "recompute_tokens_per_s": 0}, "bad_request"),
        ("/v1/contexts", {"model_id": model_id, "tokens": [1, 2], "buffer": "kvstreamd-1-nothere",
                          "shape": [30, 2, 2, 3, 64], "dtype": "float16"}, "bad_buffer"),
        ("/v1/contexts", {"model_id": model_id, "tokens": [1, 2], "buffer": "../etc/passwd",
                          "shape": [30, 2, 2, 3, 64], "dtype": "float16"}, "bad_buffer"),
        ("/v1/contexts", {"model_id": model_id, "tokens": [1, 2], "buffer": "x", "shape": [1, 2, 3],
                          "dtype": "float16"}, "bad_shape"),
    ]
    for path, body, code in bad:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        h = _UnixHTTPConnection(str(a.socket), 10)
        h.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = h.getresponse()
        raw = resp.read()
        h.close()
        assert 400 <= resp.status < 500, (path, body, resp.status, raw)
        assert json.loads(raw)["error"]["code"] == code, (body, raw)
    with pytest.raises(ClientError) as e:
        cl.delete_context("zz")
    assert e.value.code == "bad_request"
    # still serving, to peers and locally
    assert cl.health()["status"] == "ok"
    assert a.alive()
    wait_for(lambda: b.client().lookup(model_id, tokens)["peers"].get("a"), what="b still sees a")
    with b.client().fetch(model_id, tokens) as f:
        list(f)
        assert f.end.kv_tokens == 600
        check_fetched(f, kv, model_id)
    assert 'kvstreamd_errors_total{kind="api_bad_request"}' in cl.metrics()


def _tree_rss(pid: int) -> int:
    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def test_fifty_concurrent_fetches_are_correct_and_memory_stays_bounded(cluster, context):
    model_id, tokens, kv = context
    a, b = cluster(["a", "b"], api={"max_fetches": 8})
    a.client().put(model_id, tokens, kv)
    wait_for(lambda: b.client().lookup(model_id, tokens)["peers"].get("a") == 600, what="b sees a's chunks")
    want = {(i, lv): expected_chunk(kv, i, lv, model_id) for i in range(3) for lv in ("high", "balanced", "fast")}
    base = _tree_rss(b.proc.pid)
    peak = [base]
    sampling = True

    async def sample():
        while sampling:
            peak[0] = max(peak[0], _tree_rss(b.proc.pid))
            await asyncio.sleep(0.05)

    async def one(client: AsyncClient) -> list[str]:
        f = await client.fetch(model_id, tokens, deadline_ms=60_000)
        async with f:
            async for ev in f:
                assert ev.kind == "kv", (ev, f.end.errors if f.end else None)
                assert torch.equal(f.kv[:, :, ev.start:ev.end], want[(ev.i, ev.level)])
        assert f.end.kv_tokens == 600
        return [e.level for e in f.events]

    async def main():
        nonlocal sampling
        sampler = asyncio.ensure_future(sample())
        async with AsyncClient(b.socket) as client:
            results = await asyncio.gather(*(one(client) for _ in range(50)))
        sampling = False
        await sampler
        return results

    results = asyncio.run(main())
    assert len(results) == 50 and all(len(r) == 3 for r in results)
    growth = peak[0] - base
    print(f"\n50 fetches, 8 at a time: daemon b's RSS (with its codec workers) {base / 1e6:.0f} MB before, "
          f"peak {peak[0] / 1e6:.0f} MB (+{growth / 1e6:.0f} MB)")
    # 8 fetches at a time, each with a 35 MB buffer and a few chunks in flight; 50 unbounded would be
    # far more. The bound holds with a wide margin for allocator noise.
    assert growth < 700e6, f"RSS grew by {growth / 1e6:.0f} MB"
    status = b.client().status()
    assert status["buffers_held"] == 0 and status["fetches_active"] == 0
    # What is left are the released buffers kept for the next fetches, within [api]
    # spare_buffer_bytes (512 MiB); stopping the daemon lets them go too.
    pid = b.proc.pid
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith(f"kvstreamd-{pid}-")]
    spare_bytes = sum(os.path.getsize(f"/dev/shm/{n}") for n in leftover)
    assert len(leftover) == status["buffers_spare"] >= 1 and spare_bytes <= 512 * 2**20, (leftover, status)
    gauge = next(line for line in b.client().metrics().splitlines() if line.startswith("kvstreamd_buffer_spare_bytes "))
    assert float(gauge.split()[1]) == spare_bytes
    b.stop()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"kvstreamd-{pid}-")] == []


def test_a_client_that_dies_does_not_leak_its_buffer(cluster, context):
    model_id, tokens, kv = context
    (a,) = cluster(["a"], api={"buffer_lease_s": 2.0})
    a.client().put(model_id, tokens, kv)
    code = (f"from kvstreamd.client import Client; import os\n"
            f"f = Client({str(a.socket)!r}).fetch({model_id!r}, {tokens!r})\n"
            f"print(f.start.buffer, flush=True); os._exit(9)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    name = out.stdout.strip()
    assert name.startswith(f"kvstreamd-{a.proc.pid}-"), out.stderr
    assert a.client().status()["buffers_held"] == 1
    wait_for(lambda: not os.path.exists(f"/dev/shm/{name}"), timeout=15, what="the lease to expire")
    assert a.client().status()["buffers_held"] == 0


def test_sighup_reloads_budgets_and_peers_and_refuses_a_bad_file(cluster, tmp_path):
    a, b = cluster(["a", "b"])
    cfg = a.config_path.read_text()
    a.config_path.write_text(cfg.replace('[store]', '[store]\nmemory_budget = "300MiB"'))
    a.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: a.client().status()["store"]["memory_budget"] == 300 * 2**20, what="budget reloaded")
    # drop b from a's peers: a stops dialing b (b's own connection to a may remain)
    a.config_path.write_text(a.config_path.read_text().replace(f'"{b.addr}"', ""))
    a.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: all(p["address"] != b.addr for p in a.client().peers() if p["configured"]), what="peers reloaded")
    a.config_path.write_text("[store]\nmemory_budget = 'lots'\n")
    a.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert a.alive() and a.client().status()["store"]["memory_budget"] == 300 * 2**20
    assert "reload refused" in a.log()


def test_cli_talks_to_a_running_daemon(cluster):
    (a,) = cluster(["a"])
    for cmd in (["status"], ["peers"], ["contexts"]):
        out = subprocess.run([sys.executable, "-m", "kvstreamd.cli", *cmd, "--socket", str(a.socket)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    assert json.loads(subprocess.run([sys.executable, "-m", "kvstreamd.cli", "status", "--socket", str(a.socket)],
                                     capture_output=True, text=True).stdout)["node_id"] == "a"
    out = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "status", "--socket", str(a.root / "nope.sock")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no kvstreamd at" in out.stderr


def test_bad_config_stops_start_up_naming_the_key(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[store]\nmemory_budgt = 5\n")
    out = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "run", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "[store] memory_budgt" in out.stderr and str(cfg) in out.stderr


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_default_configuration_starts_with_no_edits(tmp_path, stop):
    """`kvstreamd run` with no config file at all (fresh machine): it starts, serves, stops on
    SIGTERM, or on Ctrl-C at a terminal (SIGINT to its whole process group, codec workers
    included), quietly: no worker's KeyboardInterrupt traceback."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_STATE_HOME": str(tmp_path / "state"),
           "KVSTREAMD_CONFIG": ""}
    repo_cfg = Path(__file__).parents[2] / "config.toml"
    port = None
    from kvstreamd.lab.daemons import free_port
    port = free_port()
    # the repo's config.toml is the default configuration; only the port moves, so a daemon already
    # on 9400 here cannot make this test flaky
    cfg = tmp_path / "config.toml"
    cfg.write_text(repo_cfg.read_text().replace('listen = "127.0.0.1:9400"', f'listen = "127.0.0.1:{port}"'))
    proc = subprocess.Popen([sys.executable, "-m", "kvstreamd.cli", "run", "--config", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    sock = tmp_path / "run" / "kvstreamd" / "api.sock"
    try:
        from kvstreamd.client import Client
        wait_for(lambda: sock.exists(), timeout=90, what="the API socket")
        wait_for(lambda: _healthy(Client(sock)), timeout=30, what="healthz")
        assert oct(sock.stat().st_mode & 0o777) == oct(0o660)
        assert (tmp_path / "state" / "kvstreamd").is_dir()
    finally:
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "no [peer] secret configured" in out
    assert "stopped" in out and "Traceback" not in out and "KeyboardInterrupt" not in out, out


def _healthy(c) -> bool:
    try:
        return c.health()["status"] == "ok"
    except ClientError:
        return False


def test_a_killed_daemon_leaves_no_worker_processes(cluster):
    (a,) = cluster(["a"], codec={"chunk_tokens": CHUNK, "workers": 2})
    children = psutil.Process(a.proc.pid).children(recursive=True)
    assert len(children) >= 2  # the codec pool (and multiprocessing's resource tracker)
    a.kill()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphaned after SIGKILL: {[p.cmdline()[-1][:60] for p in alive]}"


def test_a_fetch_asking_for_the_gpu_says_why_not_and_uses_shared_memory(cluster, context):
    if gpu.available()[0]:
        pytest.skip("this host has a GPU: test_a_fetch_on_the_gpu_hands_over_device_memory runs instead")
    model_id, tokens, kv = context
    (a,) = cluster(["a"])
    a.client().put(model_id, tokens, kv)
    with a.client().fetch(model_id, tokens, device="cuda") as f:
        assert f.device == "cpu" and "CUDA" in f.start.gpu_unavailable
        f.wait()
        check_fetched(f, kv, model_id)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available()[0], reason=f"needs an NVIDIA GPU with CuPy: {gpu.available()[1]}")
def test_a_fetch_on_the_gpu_hands_over_device_memory(cluster, context):
    """device="cuda": decoded on the daemon's GPU (three CUDA streams), handed over by CUDA IPC."""
    model_id, tokens, kv = context
    (a,) = cluster(["a"])
    a.client().put(model_id, tokens, kv)
    with a.client().fetch(model_id, tokens, device="cuda") as f:
        assert f.device.startswith("cuda") and f.start.cuda_ipc
        f.wait()
        assert f.kv.is_cuda
        for ev in f.events:
            want = expected_chunk(kv, ev.i, ev.level, model_id)
            got = f.kv[:, :, ev.start:ev.end].cpu()
            assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2 * float(want.abs().max()))
            del got


def test_a_gpu_that_is_not_there_stops_start_up_when_asked_for_by_name(tmp_path):
    if gpu.available()[0]:
        pytest.skip("this host has a GPU")
    cfg = tmp_path / "gpu.toml"
    cfg.write_text(f'[codec]\ndevice = "cuda"\n[api]\nsocket = "{tmp_path}/api.sock"\n'
                   f'[store]\ndir = "{tmp_path}/store"\n[peer]\nlisten = "127.0.0.1:0"\n')
    out = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "run", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "cannot start: [codec] device = " in out.stderr and "no CUDA device" in out.stderr
