"""What the tests build their cases from, shared by the files that need them (conftest.py
holds the fixtures): synthetic KV and a daemon process coding with the small synthetic profile,
an in-process cluster's helpers (clients, contexts, chunk keys, scripted peers), the real
model's contexts as a daemon process codes them, chunk stores on real files, the helpers of
streaming without a network (tests/transport), and what marks a fixture `system` (conftest.py)."""
from __future__ import annotations

import asyncio
import hashlib
import os
import random
import struct
import threading
import time
from pathlib import Path

import torch

import codec
from codec.tuning import catalog
from codec import profile as profiles
from codec.tuning import registry
from kvstreamd.client import AsyncClient
from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.store.keys import chunk_keys
from kvstreamd.store.store import Store
from transport import aio
from transport.messages import Advertise
from transport.policy import Choice

DATA = Path(__file__).resolve().parent / "data"  # files the tests read: golden bitstreams, old stores, recorded visits
REPO = Path(__file__).resolve().parents[1]

# Threads torch takes in the test process for the real models: both cores when the suite runs
# alone; one in each of pytest-xdist's two workers (`make test`), where a second OpenMP thread
# spin-waits against the other worker (a codec-sensitivity test went from 24 s to 181 s).
# Results do not depend on the thread count.
MODEL_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2

# -- what makes a test a `system` test (conftest.py) ------------------------------------------

SYSTEM_FIXTURE = "_kvstreamd_system_fixture"


def system_fixture(func):
    """Marks a fixture (under its @pytest.fixture) as one that starts or loads what makes a test a
    `system` test: daemon processes, the real model, a real server, root, a CLI subprocess. Every
    test that uses it, directly or through another fixture, is marked `system` (conftest.py)."""
    setattr(func, SYSTEM_FIXTURE, True)
    return func


def is_system_fixture(func) -> bool:
    return getattr(func, SYSTEM_FIXTURE, False)


# -- synthetic KV and daemon processes -------------------------------------------------------

SMALL = dict(layers=3, heads=2, head_dim=8)


def synthetic_kv(tokens: int, seed: int = 0, layers=SMALL["layers"], heads=SMALL["heads"],
                 head_dim=SMALL["head_dim"]) -> torch.Tensor:
    """KV-like data: channels of very different scales, keys with a per-channel offset."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1.5, 0.7, heads * head_dim).view(heads, head_dim)
    kv = torch.randn(layers, 2, tokens, heads, head_dim, generator=g) * scale
    kv[:, 0] += torch.linspace(-2, 2, heads * head_dim).view(heads, head_dim)
    return kv


# A daemon process coding with the synthetic profile: 256-token chunks, one worker, and no tables
# built as the worker starts ([codec] warm_tables = "lazy"): the synthetic profile's tables take
# milliseconds at its first chunk, where warming the shipped models' ones, which such a daemon
# never codes with, took ~4 CPU-seconds a start (sixteen daemons in one test).
SYNTHETIC_CODEC = {"chunk_tokens": 256, "workers": 1, "warm_tables": "lazy"}


def synthetic_daemon(root, name: str, profile: profiles.Profile, codec: dict | None = None, **extra: dict):
    """A real daemon process (kvstreamd.lab.daemons.DaemonProcess, not started) under root/name,
    coding with `profile` (the small synthetic one), 256-token chunks and one codec worker
    unless `codec` says otherwise; `extra` adds config sections. Its worker builds no tables
    as it starts (SYNTHETIC_CODEC)."""
    from kvstreamd.lab.daemons import DaemonProcess

    path = root / f"{name}.kvprofile"
    profile.save(path)
    codec_cfg = {**SYNTHETIC_CODEC, "profile": str(path), **(codec or {})}
    return DaemonProcess(name, root / name, extra={"codec": codec_cfg, **extra})


# -- an in-process cluster (conftest's inprocess fixture) --------------------------------------

MODEL = "synthetic-test-model"
CHUNK = 256  # the chunk_tokens of the tests' daemons (the inprocess fixture, synthetic_daemon, test_daemon.py)
SECRET = b"cluster-test-secret"  # kvstreamd.lab.daemons.DaemonProcess's [peer] secret
TEXT = "text"


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


def context(n: int, seed: int = 0, first: int = 1000) -> tuple[list[int], torch.Tensor]:
    """n distinct token ids and fp16 KV for them."""
    return list(range(first, first + n)), synthetic_kv(n, seed=seed).half()


def keys_of(tokens: list[int], model_id: str = MODEL, chunk: int = CHUNK) -> list[bytes]:
    """Chunk keys as README and the protocol define them: blake2b-256 chained over the parent
    key, len(model id), model id and the chunk's token ids (u32 little-endian)."""
    keys, parent = [], b""
    m = model_id.encode()
    for s in range(0, len(tokens), chunk):
        h = hashlib.blake2b(parent, digest_size=32)
        h.update(struct.pack("<I", len(m)) + m + struct.pack(f"<{len(tokens[s:s + chunk])}I", *tokens[s:s + chunk]))
        parent = h.digest()
        keys.append(parent)
    return keys


def bounds(n: int) -> list[tuple[int, int]]:
    return [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]


def encoded(kv: torch.Tensor, prof, level: str = "balanced") -> list[bytes]:
    """Each chunk of kv encoded at level, as a daemon stores it."""
    return [codec.encode(kv[:, :, s:e].contiguous(), level, prof, start=s) for s, e in bounds(kv.shape[2])]


def decoded(kv: torch.Tensor, prof, level: str, s: int, e: int) -> torch.Tensor:
    """What chunk [s, e) of kv decodes to at level: the same pure codec the daemon's pool runs."""
    return codec.decode(codec.encode(kv[:, :, s:e].contiguous(), level, prof, start=s))


async def until(what: str, check, timeout: float = 10.0):
    t0 = time.monotonic()
    while not (got := await check()):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)
    return got


async def connected(*daemons) -> None:
    """Until every daemon reports (GET /v1/status) a connection to every other one."""
    want = {d.node_id for d in daemons}

    async def all_connected():
        for d in daemons:
            async with client(d) as c:
                if set((await c.status())["peers_connected"]) < want - {d.node_id}:
                    return False
        return True

    await until("peers did not connect", all_connected)


async def sees(d, peer: str, tokens: list[int], n: int) -> None:
    """Until d's lookup of tokens finds n tokens at peer."""
    async def check():
        async with client(d) as c:
            return (await c.lookup(MODEL, tokens))["peers"].get(peer) == n

    await until(f"{d.node_id} never saw {n} tokens at {peer}", check)


async def events_of(f) -> list:
    return [ev async for ev in f]


class ScriptedPeer:
    """A peer made from the transport alone: it authenticates to a daemon with the cluster
    secret, advertises chunk keys, and answers the daemon's FETCHes with `script(stream, fetch)`."""

    def __init__(self, node_id: str, script) -> None:
        self.node_id, self.script = node_id, script
        self.conn: aio.PeerConnection | None = None
        self.fetches: list = []

    async def _handle(self, stream, fetch) -> None:
        self.fetches.append(fetch)
        await self.script(stream, fetch)

    async def join(self, d, keys: list[bytes]) -> "ScriptedPeer":
        async with client(d) as c:
            port = (await c.status())["peer_port"]
        self.conn = await aio.connect("127.0.0.1", port, self.node_id, SECRET, handler=self._handle)
        await self.conn.send(Advertise(keys))
        return self


def serve_chunks(payloads: list[bytes], level: str = "balanced", after: int | None = None, then=None):
    """A script that sends payloads[i] for each chunk asked, waiting for each ACK; with `after`,
    it stops after that many chunks and runs `then(stream)` instead (default: hang)."""
    async def script(stream, fetch) -> None:
        for i in range(len(fetch.keys)):
            if after is not None and i == after:
                if then is not None:
                    await then(stream)
                else:
                    await asyncio.Event().wait()  # until the connection goes
                return
            await stream.send_chunk(i, level, payloads[i])
            await stream.acks.get()
        await stream.end()
    return script


async def stored(d, tokens, kv) -> list[bytes]:
    async with client(d) as c:
        return [bytes.fromhex(k) for k in (await c.put(MODEL, tokens, kv))["keys"]]


# -- the real model's contexts, as a daemon process codes them ----------------------------------

def real_context(lm, char_offset: int, n_tokens: int):
    """(model id, the first n_tokens of test.txt from char_offset on, their fp16 KV)."""
    from kvstreamd import models
    from kvstreamd.lab import corpus

    text = (corpus.wikitext_dir() / "test.txt").read_text()[char_offset:char_offset + 20 * n_tokens]
    tokens = lm.tokenizer.encode(text)[:n_tokens]
    _, kv = models.prefill(lm, tokens, all_logits=False)
    return lm.model_id, tokens, kv.half()


def expected_chunk(kv: torch.Tensor, i: int, level: str, model_id: str) -> torch.Tensor:
    """What chunk i decodes to at `level`: the same pure codec the daemon's pool runs."""
    s, e = i * CHUNK, min((i + 1) * CHUNK, kv.shape[2])
    return codec.decode(codec.encode(kv[:, :, s:e].contiguous(), level, registry.for_model(model_id), start=s))


# -- chunk stores on real files -----------------------------------------------------------------

KIB = 1024
LEVELS = ("high", "balanced", "fast")


def make_context(model="model-a", n_chunks=3, chunk_tokens=4, seed=0, payload=KIB, tokens=None) -> list[ChunkRecord]:
    """A context of n_chunks chunks, each with three levels of `payload` bytes in all."""
    rng = random.Random(seed)
    if tokens is None:
        tokens = [rng.randrange(50000) for _ in range(n_chunks * chunk_tokens)]
    keys = chunk_keys(model, tokens, chunk_tokens)
    recs = []
    for i, key in enumerate(keys):
        toks = tuple(tokens[i * chunk_tokens:(i + 1) * chunk_tokens])
        sizes = [payload // 2, payload // 4, payload - payload // 2 - payload // 4]
        recs.append(ChunkRecord(key=key, parent=keys[i - 1] if i else None, index=i, start=i * chunk_tokens,
                                model_id=model, tokens=toks, dtype="float16", shape=(2, 2, len(toks), 2, 8),
                                levels={lv: rng.randbytes(n) for lv, n in zip(LEVELS, sizes)}))
    return recs


class Events:
    """on_add / on_remove recorder."""

    def __init__(self):
        self.lock = threading.Lock()
        self.added: list[bytes] = []
        self.removed: list[bytes] = []
        self.held: set[bytes] = set()

    def on_add(self, keys):
        with self.lock:
            assert not self.held & set(keys), "on_add for a key already held"
            self.added += keys
            self.held |= set(keys)

    def on_remove(self, keys):
        with self.lock:
            assert set(keys) <= self.held, "on_remove for a key not held"
            self.removed += keys
            self.held -= set(keys)


def open_store(dir, mem=10 * 2**20, disk=10 * 2**20, events: Events | None = None, verify=False):
    s = Store(dir, mem, disk, on_add=events.on_add if events else None,
              on_remove=events.on_remove if events else None)
    report = s.open(verify=verify)
    return s, report


def chunk_file(dir: Path, key: bytes) -> Path:
    return dir / "chunks" / key.hex()[:2] / f"{key.hex()}.kvc"


# -- a clock a test moves by hand -------------------------------------------------------------------

class Clock:
    """Called, it says `now`; a test moves it (`clock.now += 5`)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- streaming without a network (tests/transport: the rules, the traces, the sender, send_chunks) ---

MB = 1e6
DPPL = catalog.dppl_table(["fp16", "int8", "high", "balanced", "fast"])  # the costs the daemon prices with


def mbit(rate: float) -> float:
    """Mbit/s -> bytes/s."""
    return rate * 1e6 / 8


def fixed(levels):
    """A rule that sends the given levels in order, whatever happens."""
    return lambda s: Choice(levels[len(levels) - s.chunks], 0.0, "fixed")
