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
                                     codec.tuning.rate): each chunk is coded at the scale its costs give
                                     it at each level; without them, at the level's one scale.
                                     token_classes (base64 of uint8 [L, n], n >= the tokens, of the
                                     whole context: codec.tuning.token_steps): each token's step class
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
import dataclasses
import functools
import json
import logging
from typing import AsyncIterator, Protocol

from aiohttp import web

from kvstreamd import events
from kvstreamd.metrics import new_request_id
from kvstreamd.node.errors import RequestError
from kvstreamd.requests import BadRequest, ContextRequest, FetchRequest, ProbeRequest, PutRequest, cut, parse, shown
from kvstreamd.routes import BY_NAME, ROUTES, Route

log = logging.getLogger(__name__)

MAX_BODY = 64 * 2**20  # token lists of 100K+ tokens as JSON stay far below this


class Node(Protocol):
    """All the API asks of the node (kvstreamd.node.node.Node is the one there is)."""

    def health(self) -> dict: ...
    def metrics_text(self) -> bytes: ...
    def status(self) -> dict: ...
    async def doctor(self) -> dict: ...
    async def probe_peers(self, size: int, timeout_s: float) -> list[dict]: ...
    async def contexts(self) -> list[dict]: ...
    async def delete_context(self, key: bytes) -> int: ...
    def peer_info(self) -> list[dict]: ...
    async def lookup(self, req: ContextRequest) -> dict: ...
    async def put(self, req: PutRequest) -> dict: ...
    async def pin(self, req: ContextRequest) -> dict: ...
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
        message = cut(e.message)
        log.info("%s %s -> %d %s: %s", request.method, cut(request.path, 200), e.status, e.code, message)
        node.record_error(f"api_{e.code}")
        return error_response(e.status, e.code, message, e.detail)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(e.status, "http", e.reason)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # never let one request take the daemon down
        log.error("%s %s failed: %s", request.method, cut(request.path, 200), cut(f"{type(e).__name__}: {e}"),
                  exc_info=True)
        node.record_error("api_internal")
        return error_response(500, "internal", cut(f"{type(e).__name__}: {e}"))
    if isinstance(resp, web.StreamResponse):
        resp.headers.setdefault("X-Request-Id", rid)
    return resp


# -- request bodies ----------------------------------------------------------------------------

def _bad(message: str) -> RequestError:
    return RequestError(400, "bad_request", message)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


# A body larger than this is read into its request in a thread (a put's tokens and chunk_costs
# may list 2^20 of each: 600,000 costs held the event loop, and every /healthz, for 2-5.6 s). Its
# numbers are read by Python functions there: json's C parser holds the GIL for a whole body, so
# in a thread alone it held the loop 0.9 s; a Python call per number lets the loop in (0.2 s).
LOOP_BODY_BYTES = 64 << 10


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


async def _body(request: web.Request, kind: type):
    """The request of type `kind` the body is (kvstreamd.requests.parse). A kind whose fields all
    have defaults takes no body at all too."""
    raw = await request.read()
    if not raw and all(f.default is not dataclasses.MISSING for f in dataclasses.fields(kind)):
        return kind()
    if len(raw) > LOOP_BODY_BYTES:
        return await asyncio.to_thread(_parsed, raw, kind, {"parse_int": _int, "parse_float": _float})
    return _parsed(raw, kind, {})


def _parsed(raw: bytes, kind: type, numbers: dict):
    try:
        body = json.loads(raw, parse_constant=_no_constant, **numbers)  # no NaN, Infinity
    except RecursionError:
        raise RequestError(400, "bad_json", "request body is not JSON this daemon reads: nested too deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise RequestError(400, "bad_json", f"request body is not JSON: {cut(str(e), 200)}") from None
    try:
        return parse(kind, body)
    except BadRequest as e:
        raise _bad(str(e)) from None


def fetch_request(body: dict) -> FetchRequest:
    """The FetchRequest of a POST /v1/fetch body (RequestError 400 for one that is not)."""
    try:
        return parse(FetchRequest, body)
    except BadRequest as e:
        raise _bad(str(e)) from None


# -- handlers --------------------------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].health())


async def metrics(request: web.Request) -> web.Response:
    return metrics_response(request.app[NODE])


def metrics_response(node: Node) -> web.Response:
    """/metrics' answer, on the Unix socket and over [api] metrics_listen alike."""
    return web.Response(body=node.metrics_text(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def probe_peers(request: web.Request, req: ProbeRequest) -> web.Response:
    return web.json_response({"peers": await request.app[NODE].probe_peers(req.bytes, req.timeout_s)})


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


async def lookup(request: web.Request, req: ContextRequest) -> web.Response:
    return web.json_response(await request.app[NODE].lookup(req))


async def put(request: web.Request, req: PutRequest) -> web.Response:
    return web.json_response(await request.app[NODE].put(req))


async def pins(request: web.Request) -> web.Response:
    return web.json_response({"pins": await request.app[NODE].pins()})


async def pin(request: web.Request, req: ContextRequest) -> web.Response:
    return web.json_response(await request.app[NODE].pin(req))


async def unpin(request: web.Request) -> web.Response:
    key = _context_key(request)
    await request.app[NODE].unpin(key)
    return web.json_response({"unpinned": key.hex()})


async def fetch(request: web.Request, req: FetchRequest) -> web.StreamResponse:
    """NDJSON, one event a line. The first event is awaited before the response starts, so that
    a request the node refuses (unknown model, stopping) still gets its 4xx/5xx status."""
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
        raise RequestError(404, "not_found", f"no buffer named {shown(name, 300)} is held for a client")
    return web.json_response({"released": name})


HANDLERS = {name: globals()[name] for name in (route.name for route in ROUTES)}  # each route's handler, by its name


def _handler(route: Route):
    """The route's handler; for a route that takes a body, called with the request its body
    parses to (route.body), so that no handler reads a field itself."""
    handler = HANDLERS[route.name]
    if route.body is None:
        return handler

    @functools.wraps(handler)
    async def parsed(request: web.Request) -> web.StreamResponse:
        return await handler(request, await _body(request, route.body))
    return parsed


def make_app(node: Node) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app[NODE] = node
    for route in ROUTES:
        app.router.add_route(route.method, route.path, _handler(route))
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
        # oldest first; this one last. A connection closed here stays in `connections` until its
        # handler's task ends: counted, a burst of connections accepted together kept closing the
        # same closed one and left the rest open (107 of 200 a second later)
        live = [c for c in self.connections if c.transport is not None]
        if len(live) > self.max_connections:
            oldest_idle = next((c for c in live[:-1] if c not in self._busy), handler)
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
