"""What a model process imports to talk to its local kvstreamd: put a context's KV, fetch a
prompt's longest cached prefix chunk by chunk, and map the fetched KV zero-copy.

    from kvstreamd.client import Client
    c = Client()                                    # the default socket, or Client(path)
    c.put(model_id, tokens, kv)                     # kv: [L, 2, T, H, D]; travels by shared memory
    with c.fetch(model_id, prompt, deadline_ms=2000) as f:
        for ev in f:                                # one event per chunk, as it lands
            ...                                     # ev.kind == "kv": f.kv[:, :, ev.start:ev.end] is ready
        kv = f.kv[:, :, :f.end.kv_tokens]           # text ranges (f.text_ranges) are the model's to recompute
    # leaving the block releases the buffer; clone what must outlive it

A hybrid model's sliding layers hold only their window of the prefix: `f.prefix` (a
codec.layout.PrefixKV) has the KV as each layer holds it, for every model; `f.kv` is its one
`[L, 2, T, H, D]` tensor where every layer holds every token.

`AsyncClient` has the same methods as coroutines (fetch is an async iterator).

The file is long (~550 lines) because it is both clients, `Client` and `AsyncClient`: the routes
that are one request and one reply are written once for both (`_Routes`), over the API's route
table and its requests (kvstreamd.requests); a put (shared-memory segments, in pieces) and a
fetch (a stream of events over one fetch state, `_FetchState`) each client does its own way."""
from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import torch

from codec import layout
from codec.bitstream import DTYPE_NAMES  # the KV dtypes a put or a fetch's buffer may be in
from codec.layout import PrefixKV

from . import events
from kvstreamd.requests import ChunkCost, ContextRequest, FetchRequest, ProbeRequest, PutRequest, to_body
from kvstreamd.routes import request
from kvstreamd.handoff.shm import SHM_DIR, Attached, Segment, ShmError

# The most KV one put request hands over: a longer context goes as several requests of whole
# chunks (POST /v1/contexts with `start`), so a put holds one piece's segment beyond kv itself.
PUT_PIECE_BYTES = 256 * 2**20


class ClientError(Exception):
    """The daemon answered with an error (`code`, `message`) or could not be reached."""

    def __init__(self, code: str, message: str, status: int | None = None, detail: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.status = code, message, status
        self.detail = detail or {}  # the error object's other fields (a put's 507: {"put": its reply})


def default_socket() -> Path:
    from .config import default_socket as ds
    return Path(os.environ.get("KVSTREAMD_SOCKET") or ds(os.environ))


ChunkEvent = events.Chunk  # what iterating a fetch yields


def _raise_for(status: int, body: bytes) -> None:
    try:
        err = json.loads(body)["error"]
        raise ClientError(err["code"], err["message"], status,
                          {k: v for k, v in err.items() if k not in ("code", "message")})
    except (ValueError, KeyError, TypeError):
        raise ClientError("http", f"HTTP {status}: {body[:200]!r}", status) from None


class _FetchState:
    """Shared by the sync and async fetch: the events, the buffer, its release."""

    def __init__(self) -> None:
        self.start: events.Start | None = None
        self.end: events.End | None = None
        self.events: list[ChunkEvent] = []
        self._att: Attached | None = None
        self._parts: list[dict] = []

    def _on(self, obj: dict) -> ChunkEvent | None:
        try:
            ev = events.from_json(obj)
        except ValueError as e:
            raise ClientError("protocol", str(e)) from None
        if isinstance(ev, events.Start):
            self.start = ev
            L, _, n, H, D = ev.shape
            self._parts = ev.parts or [{"layers": list(range(L)), "start": 0, "window": None}]
            flat = (layout.parts_numel(self._parts, n, H, D),)
            if ev.buffer and ev.cuda_ipc:  # decoded on the daemon's GPU: map its memory
                from kvstreamd.handoff.cuda_ipc import CudaAttached
                self._att = CudaAttached.open(ev.cuda_ipc, flat, ev.dtype, torch.device(ev.device).index or 0)
            elif ev.buffer:
                self._att = Attached.open(ev.buffer, flat, ev.dtype)
            return None
        if isinstance(ev, events.End):
            self.end = ev
            return None
        if isinstance(ev, events.Failed):
            raise ClientError(ev.code, ev.message)
        self.events.append(ev)
        return ev

    @property
    def prefix(self) -> PrefixKV | None:
        """The prefix's KV as its model's layers hold it (codec.layout): per group of layers a
        `[Lg, 2, T, H, D]` tensor of the tokens they read, zero-copy over the daemon's shared
        memory (or, for a fetch with device="cuda" from a daemon with a GPU, its device memory:
        see `device`); None when nothing was found."""
        if self._att is None:
            return None
        _, _, n, H, D = self.start.shape
        return layout.over(self._att.tensor, self._parts, n, H, D)

    @property
    def kv(self) -> torch.Tensor | None:
        """[L, 2, found_tokens, H, D] (as `prefix`, for a model whose layers all hold every
        token: ValueError for a hybrid model's, whose sliding layers hold their window only)."""
        prefix = self.prefix
        return prefix.dense() if prefix is not None else None

    @property
    def device(self) -> str:
        """Where kv lives: "cpu", or the daemon's GPU ("cuda:0") when it decoded there."""
        return self.start.device if self.start else "cpu"

    @property
    def found_tokens(self) -> int:
        return self.start.found_tokens if self.start else 0

    @property
    def text_ranges(self) -> list[tuple[int, int]]:
        return [(e.start, e.end) for e in self.events if e.kind == "text"]

    def _detach(self, unwinding: bool = False) -> str | None:
        """Unmap the buffer; ShmError if the caller still holds views of it, except while an
        exception leaves the fetch's block (`unwinding`): its traceback may hold the views, and
        that exception is the one to see. The mapping then goes with the last view."""
        if self._att is None:
            return None
        name = self.start.buffer
        try:
            self._att.release()
        except ShmError:
            if not unwinding:
                raise
        self._att = None
        return name


class Fetch(_FetchState):
    def __init__(self, client: "Client", conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        super().__init__()
        self._client, self._conn, self._resp = client, conn, resp
        self._read_until_start()

    def _lines(self) -> Iterator[dict]:
        while line := self._resp.readline():
            if line.strip():
                yield json.loads(line)

    def _read_until_start(self) -> None:
        for ev in self._lines():
            self._on(ev)
            if self.start is not None:
                return
        raise ClientError("protocol", "the daemon closed the fetch before its start event")

    def __iter__(self) -> Iterator[ChunkEvent]:
        for ev in self._lines():
            ce = self._on(ev)
            if ce is not None:
                yield ce
        self._conn.close()
        if self.end is None:
            raise ClientError("fetch_interrupted", "the daemon closed the fetch before its end event")

    def wait(self) -> events.End:
        """Consume every event; returns the end event."""
        for _ in self:
            pass
        return self.end

    def release(self, _unwinding: bool = False) -> None:
        """Unmap the buffer and tell the daemon it can go (views of kv must be dropped first)."""
        name = self._detach(_unwinding)
        self._conn.close()
        if name:
            self._client._call(*request("release_buffer", name=name), ok_missing=True)

    def __enter__(self) -> "Fetch":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.release(exc_type is not None)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError as e:
            s.close()
            raise ClientError("unreachable", f"no kvstreamd at {self._path}: {e.strerror or e}") from None
        self.sock = s


@dataclass(frozen=True)
class _Call:
    """One call of a route: its path parameters, its request (kvstreamd.requests) and the key
    of the reply's object that the method returns (None: the whole reply)."""

    route: str
    body: Any = None
    params: dict = field(default_factory=dict)
    pick: str | None = None


class _Routes:
    """The routes that are one request and one reply, once for both clients: each method is
    what `_run` makes of its call (Client: the reply; AsyncClient: a coroutine of it)."""

    def _run(self, call: _Call) -> Any:
        raise NotImplementedError

    def health(self) -> dict:
        return self._run(_Call("healthz"))

    def status(self) -> dict:
        return self._run(_Call("status"))

    def metrics(self) -> str:
        return self._run(_Call("metrics"))

    def probe_peers(self, nbytes: int | None = None, timeout_s: float | None = None) -> list[dict]:
        """Each connected peer's round trip, bandwidth and clock offset, measured now (bounded)."""
        given = {k: v for k, v in (("bytes", nbytes), ("timeout_s", timeout_s)) if v is not None}
        return self._run(_Call("probe_peers", ProbeRequest(**given), pick="peers"))

    def doctor(self) -> dict:
        return self._run(_Call("doctor"))

    def contexts(self) -> list[dict]:
        return self._run(_Call("contexts", pick="contexts"))

    def delete_context(self, key: str) -> int:
        return self._run(_Call("delete_context", params={"key": key}, pick="deleted_chunks"))

    def peers(self) -> list[dict]:
        return self._run(_Call("peers", pick="peers"))

    def ab(self) -> dict:
        """GET /v1/ab: the policy experiment in force and the latest fetch outcomes."""
        return self._run(_Call("ab"))

    def lookup(self, model_id: str, tokens: list[int]) -> dict:
        return self._run(_Call("lookup", ContextRequest(model_id, list(tokens))))

    def pin(self, model_id: str, tokens: list[int]) -> dict:
        """Pin the context held for these tokens: the daemon's eviction passes it over until
        unpin() or delete_context(). ClientError pin_refused over [store] pin_budget."""
        return self._run(_Call("pin", ContextRequest(model_id, list(tokens))))

    def unpin(self, key: str) -> str:
        """Unpin the context whose last chunk key is `key` (hex); it stays stored. Returns `key`."""
        return self._run(_Call("unpin", params={"key": key}, pick="unpinned"))

    def pins(self) -> list[dict]:
        return self._run(_Call("pins", pick="pins"))


def _picked(call: _Call, reply: Any) -> Any:
    return reply if call.pick is None else reply[call.pick]


class Client(_Routes):
    """Blocking client (one HTTP connection per call)."""

    def __init__(self, socket_path: str | Path | None = None, timeout: float | None = 600.0):
        self.path = str(socket_path or default_socket())
        self.timeout = timeout

    def _request(self, method: str, path: str, body: Any = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = _UnixHTTPConnection(self.path, self.timeout)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        return conn, conn.getresponse()

    def _call(self, method: str, path: str, body: Any = None, ok_missing: bool = False) -> Any:
        conn, resp = self._request(method, path, body)
        try:
            raw = resp.read()
        finally:
            conn.close()
        if resp.status >= 400:
            if ok_missing and resp.status == 404:
                return None
            _raise_for(resp.status, raw)
        return json.loads(raw) if resp.headers.get_content_type() == "application/json" else raw.decode()

    def _run(self, call: _Call) -> Any:
        body = None if call.body is None else to_body(call.body)
        return _picked(call, self._call(*request(call.route, **call.params), body))

    def put(self, model_id: str, tokens: list[int], kv: torch.Tensor, start: int = 0, pin: bool = False,
            costs: list[list[float]] | None = None, token_classes: Any = None) -> dict:
        """Store (model_id, tokens) with its KV [L, 2, T, H, D]; the KV crosses in shared-memory
        segments made for the call and removed after it, one per request of at most
        PUT_PIECE_BYTES (whole chunks; the reply sums them). `start`: kv is only the KV of
        tokens[start:] (start a multiple of the daemon's chunk_tokens, the chunks before it put
        already), for a caller that makes a long context's KV piece by piece. `pin`: pin the
        whole context once stored (see pin()). `costs`: [end, last] per chunk of the whole
        context, what coding each costs the model (kvstreamd.models.rate_probe): the daemon then
        codes each chunk at its own steps (codec.tuning.rate). `token_classes`: uint8 [L, tokens] (a
        C-contiguous array) of the whole context, each token's step class per layer
        (codec.tuning.token_steps; kvstreamd.models.put makes them) for a profile that takes them."""
        reply = None
        ct = self.status()["chunk_tokens"] if _split(kv, len(tokens) - start) else 0
        for s, e, piece in _pieces(kv, len(tokens), start, ct):
            req, seg = _put_segment(model_id, tokens[:e], piece, s, costs, token_classes)
            req = dataclasses.replace(req, pin=pin and e == len(tokens))  # the last piece: the whole context is stored then
            with seg, _summing(reply):
                reply = _summed(reply, self._call(*request("put"), to_body(req)))
        return reply

    def fetch(self, req: FetchRequest | str, tokens: list[int] | None = None, **options: Any) -> Fetch:
        """Start a fetch of `req` (a kvstreamd.requests.FetchRequest), or of a model id and its
        tokens with the request's other fields as keywords: fetch(model_id, tokens,
        deadline_ms=2000, levels=["high"]). Returns once the daemon has planned it
        (`found_tokens`, the buffer). Iterate it for the chunk events; use it as a context
        manager to release the buffer. `dtype`: of the buffer (a torch dtype or its name).
        `levels`: accept only these (one level alone: every chunk at exactly that level).
        `recompute_tokens_per_s`: how fast this model prefills at the start of a prompt, so senders
        can price TEXT chunks; `recompute_doubling_tokens`: the position where a token costs it
        twice that (transport.policy.text_seconds), so they price them by position.
        `device="cuda"`: decode on the daemon's GPU into device memory mapped here by CUDA IPC;
        a daemon without one says why in `start.gpu_unavailable` and uses shared memory.
        `text_last`: chunks come as TEXT only after every KV chunk (a caller that holds a KV
        prefix and then computes, as vLLM does). `order="landed"`: each KV chunk's event as soon
        as its KV is in the buffer, ahead of chunks before it still decoding (requests.ORDERS);
        TEXT events still after every chunk before them."""
        conn, resp = self._request(*request("fetch"), to_body(fetch_request(req, tokens, options)))
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            _raise_for(resp.status, raw)
        return Fetch(self, conn, resp)


def _split(kv: torch.Tensor, tokens: int) -> bool:
    """Whether a put of kv goes in pieces (then the client asks the daemon its chunk_tokens)."""
    return kv.dim() == 5 and kv.shape[2] == tokens and kv.numel() * kv.element_size() > PUT_PIECE_BYTES


def _pieces(kv: torch.Tensor, n_tokens: int, start: int, chunk_tokens: int) -> list[tuple[int, int, torch.Tensor]]:
    """(s, e, kv of tokens s..e) for each of a put's requests: whole chunks of at most
    PUT_PIECE_BYTES each (one chunk at least), or kv itself, start..n_tokens, when chunk_tokens
    is 0 (no split)."""
    if not chunk_tokens:
        return [(start, n_tokens, kv)]
    per_token = kv[:, :, :1].numel() * kv.element_size()
    step = max(1, PUT_PIECE_BYTES // (per_token * chunk_tokens)) * chunk_tokens
    return [(s, min(s + step, n_tokens), kv[:, :, s - start:s - start + step]) for s in range(start, n_tokens, step)]


def _summed(reply: dict | None, r: dict) -> dict:
    """r, the reply of a put's next request, with its counts and seconds added to the earlier
    requests' (keys and placement are the whole context's in each)."""
    if reply is not None:
        for k in ("stored_chunks", "already_held", "seconds"):
            r[k] = r.get(k, 0) + reply[k]
    return r


@contextlib.contextmanager
def _summing(reply: dict | None):
    """A 507's error.put (what that request stored where) gets the earlier requests' counts too."""
    try:
        yield
    except ClientError as e:
        if reply is not None and isinstance(e.detail.get("put"), dict):
            _summed(reply, e.detail["put"])
        raise


def _put_segment(model_id: str, tokens: list[int], kv: torch.Tensor, start: int = 0, costs: list | None = None,
                 token_classes: Any = None) -> tuple[PutRequest, Segment]:
    """A put request for kv, which lies in a shared-memory segment made for it (the caller
    closes it once the daemon has answered)."""
    if kv.dtype not in DTYPE_NAMES:
        raise ValueError(f"KV dtype {kv.dtype} is not one of {list(DTYPE_NAMES)}")
    seg = Segment.create(kv.numel() * kv.element_size(), mode=0o640)
    try:
        _share_with_daemon(seg.name)
        view = seg.tensor(tuple(kv.shape), DTYPE_NAMES[kv.dtype])
        view.copy_(kv)
        del view
    except BaseException:
        seg.close()
        raise
    costs = None if costs is None else [c if isinstance(c, ChunkCost) else ChunkCost(*map(float, c)) for c in costs]
    return PutRequest(model_id, list(tokens), seg.name, tuple(kv.shape), DTYPE_NAMES[kv.dtype], int(start),
                      chunk_costs=costs, token_classes=token_classes), seg


def _share_with_daemon(name: str) -> None:
    """Let a daemon running as its own user (systemd: user and group `kvstreamd`) read a put's
    segment: group kvstreamd, mode 0640, when this user may give it that group. Best effort:
    a daemon running as this same user needs nothing."""
    try:
        import grp
        gid = grp.getgrnam("kvstreamd").gr_gid
        if os.getuid() == 0 or gid in os.getgroups():
            os.chown(f"{SHM_DIR}/{name}", -1, gid)
    except (KeyError, OSError):
        pass


def fetch_request(req: FetchRequest | str, tokens: list[int] | None, options: dict) -> FetchRequest:
    """`req` itself, or the FetchRequest of a model id, its tokens and FetchRequest's other
    fields as keywords (dtype a torch dtype too)."""
    if isinstance(req, FetchRequest):
        if tokens is not None or options:
            raise TypeError("fetch() takes a FetchRequest alone, or a model id, tokens and options")
        return req
    if isinstance(options.get("dtype"), torch.dtype):
        options = {**options, "dtype": DTYPE_NAMES[options["dtype"]]}
    return FetchRequest(req, list(tokens), **options)


class AsyncFetch(_FetchState):
    def __init__(self, client: "AsyncClient", resp) -> None:
        super().__init__()
        self._client, self._resp = client, resp

    async def _next_event(self) -> dict | None:
        while True:
            line = await self._resp.content.readline()
            if not line:
                return None
            if line.strip():
                return json.loads(line)

    async def _read_until_start(self) -> None:
        while (ev := await self._next_event()) is not None:
            self._on(ev)
            if self.start is not None:
                return
        raise ClientError("protocol", "the daemon closed the fetch before its start event")

    async def __aiter__(self) -> AsyncIterator[ChunkEvent]:
        while (ev := await self._next_event()) is not None:
            ce = self._on(ev)
            if ce is not None:
                yield ce
        self._resp.release()
        if self.end is None:
            raise ClientError("fetch_interrupted", "the daemon closed the fetch before its end event")

    async def wait(self) -> events.End:
        async for _ in self:
            pass
        return self.end

    async def release(self, _unwinding: bool = False) -> None:
        name = self._detach(_unwinding)
        self._resp.release()
        if name:
            await self._client._call(*request("release_buffer", name=name), ok_missing=True)

    async def __aenter__(self) -> "AsyncFetch":
        return self

    async def __aexit__(self, exc_type, *exc) -> None:
        await self.release(exc_type is not None)


class AsyncClient(_Routes):
    """asyncio client over one aiohttp session (close() it, or use `async with`); the methods are
    Client's, as coroutines."""

    def __init__(self, socket_path: str | Path | None = None, timeout: float | None = 600.0):
        import aiohttp
        self.path = str(socket_path or default_socket())
        self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.path),
                                              timeout=aiohttp.ClientTimeout(total=timeout))

    async def _send(self, method: str, path: str, body: Any = None):
        import aiohttp
        try:
            return await self._session.request(method, f"http://localhost{path}", json=body)
        except aiohttp.ClientConnectionError as e:
            raise ClientError("unreachable", f"no kvstreamd at {self.path}: {e}") from None

    async def _call(self, method: str, path: str, body: Any = None, ok_missing: bool = False) -> Any:
        async with await self._send(method, path, body) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                if ok_missing and resp.status == 404:
                    return None
                _raise_for(resp.status, raw)
            return json.loads(raw) if resp.content_type == "application/json" else raw.decode()

    async def _run(self, call: _Call) -> Any:
        body = None if call.body is None else to_body(call.body)
        return _picked(call, await self._call(*request(call.route, **call.params), body))

    async def put(self, model_id: str, tokens: list[int], kv: torch.Tensor, start: int = 0,
                  pin: bool = False, costs: list[list[float]] | None = None, token_classes: Any = None) -> dict:
        reply = None
        ct = (await self.status())["chunk_tokens"] if _split(kv, len(tokens) - start) else 0
        for s, e, piece in _pieces(kv, len(tokens), start, ct):
            req, seg = _put_segment(model_id, tokens[:e], piece, s, costs, token_classes)
            req = dataclasses.replace(req, pin=pin and e == len(tokens))  # the last piece: the whole context is stored then
            with seg, _summing(reply):
                reply = _summed(reply, await self._call(*request("put"), to_body(req)))
        return reply

    async def fetch(self, req: FetchRequest | str, tokens: list[int] | None = None, **options: Any) -> AsyncFetch:
        resp = await self._send(*request("fetch"), to_body(fetch_request(req, tokens, options)))
        if resp.status >= 400:
            raw = await resp.read()
            resp.release()
            _raise_for(resp.status, raw)
        f = AsyncFetch(self, resp)
        await f._read_until_start()
        return f

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
