"""The local API's refusals of malformed requests, without a daemon: the aiohttp app
(kvstreamd.node.api.make_app) over a stand-in node that fails any request reaching it, served by
aiohttp's test server. A request the API must refuse (not JSON, a field missing, of the wrong
kind or out of range, an unknown route) gets its 4xx JSON error before the node sees it. What
the node itself refuses (an unknown model, a buffer that cannot be mapped, a context not held)
is tested against a real daemon in test_api.py."""
from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvstreamd.config import Config
from kvstreamd.node.api import fetch_request, make_app
from kvstreamd.node.options import FetchOptions
from tests.fixtures import MODEL, SMALL

SHAPE = [SMALL["layers"], 2, 0, SMALL["heads"], SMALL["head_dim"]]  # T at index 2
GOOD_FETCH = {"model_id": MODEL, "tokens": [1, 2, 3]}


class StandInNode:
    """An api.Node that no request may reach: every call is an AssertionError (which the API
    would answer 500 internal, failing the test's 4xx), except record_error, which the API
    calls for each request it refuses."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def record_error(self, kind: str) -> None:
        self.errors.append(kind)

    def _reached(self, *args, **kwargs):
        raise AssertionError("a request the API must refuse reached the node")

    health = metrics_text = status = peer_info = release_buffer = ab = _reached
    doctor = probe_peers = contexts = delete_context = lookup = put = pin = unpin = pins = _reached

    def fetch(self, req):
        raise AssertionError(f"a fetch the API must refuse reached the node: {req}")


@pytest.fixture
async def api():
    """A client of the API app over the stand-in node."""
    async with TestClient(TestServer(make_app(StandInNode()))) as c:
        yield c


def shape(t: int) -> list[int]:
    return [*SHAPE[:2], t, *SHAPE[3:]]


async def request(c: TestClient, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one raw request to the app."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    async with c.request(method, path, data=data,
                         headers={"Content-Type": "application/json"} if data is not None else {}) as r:
        return r.status, r.content_type, await r.read()


async def error_of(c: TestClient, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, str]:
    """(status, error code) of a request that must fail with a JSON error."""
    status, ctype, data = await request(c, method, path, body, raw)
    assert ctype == "application/json", (status, ctype, data[:200])
    err = json.loads(data)["error"]
    assert set(err) == {"code", "message"} and err["message"], err
    return status, err["code"]


async def test_a_body_that_is_not_json_is_bad_json(api):
    for path in ("/v1/lookup", "/v1/contexts", "/v1/fetch"):
        for raw in (b"{not json", b"\xff\xfe", b""):
            assert await error_of(api, "POST", path, raw=raw) == (400, "bad_json"), (path, raw)


async def test_a_body_that_is_not_an_object_or_misses_a_field_is_bad_request(api):
    cases = [
        ("/v1/lookup", [MODEL, [1, 2]]),
        ("/v1/lookup", {"tokens": [1, 2]}),
        ("/v1/lookup", {"model_id": MODEL}),
        ("/v1/fetch", "just a string"),
        ("/v1/fetch", {"tokens": [1, 2]}),
        ("/v1/fetch", {"model_id": MODEL}),
        ("/v1/fetch", {"model_id": 7, "tokens": [1, 2]}),
        ("/v1/contexts", {"model_id": MODEL, "tokens": [1, 2], "shape": shape(2), "dtype": "float16"}),
        ("/v1/contexts", {"model_id": MODEL, "tokens": [1, 2], "buffer": "kvstreamd-1-abc", "dtype": "float16"}),
    ]
    for path, body in cases:
        assert await error_of(api, "POST", path, body) == (400, "bad_request"), (path, body)


async def test_tokens_that_are_not_a_list_of_token_ids_are_bad_request(api):
    for tokens in ([], ["1"], [1.5], [-1], [2**32], [True, 2], "1 2 3", None):
        for path in ("/v1/lookup", "/v1/fetch"):
            body = {"model_id": MODEL, "tokens": tokens}
            assert await error_of(api, "POST", path, body) == (400, "bad_request"), (path, tokens)


async def test_an_unsupported_dtype_is_bad_request(api):
    for dtype in ("int8", "float64", "", 16):
        assert await error_of(api, "POST", "/v1/fetch", {**GOOD_FETCH, "dtype": dtype}) == (400, "bad_request"), dtype
        put = {"model_id": MODEL, "tokens": [1, 2], "buffer": "kvstreamd-1-abc", "shape": shape(2), "dtype": dtype}
        assert await error_of(api, "POST", "/v1/contexts", put) == (400, "bad_request"), dtype


async def test_levels_that_are_not_a_non_empty_list_of_known_levels_are_bad_request(api):
    for levels in ([], ["ultra"], ["fast", "ultra"], [1], "fast", {"fast": 1}):
        assert await error_of(api, "POST", "/v1/fetch", {**GOOD_FETCH, "levels": levels}) == (400, "bad_request"), levels


async def test_a_deadline_that_is_not_a_positive_integer_is_bad_request(api):
    for deadline in (0, -5, 1.5, "2000", True):
        body = {**GOOD_FETCH, "deadline_ms": deadline}
        assert await error_of(api, "POST", "/v1/fetch", body) == (400, "bad_request"), deadline


async def test_a_device_other_than_cpu_or_cuda_is_bad_request(api):
    for device in ("tpu", "cuda:0", "", 0):
        assert await error_of(api, "POST", "/v1/fetch", {**GOOD_FETCH, "device": device}) == (400, "bad_request"), device


async def test_a_recompute_rate_that_is_not_positive_is_bad_request(api):
    for rate in (0, -1.0, "fast"):
        body = {**GOOD_FETCH, "recompute_tokens_per_s": rate}
        assert await error_of(api, "POST", "/v1/fetch", body) == (400, "bad_request"), rate


async def test_a_doubling_position_that_is_not_positive_is_bad_request(api):
    for tokens in (0, -5, "far", True):
        body = {**GOOD_FETCH, "recompute_doubling_tokens": tokens}
        assert await error_of(api, "POST", "/v1/fetch", body) == (400, "bad_request"), tokens


def test_a_doubling_position_reaches_the_request_and_the_fetch_options():
    req = fetch_request({**GOOD_FETCH, "recompute_tokens_per_s": 500, "recompute_doubling_tokens": 5000})
    assert (req.recompute_tokens_per_s, req.recompute_doubling_tokens) == (500, 5000)
    assert fetch_request(GOOD_FETCH).recompute_doubling_tokens is None
    assert FetchOptions.of(req, Config(), 0.0).recompute_doubling_tokens == 5000


async def test_a_text_last_that_is_not_a_boolean_is_bad_request(api):
    for value in (1, "yes", None):
        body = {**GOOD_FETCH, "text_last": value}
        assert await error_of(api, "POST", "/v1/fetch", body) == (400, "bad_request"), value


async def test_an_event_order_not_known_is_bad_request(api):
    for value in ("random", "", 1, None):
        body = {**GOOD_FETCH, "order": value}
        assert await error_of(api, "POST", "/v1/fetch", body) == (400, "bad_request"), value


def test_an_event_order_reaches_the_request_and_the_fetch_options():
    assert fetch_request(GOOD_FETCH).order == "prompt"
    req = fetch_request({**GOOD_FETCH, "order": "landed"})
    assert req.order == "landed" and FetchOptions.of(req, Config(), 0.0).order == "landed"


async def test_an_unknown_route_or_method_is_a_json_error(api):
    assert await error_of(api, "GET", "/v1/nothing") == (404, "http")
    assert await error_of(api, "GET", "/v1/fetch") == (405, "http")
