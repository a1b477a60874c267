"""The local API: aiohttp on a Unix socket (mode from [api] socket_mode, 0660 by default).

    GET    /healthz                  liveness: {"status": "ok", "node_id"}; "degraded" (still
                                     serving) adds "degraded": [{"reason", "message"}] while a
                                     fault lasts (codec_workers, disk_full, disk_error)
    GET    /metrics                  Prometheus text format (also over TCP: [api] metrics_listen)
    GET    /v1/ab                    A/B fetch outcomes: the arms' recent fetches ([policy] experiment)
    GET    /v1/status                node, uptime, health, the health thresholds' states
                                     (health.py), codec workers, store usage, peers, fetches
                                     in flight
    GET    /v1/contexts              contexts held (one per stored chain)
    DELETE /v1/contexts/{key}        delete a context by its last chunk key (hex)
    GET    /v1/peers                 configured and connected peers
    POST   /v1/peers/probe           {bytes?, timeout_s?} -> {"peers": [...]}: each connected peer
                                     probed at once (round trip, bandwidth with `bytes` of padding,
                                     clock offset), within timeout_s (kvstreamd/ops/diagnosis.py)
    GET    /v1/doctor                what `kvstreamd doctor` needs besides: errors in the last hour,
                                     damaged chunks, stored models' profiles, decode rate
    POST   /v1/lookup                {model_id, tokens} -> tokens held locally and per peer
    POST   /v1/contexts              store: {model_id, tokens, buffer, shape, dtype, start?,
                                     chunk_costs?, token_classes?}; KV is
                                     read from the shared-memory segment `buffer` the client made
                                     (with start, a multiple of chunk_tokens: the KV of
                                     tokens[start:] only, the chunks before it held here already,
                                     else 409 missing_prefix; how a long context is put piece by
                                     piece) ->
                                     {keys, stored_chunks, already_held, placement, seconds}:
                                     placement per chunk "disk", "memory" (lost on a restart) or
                                     null. 507 disk_full/disk_error/store_full when a chunk could
                                     not be written or was refused: error.put is that reply.
                                     chunk_costs ([[end, last]] per chunk of the whole context,
                                     codec.rate): each chunk is coded at the scale its costs give
                                     it at each level; without them, at the level's one scale.
                                     token_classes (base64 of uint8 [L, n], n >= the tokens, of the
                                     whole context: codec.token_steps): each token's step class
                                     per layer, for a profile that takes them
    POST   /v1/fetch                 {model_id, tokens, deadline_ms?, dtype?, levels?, device?,
                                     recompute_tokens_per_s?, text_last?,
                                     recompute_doubling_tokens?, order?} -> NDJSON events:
                                     start (the buffer to attach), chunk (one per chunk as it
                                     lands: kv or text; in prompt order, or with order "landed"
                                     each kv one as soon as it is in the buffer), end (totals
                                     and per-stage timings)
    DELETE /v1/buffers/{name}        the client is done with a fetch's buffer
    GET    /v1/pins                  lasting pins: [{key, chunks, bytes}]
    POST   /v1/pins                  {model_id, tokens} -> pin the context held here whole for
                                     them: {key, chunks, pinned, pinned_bytes, pin_budget}; 409
                                     pin_refused over [store] pin_budget or when not held whole
    DELETE /v1/pins/{key}            unpin a context by its last chunk key (hex); it stays stored
    (POST /v1/contexts takes pin: true too: the context is pinned once stored, and the reply
    says the bytes newly pinned in `pinned`; 409 pin_refused, with error.put, when it cannot be)

Errors are JSON {"error": {"code", "message"}} with a 4xx/5xx status. Every field is checked here,
against the bounds below, before the node sees it; a message names the field and never echoes
more than a few dozen characters of what the client sent."""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from typing import Any, AsyncIterator, Protocol

from aiohttp import web

from codec import catalog
from codec.errors import CodecError
from codec.rate import ChunkCost

from kvstreamd import events
from kvstreamd.ops.diagnosis import MAX_PROBE_BYTES, MAX_PROBE_TIMEOUT_S, MIN_PROBE_BYTES, PROBE_BYTES, PROBE_TIMEOUT_S
from kvstreamd.events import FetchRequest
from kvstreamd.metrics import new_request_id
from kvstreamd.routes import BY_NAME, ROUTES
from kvstreamd.node.errors import RequestError
from kvstreamd.handoff.shm import DTYPES
from kvstreamd.limits import MAX_DEADLINE_MS  # also a bound on request fields

log = logging.getLogger(__name__)

MAX_BODY = 64 * 2**20  # token lists of 100K+ tokens as JSON stay far below this
# Bounds on request fields, checked at the door so that nothing out of range reaches the node.
MAX_TOKENS = 2**20          # tokens in one request (a context a model can hold, and more)
MAX_RECOMPUTE_TPS = 10**9   # tokens a second a model prefills
MAX_DOUBLING_TOKENS = 10**9  # where a token's prefill costs twice its cost at the start of a prompt
MAX_NAME = 512              # characters of a model id
MAX_DIMS = 8                # dimensions of a put's KV shape
MAX_DIM = 2**31             # one dimension of it
MAX_MESSAGE = 1000          # characters of an error message (longer ones are cut)


class Node(Protocol):
    """All the API asks of the node (kvstreamd.node.Node is the one there is)."""

    def health(self) -> dict: ...
    def metrics_text(self) -> bytes: ...
    def status(self) -> dict: ...
    async def doctor(self) -> dict: ...
    async def probe_peers(self, size: int, timeout_s: float) -> list[dict]: ...
    async def contexts(self) -> list[dict]: ...
    async def delete_context(self, key: bytes) -> int: ...
    def peer_info(self) -> list[dict]: ...
    async def lookup(self, model_id: str, tokens: list[int]) -> dict: ...
    async def put(self, model_id: str, tokens: list[int], buffer: str, shape: tuple[int, ...], dtype: str,
                  start: int = 0, pin: bool = False, costs: list[ChunkCost] | None = None,
                  token_classes: bytes | None = None) -> dict: ...
    async def pin(self, model_id: str, tokens: list[int]) -> dict: ...
    async def unpin(self, key: bytes) -> None: ...
    async def pins(self) -> list[dict]: ...
    def fetch(self, req: FetchRequest) -> AsyncIterator[events.Event]: ...
    def release_buffer(self, name: str) -> bool: ...
    def record_error(self, kind: str) -> None: ...
    def ab(self) -> dict: ...


NODE = web.AppKey("node", Node)


def error_response(status: int, code: str, message: str, detail: dict | None = None) -> web.Response:
    """detail: more fields of the error object (a put's 507 carries what it stored where)."""
    return web.json_response({"error": {"code": code, "message": message, **(detail or {})}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    rid = new_request_id()
    node: Node = request.app[NODE]
    try:
        resp = await handler(request)
    except RequestError as e:
        message = _cut(e.message)
        log.info("%s %s -> %d %s: %s", request.method, _cut(request.path, 200), e.status, e.code, message)
        node.record_error(f"api_{e.code}")
        return error_response(e.status, e.code, message, e.detail)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(e.status, "http", e.reason)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # never let one request take the daemon down
        log.error("%s %s failed: %s", request.method, _cut(request.path, 200), _cut(f"{type(e).__name__}: {e}"),
                  exc_info=True)
        node.record_error("api_internal")
        return error_response(500, "internal", _cut(f"{type(e).__name__}: {e}"))
    if isinstance(resp, web.StreamResponse):
        resp.headers.setdefault("X-Request-Id", rid)
    return resp


# -- request fields ----------------------------------------------------------------------------

def _bad(message: str) -> RequestError:
    return RequestError(400, "bad_request", message)


def _cut(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else f"{text[:limit - 40]}... ({len(text)} characters)"


def _shown(value: Any, limit: int = 60) -> str:
    """A client's value as messages and the log show it: repr, cut to `limit` characters."""
    if isinstance(value, (str, list, dict)) and len(value) > limit:  # no repr of a megabyte
        value = value[:limit] if isinstance(value, (str, list)) else dict(list(value.items())[:4])
        return f"{_cut(repr(value), limit)}..."
    return _cut(repr(value), limit)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read(), parse_constant=_no_constant)  # no NaN, Infinity
    except RecursionError:
        raise RequestError(400, "bad_json", "request body is not JSON this daemon reads: nested too deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise RequestError(400, "bad_json", f"request body is not JSON: {_cut(str(e), 200)}") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def _field(body: dict, name: str, kind: type | tuple, default: Any = ..., ) -> Any:
    if name not in body:
        if default is ...:
            raise _bad(f"missing field {name!r}")
        return default
    v = body[name]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise _bad(f"field {name!r} must be {getattr(kind, '__name__', kind)}")
    return v


def _number(body: dict, name: str, kind: type | tuple, lo: float, hi: float) -> Any:
    """An optional number field within lo..hi (and finite)."""
    v = _field(body, name, kind, None)
    if v is not None and not lo <= v <= hi:  # NaN fails too
        raise _bad(f"field {name!r} must be {lo}..{hi}, got {_shown(v)}")
    return v


def _model_id(body: dict) -> str:
    model_id = _field(body, "model_id", str)
    if not 0 < len(model_id) <= MAX_NAME:
        raise _bad(f"field 'model_id' is {len(model_id)} characters; a model id is 1..{MAX_NAME}")
    return model_id


def _tokens(body: dict) -> list[int]:
    toks = _field(body, "tokens", list)
    if not toks:
        raise _bad("field 'tokens' must not be empty")
    if len(toks) > MAX_TOKENS:
        raise _bad(f"field 'tokens' has {len(toks)} tokens; at most {MAX_TOKENS} a request")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in toks):
        raise _bad("field 'tokens' must be a list of token ids (0 <= id < 2**32)")
    return toks


def _shape(body: dict) -> tuple[int, ...]:
    shape = _field(body, "shape", list)
    if not (len(shape) <= MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)):
        raise _bad(f"field 'shape' must be a list of at most {MAX_DIMS} sizes (0..{MAX_DIM}), "
                   f"got {_shown(shape)}")
    return tuple(shape)


def _dtype(body: dict) -> str:
    dtype = _field(body, "dtype", str, "float16")
    if dtype not in DTYPES:
        raise _bad(f"dtype must be one of {sorted(DTYPES)}, got {_shown(dtype)}")
    return dtype


def _chunk_costs(body: dict) -> list[ChunkCost] | None:
    """Optional "chunk_costs": [[end, last], ...], what coding each chunk of the whole context
    costs the model (codec.rate), from the first chunk on; a context put piece by piece sends
    them all with every piece, so the list may run past the request's tokens (the node checks
    that it covers them)."""
    raw = _field(body, "chunk_costs", list, None)
    if raw is None:
        return None
    if not raw or len(raw) > MAX_TOKENS:
        raise _bad(f"field 'chunk_costs' must list one [end, last] per chunk, got {len(raw)}")
    try:
        return [ChunkCost.of(c) for c in raw]
    except CodecError as e:
        raise _bad(f"field 'chunk_costs': {e}") from None


def _token_classes(body: dict) -> bytes | None:
    """Optional "token_classes": base64 of the whole context's uint8 [L, n] classes
    (codec.token_steps); the node checks their shape against the model and the tokens."""
    raw = _field(body, "token_classes", str, None)
    if raw is None:
        return None
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("field 'token_classes' is not base64") from None


def _levels(body: dict) -> list[str] | None:
    """Optional: the levels this fetch accepts, best first (default: the configured ones). One
    level alone means exactly that level for every chunk (what a baseline measurement wants)."""
    levels = _field(body, "levels", list, None)
    if levels is None:
        return None
    known = catalog.names()
    if not levels or len(levels) > len(known) or not all(isinstance(lv, str) and lv in known for lv in levels):
        raise _bad(f"levels must be a non-empty list of {known}; got {_shown(levels)}")
    if len(set(levels)) < len(levels):
        raise _bad(f"levels names a level twice: {_shown(levels)}")
    return levels


def fetch_request(body: dict) -> FetchRequest:
    deadline_ms = _number(body, "deadline_ms", int, 1, MAX_DEADLINE_MS)
    recompute_tps = _number(body, "recompute_tokens_per_s", (int, float), 1, MAX_RECOMPUTE_TPS)
    device = _field(body, "device", str, "cpu")
    if device not in ("cpu", "cuda"):
        raise _bad(f'device must be "cpu" or "cuda", not {_shown(device)}')
    order = _field(body, "order", str, "prompt")
    if order not in events.ORDERS:
        raise _bad(f"order must be one of {list(events.ORDERS)}, not {_shown(order)}")
    return FetchRequest(_model_id(body), _tokens(body), _dtype(body), deadline_ms, _levels(body),
                        recompute_tps, device, _field(body, "text_last", bool, False),
                        _number(body, "recompute_doubling_tokens", (int, float), 1, MAX_DOUBLING_TOKENS), order)


# -- handlers --------------------------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].health())


async def metrics(request: web.Request) -> web.Response:
    return metrics_response(request.app[NODE])


def metrics_response(node: Node) -> web.Response:
    """/metrics' answer, on the Unix socket and over [api] metrics_listen alike."""
    return web.Response(body=node.metrics_text(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def probe_peers(request: web.Request) -> web.Response:
    body = await _body(request) if request.can_read_body else {}
    size = _number(body, "bytes", int, MIN_PROBE_BYTES, MAX_PROBE_BYTES)
    timeout_s = _number(body, "timeout_s", (int, float), 0.1, MAX_PROBE_TIMEOUT_S)
    peers = await request.app[NODE].probe_peers(size or PROBE_BYTES, timeout_s or PROBE_TIMEOUT_S)
    return web.json_response({"peers": peers})


async def doctor(request: web.Request) -> web.Response:
    return web.json_response(await request.app[NODE].doctor())


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status())


async def contexts(request: web.Request) -> web.Response:
    return web.json_response({"contexts": await request.app[NODE].contexts()})


def _context_key(request: web.Request) -> bytes:
    try:
        return bytes.fromhex(request.match_info["key"])
    except ValueError:
        raise _bad("context key must be hex") from None


async def delete_context(request: web.Request) -> web.Response:
    key = _context_key(request)
    return web.json_response({"deleted_chunks": await request.app[NODE].delete_context(key)})


async def peers(request: web.Request) -> web.Response:
    return web.json_response({"peers": request.app[NODE].peer_info()})


async def ab(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].ab())


async def lookup(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response(await request.app[NODE].lookup(_model_id(body), _tokens(body)))


async def put(request: web.Request) -> web.Response:
    body = await _body(request)
    model_id, tokens, dtype = _model_id(body), _tokens(body), _dtype(body)
    name, shape = _field(body, "buffer", str), _shape(body)
    start = _number(body, "start", int, 0, MAX_TOKENS) or 0
    pin = _field(body, "pin", bool, False)
    costs, classes = _chunk_costs(body), _token_classes(body)
    return web.json_response(await request.app[NODE].put(model_id, tokens, name, shape, dtype, start, pin, costs,
                                                         classes))


async def pins(request: web.Request) -> web.Response:
    return web.json_response({"pins": await request.app[NODE].pins()})


async def pin(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response(await request.app[NODE].pin(_model_id(body), _tokens(body)))


async def unpin(request: web.Request) -> web.Response:
    key = _context_key(request)
    await request.app[NODE].unpin(key)
    return web.json_response({"unpinned": key.hex()})


async def fetch(request: web.Request) -> web.StreamResponse:
    """NDJSON, one event a line. The first event is awaited before the response starts, so that
    a request the node refuses (unknown model, stopping) still gets its 4xx/5xx status."""
    req = fetch_request(await _body(request))
    stream = request.app[NODE].fetch(req)
    try:
        first = await anext(stream)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        ev = first
        while True:
            await resp.write(json.dumps(events.to_json(ev), separators=(",", ":")).encode() + b"\n")
            try:
                ev = await anext(stream)
            except StopAsyncIteration:
                break
        await resp.write_eof()
    except ConnectionResetError:  # the client went away mid-fetch: not the daemon's error
        log.info("fetch of %d tokens: the client left before the end", len(req.tokens))
    finally:
        await stream.aclose()  # the fetch is cancelled (if it still runs) and its buffer freed
    return resp


async def release_buffer(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not request.app[NODE].release_buffer(name):
        raise RequestError(404, "not_found", f"no buffer named {_shown(name, 300)} is held for a client")
    return web.json_response({"released": name})


HANDLERS = {name: globals()[name] for name in (route.name for route in ROUTES)}  # each route's handler, by its name


def make_app(node: Node) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app[NODE] = node
    for route in ROUTES:
        app.router.add_route(route.method, route.path, HANDLERS[route.name])
    return app


# [api] metrics_listen: GET /metrics over TCP for a Prometheus server to scrape, read-only; the API
# itself stays on the Unix socket. A connection that sends no request for METRICS_IDLE_S (before its
# first, or after a response) is closed, as the peer port closes one that does not complete its
# handshake in 5 s; at most METRICS_MAX_CONNECTIONS are open at once, and one past that closes
# the oldest with no request in progress, so idle sockets can never lock a scraper out.
METRICS_IDLE_S = 5.0
METRICS_MAX_CONNECTIONS = 16


class ScrapeServer(web.Server):
    """aiohttp's low-level server for the metrics listener: GET /metrics and nothing else, each
    connection closed after METRICS_IDLE_S without a request, and at most `max_connections` open
    (past it, the oldest idle one is closed; the new one itself only when every other is
    mid-request)."""

    def __init__(self, node: Node, max_connections: int = METRICS_MAX_CONNECTIONS,
                 idle_s: float = METRICS_IDLE_S) -> None:
        super().__init__(self._answer, keepalive_timeout=idle_s, access_log=None)
        self.node = node
        self.max_connections = max_connections
        self._busy: set = set()  # connections with a request in progress

    def connection_made(self, handler, transport) -> None:
        super().connection_made(handler, transport)
        conns = self.connections  # oldest first; this one last
        if len(conns) > self.max_connections:
            oldest_idle = next((c for c in conns[:-1] if c not in self._busy), handler)
            oldest_idle.force_close()

    async def _answer(self, request: web.BaseRequest) -> web.StreamResponse:
        route = BY_NAME["metrics"]
        if request.path != route.path:
            return web.Response(status=404, text="404: Not Found")
        if request.method != route.method:
            return web.Response(status=405, text="405: Method Not Allowed", headers={"Allow": route.method})
        self._busy.add(request.protocol)
        try:  # written here, so that it counts as in progress until the last byte is out
            resp = metrics_response(self.node)
            await resp.prepare(request)
            await resp.write_eof()
            return resp
        finally:
            self._busy.discard(request.protocol)


async def start_metrics_listener(node: Node, host: str, port: int) -> web.BaseRunner:
    """Listening on host:port (port 0: a free one, in runner.addresses) until runner.cleanup()."""
    runner = web.ServerRunner(ScrapeServer(node), handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner
