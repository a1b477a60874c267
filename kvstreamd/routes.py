"""The local API's routes, once: the daemon's app (node/api.py) is built from this table, both
clients (client.py) build their requests from it, and tests/test_routes.py holds the README's
API list and api.py's docstring to it."""
from __future__ import annotations

from dataclasses import dataclass

from kvstreamd.requests import ContextRequest, FetchRequest, ProbeRequest, PutRequest


@dataclass(frozen=True)
class Route:
    name: str  # the handler's name in node/api.py, and the clients' method's where one has it
    method: str
    path: str  # aiohttp's pattern: {key} and {name} are path parameters
    body: type | None = None  # the request (kvstreamd.requests) its JSON body is; None: it takes none


ROUTES: tuple[Route, ...] = (
    Route("healthz", "GET", "/healthz"),
    Route("metrics", "GET", "/metrics"),
    Route("status", "GET", "/v1/status"),
    Route("contexts", "GET", "/v1/contexts"),
    Route("delete_context", "DELETE", "/v1/contexts/{key}"),
    Route("peers", "GET", "/v1/peers"),
    Route("probe_peers", "POST", "/v1/peers/probe", ProbeRequest),
    Route("doctor", "GET", "/v1/doctor"),
    Route("ab", "GET", "/v1/ab"),
    Route("lookup", "POST", "/v1/lookup", ContextRequest),
    Route("put", "POST", "/v1/contexts", PutRequest),
    Route("fetch", "POST", "/v1/fetch", FetchRequest),
    Route("release_buffer", "DELETE", "/v1/buffers/{name}"),
    Route("pins", "GET", "/v1/pins"),
    Route("pin", "POST", "/v1/pins", ContextRequest),
    Route("unpin", "DELETE", "/v1/pins/{key}"),
)
BY_NAME: dict[str, Route] = {r.name: r for r in ROUTES}


def request(route_name: str, /, **params: str) -> tuple[str, str]:
    """(method, path) of the route named `route_name` with its path parameters (key, name)
    filled in: what a client sends."""
    route = BY_NAME[route_name]
    return route.method, route.path.format(**params)
