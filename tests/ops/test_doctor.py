"""`kvstreamd doctor` against a cluster of real daemon processes (the small synthetic
profile, for speed), run as the operator runs it: a subprocess with --json, its exit status
0 / 1 / 2 for ok / warn / fail. The cpu and gpu checks read this host's hardware: on a CPU
without AVX2 the cpu check warns for a real reason, and only those two may then differ from ok."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

import codec
from codec import profile as profiles
from codec.tuning import registry
from tests.fixtures import Clock, synthetic_daemon, synthetic_kv, system_fixture
from kvstreamd.ops import doctor
from kvstreamd.client import AsyncClient, ClientError
from kvstreamd.coder import PRIOR_MBPS_PER_WORKER
from kvstreamd.store.keys import chunk_keys
from kvstreamd.metrics import Metrics
from kvstreamd.metrics import RecentErrors
from kvstreamd.store.chunkfile import decode as read_chunk, encode as write_chunk
from kvstreamd.lab.daemons import wait_for
from transport import aio
from transport.messages import Advertise

MODEL = "synthetic-test-model"
TOKENS = 600  # three 256-token chunks, the last partial
PROBE_BYTES = 4 * 2**20  # well past what scheduling jitter on a shared host could hide on loopback
HARDWARE = {"cpu", "gpu"}


@pytest.fixture(scope="module")
@system_fixture
def cluster(tmp_path_factory, small_profile):
    """Four daemons, started once (a daemon takes seconds to start), each test using its own
    so that none sees another's doing: a holds (memory_budget 0: every chunk it serves is read
    from its file) and is peered with all; b, c and d are each peered with a alone. b fetches
    the healthy context, c the damaged one, and d is the peer that gets stopped; e stands alone."""
    root = tmp_path_factory.mktemp("doctor")
    a = synthetic_daemon(root, "a", small_profile, store={"memory_budget": 0})
    others = {n: synthetic_daemon(root, n, small_profile) for n in ("b", "c", "d")}
    a.peers = [d.addr for d in others.values()]
    for d in others.values():
        d.peers = [a.addr]
    nodes = {"a": a, **others, "e": synthetic_daemon(root, "e", small_profile)}
    try:
        for d in nodes.values():
            d.start(wait=0)
        for d in nodes.values():
            d.wait_healthy(180)
        wait_for(lambda: a.client().status()["peers_connected"] == ["b", "c", "d"], timeout=60,
                 what="a to connect to b, c and d")
        yield nodes
    finally:
        for d in nodes.values():
            d.kill()


def run_doctor(d) -> tuple[int, dict]:
    return doctor_at(d.socket)


def doctor_at(socket) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "doctor", "--json", "--socket", str(socket),
                          "--probe-bytes", str(PROBE_BYTES)], capture_output=True, text=True, timeout=120)
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def stored_on(a, first: int) -> tuple[list[int], list[bytes]]:
    """A context of its own (token ids from `first`) put on a; its tokens and chunk keys."""
    tokens, kv = list(range(first, first + TOKENS)), synthetic_kv(TOKENS, seed=first).half()
    keys = [bytes.fromhex(k) for k in a.client().put(MODEL, tokens, kv)["keys"]]
    return tokens, keys


def fetched_by(d, tokens) -> list:
    """d's fetch of tokens, from a, once d has heard that a holds every chunk."""
    wait_for(lambda: d.client().lookup(MODEL, tokens)["peers"].get("a") == TOKENS, timeout=30,
             what=f"{d.name} to learn a's keys")
    with d.client().fetch(MODEL, tokens, deadline_ms=30_000) as f:
        return list(f)


def damage_bitstreams(d, key: bytes) -> None:
    """Flip a byte in the middle of every level's bitstream of chunk `key` on d's disk, and
    write the file again with its own CRCs right: damage from before the chunk was written
    (a bit flipped in memory), which d's file check cannot see and so d serves."""
    [path] = [p for p in d.root.joinpath("store").rglob(f"*{key.hex()}*") if p.is_file()]
    rec = read_chunk(path.read_bytes())
    levels = {}
    for level, payload in rec.levels.items():
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0xFF
        levels[level] = bytes(bad)
    path.write_bytes(write_chunk(dataclasses.replace(rec, levels=levels)))


def test_doctor_against_a_healthy_cluster_is_all_ok_and_exits_0(cluster):
    a, b = cluster["a"], cluster["b"]
    tokens, _ = stored_on(a, 1000)
    assert [ev.kind for ev in fetched_by(b, tokens)] == ["kv"] * 3
    rc, report = run_doctor(b)
    checks = by_name(report)
    assert {"daemon", "gpu", "cpu", "decode rate", "peer a", "damaged chunks", "hit rate", "store", "pins",
            f"profile {MODEL}", "clock offset"} <= set(checks), list(checks)
    no_avx2 = torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    for name, c in checks.items():
        allowed = {"ok", "warn"} if name in HARDWARE and no_avx2 else {"ok"}
        assert c["status"] in allowed, c
    assert rc == doctor.EXIT[report["status"]] and (rc == 0 or no_avx2), report
    assert checks["peer a"]["figure"].startswith(a.addr) and "Mbit/s" in checks["peer a"]["figure"]
    assert checks["hit rate"]["figure"].startswith("100%")
    assert "; configured profile " in checks[f"profile {MODEL}"]["figure"]  # [codec] profile, not the folders'
    assert set(checks["clock offset"]["data"]["offset_s"]) == {"a"}  # a's PONG said its clock


def test_with_a_peer_stopped_its_check_fails_naming_its_address_and_the_last_error(cluster):
    a, d = cluster["a"], cluster["d"]
    assert d.stop() == 0
    last_error = wait_for(lambda: next((p["last_error"] for p in a.client().peers() if p["address"] == d.addr), None),
                          timeout=30, what="a to fail dialling d")
    rc, report = run_doctor(a)
    peer = by_name(report)["peer d"]
    assert rc == 2 and report["status"] == "fail"
    assert peer["status"] == "fail"
    assert d.addr in peer["figure"] and last_error in peer["figure"], (peer, last_error)
    assert [c["name"] for c in report["checks"] if c["status"] == "fail"] == ["peer d"]


def test_a_corrupt_chunk_fetched_in_the_last_hour_warns_with_the_count(cluster):
    a, c = cluster["a"], cluster["c"]
    tokens, keys = stored_on(a, 5000)
    damage_bitstreams(a, keys[1])
    events = fetched_by(c, tokens)
    assert [ev.kind for ev in events] == ["kv", "text", "kv"], [(ev.kind, ev.error) for ev in events]
    rc, report = run_doctor(c)
    damaged = by_name(report)["damaged chunks"]
    assert damaged["status"] == "warn" and damaged["figure"].startswith("1 in the last hour"), damaged
    assert damaged["advice"]
    assert rc == 1 and report["status"] == "warn"


async def test_a_chunk_whose_crc_fails_on_the_wire_counts_as_a_damaged_chunk(cluster, small_profile):
    """A peer made from the transport alone (the cluster secret) sends a's fetch a CHUNK whose
    crc does not match: a's connection to it closes (bad_crc), and a counts a damaged chunk."""
    a = cluster["a"]
    tokens, kv = list(range(9000, 9000 + TOKENS)), synthetic_kv(TOKENS, seed=9).half()
    payload = codec.encode(kv[:, :, :256].contiguous(), "balanced", small_profile, start=0)

    async def script(stream, fetch) -> None:
        await stream.send_chunk(0, "balanced", payload, crc=zlib.crc32(payload) ^ 1)
        await asyncio.Event().wait()  # until the connection goes

    liar = await aio.connect("127.0.0.1", a.port, "liar", a.secret.encode(), handler=script)
    try:
        await liar.send(Advertise(chunk_keys(MODEL, tokens, 256)))
        async with AsyncClient(a.socket, timeout=60) as c:
            for _ in range(200):
                if (await c.lookup(MODEL, tokens))["peers"].get("liar") == TOKENS:
                    break
                await asyncio.sleep(0.05)
            async with await c.fetch(MODEL, tokens, deadline_ms=30_000) as f:
                assert [ev.kind async for ev in f] == ["text"] * 3
            facts = await c.doctor()
    finally:
        liar.close()
    assert facts["damaged_chunks"].get("chunk_bad_crc") == 1, facts["errors"]


def test_a_daemon_that_timed_no_decode_measures_one_now_on_a_stored_chunk(cluster):
    """A chunk in SmolLM2-135M's shape (its shipped profile; 5.9 MB of fp16 for 256 tokens),
    big enough for a decode to be timed, unlike the small synthetic model's."""
    e = cluster["e"]
    shipped = profiles.Profile.load(registry.SHIPPED_DIR / "smollm2-135m-instruct.kvprofile")
    kv = synthetic_kv(256, seed=20, layers=shipped.layers, heads=shipped.heads, head_dim=shipped.head_dim).half()
    e.client().put(shipped.model_id, list(range(256)), kv)
    prior = round(PRIOR_MBPS_PER_WORKER * 0.8, 1)  # kvstreamd/coder.py's, for one worker
    assert e.client().status()["decode_mbps"] == prior  # nothing decoded yet
    decode = e.client().doctor()["decode"]
    assert decode["samples"] >= 1 and decode["mbps"] != prior, decode
    assert decode["measured_now"].startswith(f"chunk 0 of a {shipped.model_id} context"), decode


def test_a_probe_asking_for_more_bytes_than_the_bound_is_refused_naming_the_field(cluster):
    with pytest.raises(ClientError) as e:
        cluster["a"].client().probe_peers(nbytes=1 << 30)
    assert e.value.status == 400 and "'bytes'" in e.value.message


def test_a_probe_with_a_timeout_past_its_bound_is_refused_naming_the_field(cluster):
    with pytest.raises(ClientError) as e:
        cluster["a"].client().probe_peers(timeout_s=3600)
    assert e.value.status == 400 and "'timeout_s'" in e.value.message


@pytest.mark.system  # a subprocess of the CLI
def test_doctor_without_a_daemon_at_the_socket_fails_saying_so_and_exits_2(tmp_path):
    rc, report = doctor_at(tmp_path / "none.sock")
    assert rc == 2 and [(c["name"], c["status"]) for c in report["checks"]] == [("daemon", "fail")]
    assert "none.sock" in report["checks"][0]["figure"]


def test_a_host_without_a_gpu_is_ok_saying_decode_runs_on_the_cpu_workers():
    if shutil.which("nvidia-smi"):
        pytest.skip("this host has nvidia-smi: the GPU path is test_the_gpu_check_reads_nvidia_smi")
    check = doctor.gpu({"device": None, "why_not": "no CUDA device"})
    assert check.status == doctor.OK and "CPU workers" in check.figure


def test_the_gpu_check_reads_nvidia_smi():
    if not shutil.which("nvidia-smi"):
        pytest.skip("GPU path: no nvidia-smi on this host")
    check = doctor.gpu({"device": "cuda:0", "why_not": None})
    assert check.status in (doctor.OK, doctor.WARN) and "% busy" in check.figure, check


# -- what the checks make of the figures ------------------------------------------------------

def test_recent_errors_count_only_those_inside_the_window():
    clock = Clock(10_000.0)
    errors = RecentErrors(clock=clock)
    errors.add("decode")
    clock.now += 3000
    errors.add("decode", 2)
    errors.add("chunk_refused_wrong_shape")
    clock.now += 1000  # the first is now 4000 s old
    assert errors.counts(3600) == ({"chunk_refused_wrong_shape": 1, "decode": 2}, True)


def test_recent_errors_say_when_the_window_reaches_past_what_they_kept():
    clock = Clock(10_000.0)
    errors = RecentErrors(keep=3, clock=clock)
    for _ in range(5):
        errors.add("decode")
        clock.now += 1
    counts, complete = errors.counts(3600)
    assert counts == {"decode": 3} and not complete
    clock.now += 3600  # the events pushed out are older than the window now
    assert errors.counts(10)[1]


def test_damaged_chunks_are_counted_as_at_least_when_the_record_overflowed():
    check = doctor.damaged_chunks({"damaged_chunks": {"decode": 4}, "errors_complete": False, "window_s": 3600})
    assert check.status == doctor.WARN and check.figure.startswith("at least 4 in the last hour")


def test_a_peer_clock_a_few_seconds_off_warns_naming_the_peer():
    probed = [{"node_id": "a", "connected": True, "error": None, "clock_offset_ms": 0.4},
              {"node_id": "b", "connected": True, "error": None, "clock_offset_ms": -3200.0}]
    check = doctor.clocks(probed)
    assert check.status == doctor.WARN and "b -3.2 s" in check.figure and "NTP" in check.advice


def test_a_decode_rate_under_the_floor_per_worker_warns_and_a_numpy_entropy_coder_fails():
    facts = {"mbps": 120.0, "samples": 9, "workers": 2, "expected_mbps_per_core": 140.0,
             "floor_mbps_per_core": 80.0, "entropy_coder": "C"}
    assert doctor.decode(facts).status == doctor.WARN  # 60 MB/s a worker
    assert doctor.decode({**facts, "mbps": 200.0}).status == doctor.OK
    assert doctor.decode({**facts, "entropy_coder": "numpy"}).status == doctor.FAIL


def test_a_store_that_is_full_and_evicts_warns_and_a_full_disk_fails():
    store = {"chunks": 10, "disk_bytes": 95, "disk_budget": 100, "memory_bytes": 0, "memory_budget": 0,
             "evictions": 3, "disk_errors": 0}
    healthy = {"status": "ok", "degraded": []}
    assert doctor.store({"store": store, "health": healthy}).status == doctor.WARN
    assert doctor.store({"store": {**store, "evictions": 0}, "health": healthy}).status == doctor.OK
    full = {"status": "degraded", "degraded": [{"reason": "disk_full", "message": "No space left on device"}]}
    assert doctor.store({"store": store, "health": full}).status == doctor.FAIL


def test_pins_are_reported_against_the_pin_budget_where_the_daemon_has_one():
    assert doctor.pins({"pinned": 2}).figure.startswith("no pin budget")
    assert doctor.pins({"pinned_bytes": 95, "pin_budget": 100}).status == doctor.WARN
    assert doctor.pins({"pinned_bytes": 10, "pin_budget": 100}).status == doctor.OK


def test_the_cpu_check_names_the_vector_instructions_of_this_host():
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    check = doctor.cpu()
    assert ("AVX2" in check.figure) == (" avx2" in flags)
    assert torch.backends.cpu.get_cpu_capability() in check.figure


def test_a_hit_rate_under_half_of_prompt_tokens_warns():
    m = Metrics()
    m.prompt_tokens.labels("local", "control").inc(60)
    m.prompt_tokens.labels("local", "candidate").inc(40)  # the A/B arms count together
    m.prompt_tokens.labels("peer", "control").inc(50)
    m.prompt_tokens.labels("prefill", "control").inc(450)
    check = doctor.hit_rate(m.render().decode())
    assert check.status == doctor.WARN and check.figure.startswith("25% of 600 prompt tokens"), check
