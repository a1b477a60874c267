"""The local API: aiohttp on a Unix socket (mode from [api] socket_mode, 0660 by default).

    GET    /healthz                  liveness: {"status": "ok", "node_id"}
    GET    /metrics                  Prometheus text format
    GET    /v1/status                node, uptime, store usage, peers, fetches in flight
    GET    /v1/contexts              contexts held (one per stored chain)
    DELETE /v1/contexts/{key}        delete a context by its last chunk key (hex)
    GET    /v1/peers                 configured and connected peers
    POST   /v1/lookup                {model_id, tokens} -> tokens held locally and per peer
    POST   /v1/contexts              store: {model_id, tokens, buffer, shape, dtype}; KV is read
                                     from the shared-memory segment `buffer` the client made
    POST   /v1/fetch                 {model_id, tokens, deadline_ms?, dtype?, levels?, device?,
                                     recompute_tokens_per_s?} -> NDJSON events:
                                     start (the buffer to attach), chunk (one per chunk as it
                                     lands: kv or text), end (totals and per-stage timings)
    DELETE /v1/buffers/{name}        the client is done with a fetch's buffer

Errors are JSON {"error": {"code", "message"}} with a 4xx/5xx status."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from codec import catalog
from codec.errors import CodecError

from . import pipeline
from .metrics import new_request_id
from .shm import DTYPES, Attached, ShmError
from .keys import chunk_keys
from .store import StoreError

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("kvstreamd.api")

MAX_BODY = 64 * 2**20  # token lists of 100K+ tokens as JSON stay far below this


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    rid = new_request_id()
    try:
        resp = await handler(request)
    except ApiError as e:
        log.info("%s %s -> %d %s: %s", request.method, request.path, e.status, e.code, e.message)
        request.app["daemon"].metrics.error(f"api_{e.code}")
        return error_response(e.status, e.code, e.message)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(e.status, "http", e.reason)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # never let one request take the daemon down
        log.exception("%s %s failed", request.method, request.path)
        request.app["daemon"].metrics.error("api_internal")
        return error_response(500, "internal", f"{type(e).__name__}: {e}")
    if isinstance(resp, web.StreamResponse):
        resp.headers.setdefault("X-Request-Id", rid)
    return resp


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, "bad_json", f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_request", "request body must be a JSON object")
    return body


def _field(body: dict, name: str, kind: type | tuple, default: Any = ..., ) -> Any:
    if name not in body:
        if default is ...:
            raise ApiError(400, "bad_request", f"missing field {name!r}")
        return default
    v = body[name]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ApiError(400, "bad_request", f"field {name!r} must be {getattr(kind, '__name__', kind)}")
    return v


def _tokens(body: dict) -> list[int]:
    toks = _field(body, "tokens", list)
    if not toks:
        raise ApiError(400, "bad_request", "field 'tokens' must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in toks):
        raise ApiError(400, "bad_request", "field 'tokens' must be a list of token ids (0 <= id < 2**32)")
    return toks


def _model(d: "Daemon", body: dict):
    model_id = _field(body, "model_id", str)
    try:
        return model_id, d.coder.profile_for(model_id)
    except CodecError as e:
        raise ApiError(400, "unknown_model", str(e)) from None


def _prompt(d: "Daemon", body: dict):
    """The fields a put and a fetch share: (model_id, its codec profile, tokens, dtype)."""
    model_id, prof = _model(d, body)
    return model_id, prof, _tokens(body), _dtype(body)


def _dtype(body: dict) -> str:
    dtype = _field(body, "dtype", str, "float16")
    if dtype not in DTYPES:
        raise ApiError(400, "bad_request", f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def _levels(body: dict, d: "Daemon") -> list[str] | None:
    """Optional: the levels this fetch accepts, best first (default: the configured ones). One
    level alone means exactly that level for every chunk (what a baseline measurement wants)."""
    levels = _field(body, "levels", list, None)
    if levels is None:
        return None
    known = catalog.names()
    bad = [lv for lv in levels if not isinstance(lv, str) or lv not in known]
    if not levels or bad:
        raise ApiError(400, "bad_request", f"levels must be a non-empty list of {known}; got {levels!r}")
    return levels


# -- handlers --------------------------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    d: Daemon = request.app["daemon"]
    return web.json_response({"status": "stopping" if d.stopping else "ok", "node_id": d.node_id})


async def metrics(request: web.Request) -> web.Response:
    d: Daemon = request.app["daemon"]
    d.refresh_gauges()
    return web.Response(body=d.metrics.render(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app["daemon"].status())


async def contexts(request: web.Request) -> web.Response:
    d: Daemon = request.app["daemon"]
    out = [{"key": c.key.hex(), "model_id": c.model_id, "tokens": c.tokens, "chunks": c.chunks,
            "complete": c.complete, "created": c.created, "bytes": c.nbytes}
           for c in await asyncio.to_thread(d.store.contexts)]
    return web.json_response({"contexts": out})


async def delete_context(request: web.Request) -> web.Response:
    d: Daemon = request.app["daemon"]
    try:
        key = bytes.fromhex(request.match_info["key"])
    except ValueError:
        raise ApiError(400, "bad_request", "context key must be hex") from None
    if not d.store.has(key):
        raise ApiError(404, "not_found", f"no context ends at chunk {key.hex()}")
    n = await asyncio.to_thread(d.store.delete_context, key)
    return web.json_response({"deleted_chunks": n})


async def peers(request: web.Request) -> web.Response:
    return web.json_response({"peers": request.app["daemon"].peers.info()})


async def lookup(request: web.Request) -> web.Response:
    d: Daemon = request.app["daemon"]
    body = await _body(request)
    model_id, _ = _model(d, body)
    tokens = _tokens(body)
    p = pipeline.plan(d.store, d.directory, model_id, tokens, d.cfg.codec.chunk_tokens)
    tok = lambda n: p.bounds[n - 1][1] if n else 0  # noqa: E731
    return web.json_response({"prompt_tokens": len(tokens), "chunks": len(p.keys), "local_tokens": tok(p.local),
                              "peers": {peer: tok(n) for peer, n in p.peers.items()}, "found_tokens": p.found_tokens})


async def put(request: web.Request) -> web.Response:
    d: Daemon = request.app["daemon"]
    body = await _body(request)
    model_id, prof, tokens, dtype = _prompt(d, body)
    name = _field(body, "buffer", str)
    shape = tuple(_field(body, "shape", list))
    L, H, D = prof.layers, prof.heads, prof.head_dim
    if shape != (L, 2, len(tokens), H, D):
        raise ApiError(400, "bad_shape", f"KV shape {list(shape)} is not [L, 2, T, H, D] = "
                                         f"{[L, 2, len(tokens), H, D]} for {model_id} and {len(tokens)} tokens")
    try:
        att = Attached.open(name, shape, dtype)
    except ShmError as e:
        raise ApiError(400, "bad_buffer", str(e)) from None
    t0 = time.perf_counter()
    try:
        stored, held = await d.put(model_id, tokens, att.tensor, prof)
    except StoreError as e:
        raise ApiError(507, "store_full", str(e)) from None
    finally:
        att.release()
    return web.json_response({"keys": [k.hex() for k in chunk_keys(model_id, tokens, d.cfg.codec.chunk_tokens)],
                              "stored_chunks": stored, "already_held": held,
                              "seconds": round(time.perf_counter() - t0, 4)})


async def fetch(request: web.Request) -> web.StreamResponse:
    d: Daemon = request.app["daemon"]
    body = await _body(request)
    model_id, prof, tokens, dtype = _prompt(d, body)
    deadline_ms = _field(body, "deadline_ms", int, d.cfg.stream.deadline_ms)
    if deadline_ms <= 0:
        raise ApiError(400, "bad_request", "deadline_ms must be > 0")
    levels = _levels(body, d)
    recompute_tps = _field(body, "recompute_tokens_per_s", (int, float), None)
    if recompute_tps is not None and not recompute_tps > 0:
        raise ApiError(400, "bad_request", "recompute_tokens_per_s must be > 0")
    device = _field(body, "device", str, "cpu")
    if device not in ("cpu", "cuda"):
        raise ApiError(400, "bad_request", f'device must be "cpu" or "cuda", not {device!r}')
    if d.stopping:
        raise ApiError(503, "stopping", "the daemon is shutting down")
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)

    async def emit(event: dict) -> None:
        await resp.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")

    await d.fetch(model_id, tokens, deadline_ms, dtype, prof, emit, levels, recompute_tps, device)
    await resp.write_eof()
    return resp


async def release_buffer(request: web.Request) -> web.Response:
    d: Daemon = request.app["daemon"]
    name = request.match_info["name"]
    if not d.release_buffer(name):
        raise ApiError(404, "not_found", f"no buffer named {name!r} is held for a client")
    return web.json_response({"released": name})


def make_app(daemon: "Daemon") -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app["daemon"] = daemon
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/contexts", contexts)
    app.router.add_delete("/v1/contexts/{key}", delete_context)
    app.router.add_get("/v1/peers", peers)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_post("/v1/contexts", put)
    app.router.add_post("/v1/fetch", fetch)
    app.router.add_delete("/v1/buffers/{name}", release_buffer)
    return app
