"""A put with token classes (POST /v1/contexts "token_classes", codec.tuning.token_steps): each chunk
coded with its tokens' classes where the daemon's profile takes them, as before where it does
not, and classes that do not fit the model or the tokens refused with nothing stored."""
from __future__ import annotations

import base64

import numpy as np
import pytest

import codec
from codec import bitstream as bs
from kvstreamd.client import ClientError
from tests.node.test_api import MODEL, _fetched, client, context, error_of, shape


@pytest.fixture
def stepped_profile(small_profile):
    """The small profile taking per-token steps."""
    return codec.Profile(dict(small_profile.meta, token_steps={"power": 0.25}), dict(small_profile.tensors))


def _header(d, key_hex: str, level: str) -> bs.Header:
    return bs.unpack(d.store.get(bytes.fromhex(key_hex)).levels[level])


async def test_a_put_with_token_classes_codes_each_token_at_its_class(inprocess, stepped_profile, small_profile):
    (a,) = await inprocess(["a"], profile=stepped_profile)
    (b,) = await inprocess(["b"])  # the small profile as it is: no per-token steps
    tokens, kv = context(600)
    L = small_profile.layers
    classes = np.random.default_rng(0).integers(0, bs.TOP_CLASS + 1, (L, 700)).astype(np.uint8)  # runs past the tokens
    async with client(a) as ca, client(b) as cb:
        reply = await ca.put(MODEL, tokens, kv, token_classes=classes)
        plain = await cb.put(MODEL, tokens, kv, token_classes=classes)
        for i, key in enumerate(reply["keys"]):
            h = _header(a, key, "high")
            s = i * 256 + h.sink_tokens
            assert np.array_equal(h.token_classes, classes[:, s:s + h.token_classes.shape[1]])
            assert _header(b, plain["keys"][i], "high").token_classes is None  # the profile takes none
        got = await _fetched(ca, tokens)
        assert got.shape == kv.shape
        ref = await _fetched(cb, tokens)
        assert (got.float() - kv.float()).pow(2).mean() > (ref.float() - kv.float()).pow(2).mean()  # coarser tokens


async def test_token_classes_that_do_not_fit_are_refused_and_nothing_is_stored(inprocess, stepped_profile,
                                                                                small_profile):
    (a,) = await inprocess(["a"], profile=stepped_profile)
    tokens, kv = context(300)
    L = small_profile.layers
    async with client(a) as ca:
        for bad in (np.zeros((L, 299), np.uint8), np.zeros((L + 1, 300), np.uint8)[:, :1],
                    np.full((L, 300), bs.TOP_CLASS + 1, np.uint8)):
            with pytest.raises(ClientError) as e:
                await ca.put(MODEL, tokens, kv, token_classes=np.ascontiguousarray(bad))
            assert (e.value.status, e.value.code) == (400, "bad_token_classes"), bad.shape
        assert (await ca.status())["store"]["chunks"] == 0
    body = {"model_id": MODEL, "tokens": tokens, "buffer": "x", "shape": shape(300), "dtype": "float16"}
    for bad in ("not base64!", 12, ["AA=="]):
        assert await error_of(a, "POST", "/v1/contexts", {**body, "token_classes": bad}) == (400, "bad_request"), bad
    ok = base64.b64encode(bytes(L * 300)).decode()
    assert await error_of(a, "POST", "/v1/contexts", {**body, "token_classes": ok}) == (400, "bad_buffer")
