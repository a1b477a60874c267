"""Real chunks of the real model between two test hosts over a shaped link: the sender's
level choice responds to the link and the deadline, and the receiver ends with the whole
context's KV (decoded, or recomputed from TEXT)."""
from __future__ import annotations

import pytest

from codec.tuning import catalog
from kvstreamd.lab import netns
from kvstreamd.bench import stream, stream_data

ok, why = netns.available()
pytestmark = [pytest.mark.system,  # network namespaces (root)
              pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here: {why}")]

DPPL = catalog.dppl_table(["fp16", "int8", "high", "balanced", "fast"])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("streamdata")
    stream_data.prepare(d, tokens=512, chunk_tokens=256, log=lambda _m: None)
    return d


def test_fast_link_and_loose_deadline_get_lossless_levels(data_dir):
    with netns.Link(rate_mbit=500) as link:
        r = stream.one_run(link, data_dir, "adaptive", deadline_ms=20_000, dppl=DPPL)
    assert r["complete"] and len(r["levels"]) == 2
    assert all(DPPL[lv] == 0 for lv in r["levels"])
    assert r["deadline_missed"] is False


def test_slow_link_and_tight_deadline_get_smaller_levels(data_dir):
    with netns.Link(rate_mbit=8) as link:
        r = stream.one_run(link, data_dir, "adaptive", deadline_ms=1500, dppl=DPPL)
    assert r["complete"] and len(r["levels"]) == 2
    fp16_bytes = 2 * 256 * 11_520 * 2
    assert r["bytes"] < fp16_bytes / 4  # entropy-coded levels or text, not raw KV
    assert set(r["levels"]) <= {"high", "balanced", "fast", "text"}


def test_text_method_has_the_receiver_recompute_every_chunk(data_dir):
    with netns.Link(rate_mbit=100) as link:
        r = stream.one_run(link, data_dir, "text", deadline_ms=20_000, dppl=DPPL)
    assert r["levels"] == ["text", "text"] and r["complete"]
    assert r["bytes"] < 10_000
