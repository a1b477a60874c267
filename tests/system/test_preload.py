"""[store] preload on a real daemon process with the real model: five WikiText-2 documents are
prefilled by the daemon's `kvstreamd preload` child, stored and pinned; each is found locally on
its first fetch, and filling the store past its budgets with other contexts evicts none of them.
Also: a document held already is only pinned again (so a restart pins them all again), and a
missing file is an error naming it that the daemon survives."""
from __future__ import annotations

import re

import pytest

from codec.tuning import registry
from kvstreamd.ops import preload
from kvstreamd.lab import corpus
from kvstreamd.lab.daemons import DaemonProcess, wait_for

from tests.fixtures import synthetic_daemon, synthetic_kv, system_fixture

DOCS = 5
DOC_CHARS = 1150  # ~270-330 tokens: two 256-token chunks each, and a short prefill


def write_documents(folder) -> list:
    """The openings of the first DOCS articles of WikiText-2's test split, one file each."""
    folder.mkdir(parents=True)
    articles = [a for a in re.split(r"^ = (?!=)", corpus.text("test"), flags=re.M) if a.strip()][:DOCS]
    paths = []
    for i, a in enumerate(articles):
        text = " = " + a[:DOC_CHARS].rsplit(" ", 1)[0]
        paths.append(folder / f"doc{i}.txt")
        paths[-1].write_text(text)
    return paths


def wait_preloaded(node: DaemonProcess, timeout: float = 240.0) -> dict:
    return wait_for(lambda: (s := node.client(timeout=10).status()["preload"])["state"] in ("done", "failed") and s,
                    timeout, 0.5, "preload to finish")


@pytest.fixture(scope="module")
@system_fixture  # a daemon process (and the real model)
def preloaded(tmp_path_factory, request):
    """A daemon whose [store] preload names a folder of five documents, with small memory and disk
    budgets, after its preload has finished; and each document's tokens."""
    root = tmp_path_factory.mktemp("preload")
    paths = write_documents(root / "docs")
    node = DaemonProcess("pre", root / "pre", extra={
        "codec": {"chunk_tokens": 256, "workers": 1, "levels": ["balanced"]},
        "store": {"memory_budget": "2MiB", "disk_budget": "8MiB", "pin_budget": "16MiB",
                  "preload": [str(root / "docs")]}})
    node.start()
    try:
        lm = request.getfixturevalue("lm")  # loads while the daemon preloads
        state = wait_preloaded(node)
        assert state["state"] == "done" and state["stored"] == DOCS, (state, node.log()[-3000:])
        yield node, {p: lm.tokenizer.document(p.read_text()) for p in paths}
    finally:
        node.stop()


def test_each_preloaded_document_is_found_locally_on_the_first_fetch(preloaded, lm):
    node, docs = preloaded
    c = node.client()
    for path, tokens in docs.items():
        with c.fetch(lm.model_id, tokens, deadline_ms=60_000) as f:
            chunks = list(f)
            assert f.start.local_tokens == f.found_tokens == len(tokens), path
            assert chunks and all(ev.source == "local" and ev.kind == "kv" for ev in chunks), (path, chunks)


def test_preloaded_contexts_are_listed_pinned(preloaded):
    node, _ = preloaded
    ctxs = node.client().contexts()
    assert len(ctxs) == DOCS and all(c["pinned"] for c in ctxs)


def test_a_stored_document_is_not_prefilled_again_only_pinned(preloaded, lm):
    node, docs = preloaded
    c = node.client()
    path, tokens = next(iter(docs.items()))
    before = c.status()["store"]["pinned_bytes"]
    c.unpin(c.pin(lm.model_id, tokens)["key"])  # (pinned already: the pin only names its key)
    o = preload.preload_one(c, lm, path)
    assert (o.outcome, o.stored_chunks) == ("held", 0) and o.pinned > 0
    assert c.status()["store"]["pinned_bytes"] == before


def test_filling_the_store_past_its_budgets_evicts_none_of_the_preloaded(preloaded, lm):
    node, docs = preloaded
    c = node.client()
    prof = registry.for_model(lm.model_id)
    pinned_bytes = c.status()["store"]["pinned_bytes"]
    others = []
    for i in range(30):  # until three unpinned contexts have been evicted
        tokens = [1000 * (i + 1) + j for j in range(256)]
        c.put(lm.model_id, tokens, synthetic_kv(256, seed=i, layers=prof.layers, heads=prof.heads,
                                                 head_dim=prof.head_dim))
        others.append(tokens)
        if sum(c.lookup(lm.model_id, t)["local_tokens"] < len(t) for t in others) >= 3:
            break
    else:
        pytest.fail("30 other contexts evicted fewer than 3: the budgets are larger than the test means")
    store = c.status()["store"]
    assert store["evictions"] > 0 and store["pinned_bytes"] == pinned_bytes
    for path, tokens in docs.items():
        assert c.lookup(lm.model_id, tokens)["local_tokens"] == len(tokens), f"{path} was evicted"


@pytest.mark.system  # a daemon process
def test_a_missing_preload_file_is_an_error_naming_it_and_the_daemon_serves(tmp_path, small_profile):
    node = synthetic_daemon(tmp_path, "m", small_profile, store={"preload": [str(tmp_path / "nope.txt")]})
    node.start()
    try:
        state = wait_preloaded(node, 60)
        assert state["state"] == "failed" and state["failed"] == 1
        assert state["errors"] == [f"{tmp_path / 'nope.txt'}: no such file or folder"]
        assert node.client().health()["status"] == "ok"
    finally:
        node.stop()


def test_a_restart_pins_the_preloaded_documents_again_without_prefilling_them(preloaded):
    node, docs = preloaded
    node.stop()
    node.start()
    state = wait_preloaded(node)
    assert (state["state"], state["held"], state["stored"]) == ("done", DOCS, 0), state
    assert len(node.client().pins()) == DOCS
