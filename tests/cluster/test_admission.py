"""What a peer sends is bounded and bound to what was asked (issue 13, classes 3 and 4): a
chunk is admitted (kvstreamd/cluster/admission.py) only at a level the fetch asked for, as the chunk of
the key asked, and with a header that declares the plan's chunk -- its token range, a profile
of the fetch's model, its shape, and for zstd its decompressed size -- before any of it is
decoded or sized; a chunk key is 32 bytes; and one peer's ADVERTISEs are kept up to
[peer] max_keys_per_peer. The allocation bounds are measured on a real daemon process (its
peak RSS, VmHWM, reset through /proc/PID/clear_refs); the hostile peers are scripted from the
transport alone, authenticated with the cluster secret."""
from __future__ import annotations

import asyncio
import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec import baselines, bitstream as bs
from tests.fixtures import SMALL, synthetic_daemon, system_fixture
from kvstreamd.cluster.admission import Refused, Wanted, admit
from kvstreamd.client import AsyncClient
from kvstreamd.store.keys import KEY_BYTES
from kvstreamd.lab.daemons import DaemonProcess
from tests.fixtures import (MODEL, SECRET, TEXT, ScriptedPeer, bounds, client, connected, context, decoded,
                             encoded, events_of, keys_of, sees, serve_chunks, stored, until)
from transport import aio
from transport.messages import Fetch, KEY_BYTES as WIRE_KEY_BYTES, Advertise

MiB = 1 << 20
CAP = 10_000  # the daemon process's [peer] max_keys_per_peer
LEVELS = ["high", "balanced", "fast"]  # what the daemons store


# -- helpers -----------------------------------------------------------------------------------

def baseline_frame(level: str, shape: tuple[int, ...], body: bytes) -> bytes:
    """A baseline bitstream as codec/baselines.py lays it out, declaring any shape:
    magic "KVB1" | u8 scheme | u8 dtype (1: fp16) | u16 L | u16 H | u16 D | u32 T | body | u32 crc32."""
    L, _, T, H, D = shape
    head = struct.pack("<4sBBHHHI", b"KVB1", baselines.SCHEMES[level].code, 1, L, H, D, T) + body
    return head + struct.pack("<I", zlib.crc32(head))


def zeros_zstd(nbytes: int) -> bytes:
    """A zstd frame of `nbytes` zero bytes that declares its size: a few KiB that claim MiBs,
    made in 1 MiB steps so that this process never holds the zeros."""
    import zstandard

    out = zstandard.ZstdCompressor(level=3).compressobj(size=nbytes)
    block = bytes(MiB)
    parts = [out.compress(block) for _ in range(nbytes // MiB)]
    return b"".join(parts) + out.flush()


def shape_of(tokens: int) -> tuple[int, ...]:
    return (SMALL["layers"], 2, tokens, SMALL["heads"], SMALL["head_dim"])


def wanted(tokens: list[int], i: int, profile, levels=LEVELS) -> Wanted:
    return Wanted.of(keys_of(tokens), bounds(len(tokens)), i, profile, levels)


class PeakRSS:
    """A process's peak resident memory from now on: VmHWM after resetting it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS
        self.before = self._read("VmRSS")

    def _read(self, field: str) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1)) * 1024

    @property
    def grown(self) -> int:
        """Bytes the peak went above the RSS at the start."""
        return self._read("VmHWM") - self.before


async def metric(c: AsyncClient, kind: str) -> float:
    m = re.search(rf'^kvstreamd_errors_total{{kind="{kind}"}} (\S+)$', await c.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


# -- a real daemon process, for what it allocates ----------------------------------------------------

@pytest.fixture(scope="module")
@system_fixture
def daemon(tmp_path_factory, small_profile):
    d = synthetic_daemon(tmp_path_factory.mktemp("bounds"), "fetcher", small_profile, peer={"max_keys_per_peer": CAP})
    d.start()
    yield d
    d.stop()


async def join(d: DaemonProcess, name: str, keys: list[bytes], script=None) -> aio.PeerConnection:
    """A scripted peer, connected and authenticated to the daemon process, that advertised keys."""
    async def no_fetch(stream, fetch):
        await stream.fail("not_found", "this scripted peer serves nothing")

    conn = await aio.connect(d.host, d.port, name, SECRET, handler=script or no_fetch)
    if keys:
        await conn.send(Advertise(keys))
    return conn


async def process_fetch(d: DaemonProcess, tokens: list[int], peer: str, levels=None):
    """Fetch tokens from the daemon process once it sees them at `peer`; (events, end, peak RSS growth)."""
    async with AsyncClient(d.socket, timeout=60) as c:
        await until(f"{d.name} never saw the chunks at {peer}",
                    lambda: _sees(c, tokens, peer))
        rss = PeakRSS(d.proc.pid)
        async with await c.fetch(MODEL, tokens, deadline_ms=30_000, levels=levels) as f:
            evs = await events_of(f)
        grown = rss.grown
        assert (await c.health())["status"] == "ok"  # and the node goes on serving
    return evs, f.end, grown


async def _sees(c: AsyncClient, tokens: list[int], peer: str) -> bool:
    return (await c.lookup(MODEL, tokens))["peers"].get(peer) == len(tokens)


def send_each(payload: bytes, level: str):
    """A script that answers every chunk asked with `payload` at `level`."""
    async def script(stream, fetch) -> None:
        for i in range(len(fetch.keys)):
            await stream.send_chunk(i, level, payload)
            await stream.acks.get()
        await stream.end()
    return script


# -- class 3: declared sizes are checked before anything is allocated --------------------------------

BOMB = 192 * MiB  # what a few KiB of zstd frame declare: the fp16 KV of 2^20 tokens of the small model
BOUND = 48 * MiB  # what a refused chunk may cost the daemon process, at most (its RSS moves a little anyway)
KEYS_BOUND = 24 * MiB  # what CAP keys and one ADVERTISE in flight may cost it (600_000 kept cost ~66 MiB)


async def test_a_chunk_at_a_level_the_fetch_did_not_ask_for_is_refused_before_it_is_decompressed(daemon):
    tokens = list(range(5000, 5256))
    huge = shape_of(BOMB // (2 * SMALL["layers"] * 2 * SMALL["heads"] * SMALL["head_dim"]))
    payload = baseline_frame("zstd-fp16", huge, zeros_zstd(BOMB))
    assert len(payload) < 64 * 1024
    conn = await join(daemon, "bomber-level", keys_of(tokens), send_each(payload, "zstd-fp16"))
    try:
        evs, end, grown = await process_fetch(daemon, tokens, "bomber-level", levels=["high"])
    finally:
        conn.close()
    assert [ev.kind for ev in evs] == ["text"]
    assert any("chunk 0" in e and "level 'zstd-fp16', which the fetch did not ask for" in e for e in end.errors), end.errors
    assert grown < BOUND, f"the daemon's peak RSS grew {grown / MiB:.0f} MiB for a {len(payload)}-byte chunk"


async def test_a_baseline_chunk_declaring_a_shape_larger_than_the_chunk_is_refused_before_it_is_decompressed(daemon):
    tokens = list(range(6000, 6256))
    huge = shape_of(BOMB // (2 * SMALL["layers"] * 2 * SMALL["heads"] * SMALL["head_dim"]))
    payload = baseline_frame("zstd-fp16", huge, zeros_zstd(BOMB))
    conn = await join(daemon, "bomber-shape", keys_of(tokens), send_each(payload, "zstd-fp16"))
    try:
        evs, end, grown = await process_fetch(daemon, tokens, "bomber-shape", levels=["zstd-fp16"])
    finally:
        conn.close()
    assert [ev.kind for ev in evs] == ["text"]
    assert any(f"declares shape {list(huge)}, the chunk's is {list(shape_of(256))}" in e for e in end.errors), end.errors
    assert grown < BOUND, f"the daemon's peak RSS grew {grown / MiB:.0f} MiB for a {len(payload)}-byte chunk"


async def test_a_zstd_frame_declaring_more_bytes_than_its_shape_is_refused_before_it_is_decompressed(daemon):
    tokens = list(range(7000, 7256))
    payload = baseline_frame("zstd-fp16", shape_of(256), zeros_zstd(BOMB))  # the right shape, a lying frame
    conn = await join(daemon, "bomber-frame", keys_of(tokens), send_each(payload, "zstd-fp16"))
    try:
        evs, end, grown = await process_fetch(daemon, tokens, "bomber-frame", levels=["zstd-fp16"])
    finally:
        conn.close()
    assert [ev.kind for ev in evs] == ["text"]
    want = 2 * SMALL["layers"] * 2 * 256 * SMALL["heads"] * SMALL["head_dim"]
    assert any(f"zstd frame declares {BOMB} bytes, the chunk's fp16 KV is {want}" in e for e in end.errors), end.errors
    assert grown < BOUND, f"the daemon's peak RSS grew {grown / MiB:.0f} MiB for a {len(payload)}-byte chunk"


@pytest.mark.parametrize("n", [1, 64])
async def test_an_advertise_with_keys_that_are_not_32_bytes_closes_that_connection_with_bad_message(daemon, n):
    conn = await join(daemon, f"odd-keys-{n}", [b"\x07" * n])
    closed = await asyncio.wait_for(conn.wait_closed(), 10)
    assert closed.code == "bad_message" and "ADVERTISE.keys: item 0" in closed.msg, closed
    async with AsyncClient(daemon.socket, timeout=60) as c:
        assert all(p["node_id"] != f"odd-keys-{n}" or p["keys"] == 0 for p in await c.peers())
        assert (await c.health())["status"] == "ok"


async def test_one_peers_advertised_keys_are_kept_up_to_max_keys_per_peer_and_the_excess_refused(daemon):
    n = 600_000
    raw = os.urandom(KEY_BYTES * n)
    keys = [raw[k:k + KEY_BYTES] for k in range(0, len(raw), KEY_BYTES)]
    del raw
    async with AsyncClient(daemon.socket, timeout=60) as c:
        before = await metric(c, "peer_keys_over_cap")
        rss = PeakRSS(daemon.proc.pid)
        conn = await join(daemon, "flooder", [])
        try:
            for s in range(0, n, 20_000):  # as the daemon's own dialer sends its store's keys
                await conn.send(Advertise(keys[s:s + 20_000]))
                await conn.ping()  # paced: what is measured is what the daemon keeps
            await until("the daemon never counted the refused keys",
                        lambda: _counted(c, before + n - CAP), timeout=60)
            grown = rss.grown
            (info,) = [p for p in await c.peers() if p["node_id"] == "flooder"]
            assert info["keys"] == CAP
            assert (await c.health())["status"] == "ok"
        finally:
            conn.close()
    assert grown < KEYS_BOUND, f"the daemon's peak RSS grew {grown / MiB:.0f} MiB for {n} advertised keys"
    assert daemon.log().count("flooder: advertises more than [peer] max_keys_per_peer") == 1


async def _counted(c: AsyncClient, want: float) -> bool:
    return await metric(c, "peer_keys_over_cap") >= want


# -- class 4: a chunk is the chunk asked for ---------------------------------------------------------

async def test_a_chunk_of_another_position_range_is_refused_and_another_holder_sends_it(inprocess, small_profile):
    holder, b = await inprocess(["holder", "fetcher"])
    tokens, kv = context(768)
    await stored(holder, tokens, kv)
    payloads = encoded(kv, small_profile)
    shifted = payloads[1:] + payloads[:1]  # chunk i answered with chunk i+1: valid KV, at other positions
    evil = await ScriptedPeer("evil", serve_chunks(shifted)).join(b, keys_of(tokens))  # "evil" < "holder": asked first
    await connected(holder, b)
    await sees(b, "evil", tokens, 768)
    await sees(b, "holder", tokens, 768)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            evs = await events_of(f)
            assert [(ev.kind, ev.source) for ev in evs] == [("kv", "holder")] * 3
            for ev in evs:
                assert torch.equal(f.kv[:, :, ev.start:ev.end], decoded(kv, small_profile, ev.level, ev.start, ev.end))
        assert any("peer evil sent chunk 0" in e and "tokens [256, 512), not the chunk's [0, 256)" in e
                   for e in f.end.errors), f.end.errors
        assert await metric(cb, "chunk_refused_wrong_range") == 1
    assert len(evil.fetches) == 1  # not asked again in that fetch


async def test_a_chunk_carrying_another_key_is_refused_and_its_peer_not_asked_again(inprocess, small_profile):
    (b,) = await inprocess(["fetcher"])
    tokens, kv = context(600)
    other = keys_of(list(range(9000, 9600)))
    payloads = encoded(kv, small_profile)

    async def script(stream, fetch) -> None:  # the right bitstreams, said to be another context's
        for i in range(len(fetch.keys)):
            await stream.send_chunk(i, "balanced", payloads[i], key=other[i])
            await stream.acks.get()
        await stream.end()

    evil = await ScriptedPeer("evil", script).join(b, keys_of(tokens))
    await sees(b, "evil", tokens, 600)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            evs = await events_of(f)
        assert [ev.kind for ev in evs] == ["text"] * 3
        assert any("peer evil sent chunk 0" in e and f"chunk of key {other[0].hex()[:16]}, not of the key asked" in e
                   for e in f.end.errors), f.end.errors
        assert await metric(cb, "chunk_refused_wrong_key") == 1
        assert (await cb.lookup(MODEL, tokens))["found_tokens"] == 600  # still a holder for the next fetch
    assert len(evil.fetches) == 1


async def test_a_daemon_sends_each_chunk_with_the_key_of_the_record_it_serves(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    keys = await stored(a, tokens, kv)
    async with client(a) as c:
        port = (await c.status())["peer_port"]
    conn = await aio.connect("127.0.0.1", port, "probe", SECRET)
    try:
        got = [m async for m in conn.fetch(Fetch.ask(keys, 30_000, ["balanced", TEXT]))]
    finally:
        conn.close()
    assert [(m.i, m.key) for m in got] == list(enumerate(keys))


# -- admission, the rules one by one ------------------------------------------------------------------

def test_the_wire_and_the_store_agree_on_the_length_of_a_chunk_key():
    assert WIRE_KEY_BYTES == KEY_BYTES == 32


def test_a_chunk_at_each_level_asked_with_the_key_and_range_asked_is_admitted(small_profile):
    tokens, kv = context(600)
    for level in ["high", "balanced", "fast", "cachegen-paper", "fp16", "zstd-fp16", "int8", "kivi2"]:
        for i, (s, e) in enumerate(bounds(600)):
            admit(_encode(kv[:, :, s:e].contiguous(), level, small_profile, s), level,
                  wanted(tokens, i, small_profile, [level]), keys_of(tokens)[i])


def _encode(kv: torch.Tensor, level: str, profile, start: int) -> bytes:
    if level in baselines.SCHEMES:
        return baselines.SCHEMES[level].encode(kv)
    return codec.encode(kv, level, profile, start=start)


def refusal(payload, level, chunk, key=None) -> Refused:
    with pytest.raises(Refused) as e:
        admit(payload, level, chunk, key)
    return e.value


def test_a_level_not_asked_is_refused_naming_it(small_profile):
    tokens, kv = context(256)
    r = refusal(_encode(kv, "fast", small_profile, 0), "fast", wanted(tokens, 0, small_profile, ["high"]))
    assert r.reason == "level_not_asked" and "'fast'" in str(r) and "high" in str(r)


def test_a_bitstream_of_another_level_than_its_chunk_says_is_refused(small_profile):
    tokens, kv = context(256)
    r = refusal(_encode(kv, "fast", small_profile, 0), "high", wanted(tokens, 0, small_profile))
    assert r.reason == "wrong_level" and "level code 3, not high's 1" in str(r)


def test_a_bitstream_of_another_token_range_is_refused(small_profile):
    tokens, kv = context(512)
    r = refusal(_encode(kv[:, :, 256:512].contiguous(), "high", small_profile, 256), "high", wanted(tokens, 0, small_profile))
    assert r.reason == "wrong_range" and "[256, 512), not the chunk's [0, 256)" in str(r)


def test_a_bitstream_declaring_more_tokens_than_the_chunk_is_refused(small_profile):
    tokens, kv = context(600)
    r = refusal(_encode(kv[:, :, 512:600].contiguous(), "high", small_profile, 512), "high",
                wanted(tokens[:560], 2, small_profile))  # the prompt's last chunk is 48 tokens
    assert r.reason == "wrong_range" and "[512, 600), not the chunk's [512, 560)" in str(r)


def test_a_bitstream_coded_for_another_model_is_refused(small_profile):
    tokens, kv = context(256)
    chunk = wanted(tokens, 0, small_profile)
    other = Wanted(chunk.key, 0, 256, "another-model", tuple(range(SMALL["layers"])), SMALL["heads"],
                   SMALL["head_dim"], tuple(LEVELS))
    r = refusal(_encode(kv, "high", small_profile, 0), "high", other)
    assert r.reason == "wrong_model" and "'synthetic-test-model', not for 'another-model'" in str(r)


def test_a_bitstream_naming_a_profile_not_known_here_is_refused(small_profile):
    tokens, kv = context(256)
    payload = bytearray(_encode(kv, "high", small_profile, 0))
    payload[24:40] = b"\xee" * 16  # the header's profile id (its crc is the decoder's to check)
    r = refusal(bytes(payload), "high", wanted(tokens, 0, small_profile))
    assert r.reason == "unknown_profile" and "ee" * 16 in str(r)


def test_a_chunk_with_another_key_is_refused_and_one_without_a_key_is_judged_by_its_header(small_profile):
    tokens, kv = context(256)
    payload = _encode(kv, "high", small_profile, 0)
    chunk = wanted(tokens, 0, small_profile)
    assert refusal(payload, "high", chunk, b"\x01" * 32).reason == "wrong_key"
    admit(payload, "high", chunk, None)  # a sender from before CHUNK.key


def test_a_baseline_declaring_another_shape_or_scheme_is_refused(small_profile):
    tokens, kv = context(256)
    chunk = wanted(tokens, 0, small_profile, ["fp16", "int8"])
    assert refusal(baseline_frame("fp16", shape_of(1 << 20), b""), "fp16", chunk).reason == "wrong_shape"
    assert refusal(_encode(kv, "fp16", small_profile, 0), "int8", chunk).reason == "wrong_level"
    assert refusal(b"junk" * 10, "fp16", chunk).reason == "bad_header"


def test_a_zstd_frame_declaring_more_than_its_shape_is_refused_and_does_not_decode(small_profile):
    tokens, _ = context(256)
    payload = baseline_frame("zstd-fp16", shape_of(256), zeros_zstd(4 * MiB))
    assert refusal(payload, "zstd-fp16", wanted(tokens, 0, small_profile, ["zstd-fp16"])).reason == "wrong_shape"
    with pytest.raises(codec.CodecError, match="declares 4194304 bytes"):
        baselines.SCHEMES["zstd-fp16"].decode(payload)


def zeros_zlib(nbytes: int) -> bytes:
    """A zlib stream of `nbytes` zero bytes (~1/1000 of that), made in 1 MiB steps."""
    out = zlib.compressobj(9)
    block = bytes(MiB)
    return b"".join(out.compress(block) for _ in range(nbytes // MiB)) + out.flush()


def with_bombed_classes(chunk: bytes, bomb: bytes) -> bytes:
    """A chunk coded with token classes, its zlib'd classes (u32 length | stream) replaced by `bomb`
    and its crc made whole again: a valid chunk but for what its classes inflate to."""
    h = bs.unpack(chunk)
    packed = zlib.compress(np.ascontiguousarray(h.token_classes, np.uint8).tobytes(), 6)
    old = struct.pack("<I", len(packed)) + packed
    assert chunk.count(old) == 1
    body = chunk[:-4].replace(old, struct.pack("<I", len(bomb)) + bomb)
    return body + struct.pack("<I", zlib.crc32(body))


async def healthz_worst(d: DaemonProcess, stop: asyncio.Event) -> float:
    """The slowest /healthz answer, asked every 20 ms until `stop`."""
    worst = 0.0
    async with AsyncClient(d.socket, timeout=30) as c:
        while not stop.is_set():
            t = asyncio.get_running_loop().time()
            await c.health()
            worst = max(worst, asyncio.get_running_loop().time() - t)
            await asyncio.sleep(0.02)
    return worst


async def test_token_classes_that_inflate_past_their_size_are_refused_before_they_are_inflated(daemon, small_profile):
    """Issue 49, item 2: a `balanced` chunk with per-token steps whose 0.5 MiB zlib stream of zeros
    would inflate to 512 MiB; the classes of its 256 tokens are ~1 KB. The daemon inflates no more
    than that, refuses the chunk, and its loop answers /healthz throughout."""
    tokens, kv = context(256, seed=49, first=7000)
    stepped = codec.Profile(dict(small_profile.meta, token_steps={"power": 0.25}), dict(small_profile.tensors))
    classes = np.random.default_rng(49).integers(0, 3, (kv.shape[0], len(tokens))).astype(np.uint8)
    chunk = codec.encode(kv.contiguous(), "balanced", stepped, start=0, token_classes=classes)
    bomb = zeros_zlib(512 * MiB)
    payload = with_bombed_classes(chunk, bomb)
    assert len(payload) < 2 * MiB and bs.TOKEN_STEPS & bs.unpack(chunk).transforms
    conn = await join(daemon, "bomber-classes", keys_of(tokens), send_each(payload, "balanced"))
    stop = asyncio.Event()
    pinger = asyncio.create_task(healthz_worst(daemon, stop))
    try:
        evs, end, grown = await process_fetch(daemon, tokens, "bomber-classes", levels=["balanced"])
    finally:
        stop.set()
        conn.close()
    worst = await pinger
    assert [ev.kind for ev in evs] == ["text"]
    assert any("token classes inflate past the" in e for e in end.errors), end.errors
    assert grown < BOUND, f"the daemon's peak RSS grew {grown / MiB:.0f} MiB for a {len(payload)}-byte chunk"
    assert worst < 0.5, f"/healthz took {worst:.2f} s while the chunk was judged"


# -- text_last: no KV after TEXT, whatever a peer sends (issue 49, item 9) ----------------------------

@pytest.mark.parametrize("text_last", [True, False])
async def test_a_peer_that_ignores_text_last_gets_no_kv_after_text_to_the_client(daemon, small_profile, text_last):
    """A peer answers chunk 0 as TEXT and chunks 1 and 2 as KV. A text_last fetch (a serving
    engine that cannot load KV after a hole) gets TEXT for all three; without text_last the
    TEXT head and then KV is a plan the client takes (it computes the head while the rest lands)."""
    tokens, kv = context(768, seed=9 + text_last, first=9000 + 1000 * text_last)
    payloads = encoded(kv, small_profile, "balanced")

    async def text_then_kv(stream, fetch) -> None:
        await stream.send_text(0, tokens[:256])
        await stream.acks.get()
        for i in (1, 2):
            await stream.send_chunk(i, "balanced", payloads[i])
            await stream.acks.get()
        await stream.end()

    name = f"text-first-{int(text_last)}"
    conn = await join(daemon, name, keys_of(tokens), text_then_kv)
    try:
        async with AsyncClient(daemon.socket, timeout=60) as c:
            await until(f"{daemon.name} never saw the chunks at {name}", lambda: _sees(c, tokens, name))
            async with await c.fetch(MODEL, tokens, deadline_ms=30_000, levels=["balanced"], text_last=text_last) as f:
                evs = await events_of(f)
                got = f.kv[:, :, 256:].clone()
            errors = await metric(c, "kv_after_text")
    finally:
        conn.close()
    kinds = [ev.kind for ev in evs]
    if text_last:
        assert kinds == ["text", "text", "text"], kinds
        assert sum("came as KV after a TEXT chunk" in e for e in f.end.errors) == 2, f.end.errors
        assert errors >= 2
    else:
        assert kinds == ["text", "kv", "kv"], kinds
        want = torch.cat([decoded(kv, small_profile, "balanced", s, s + 256) for s in (256, 512)], dim=2)
        assert torch.equal(got, want.to(got.dtype))
