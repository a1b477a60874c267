"""kvstreamd under real vLLM engines on two hosts: daemons a and b in two network namespaces joined
by a tbf-shaped veth pair, a vLLM engine beside each (in the root namespace: an engine reaches its
daemon over the daemon's Unix socket). Host a's vLLM computes document + question, nothing held
anywhere (vLLM's own tokens), and its connector puts the document; host b's vLLM answers the
same prompt from a's KV, fetched over the link, with those tokens -- and with those tokens still
when b's daemon dies in the middle of the fetch (vLLM recomputes)."""
from __future__ import annotations

import threading
import time

import pytest

from kvstreamd.lab import corpus, netns
from kvstreamd.lab.daemons import DaemonProcess, wait_for
from kvstreamd.lab.vllm_engine import Engine, connector_config
from kvstreamd.models.engine_folder import engine_folder

ok, why = netns.available()
pytestmark = [pytest.mark.system,  # vLLM servers and daemon processes in network namespaces (root)
              pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here: {why}")]

CHUNK = 256
DOC = 4 * CHUNK
SLOW_MBIT = 20  # 4 chunks at fp16 (~24 MB) take ~10 s: b's fetch is still moving when its daemon dies
FETCH_DEADLINE_MS = 120_000  # the fetch moves every chunk at fp16, however long that takes


@pytest.fixture(scope="module")
def world(lm, tmp_path_factory):
    """The link, a daemon on each side (peers), and the documents: host a's vLLM (its connector
    beside a's daemon) answered document + question for each -- nothing held anywhere yet, so it
    computed them itself: the reference tokens -- and its connector put each document's whole
    chunks. Then host b's vLLM (fp16 only, so its tokens can be vLLM's own; it puts nothing). One
    engine at a time: each holds a few GB."""
    root = tmp_path_factory.mktemp("vllm-hosts")
    folder = engine_folder(None, root / "model")
    extra = {"codec": {"chunk_tokens": CHUNK, "levels": ["fp16", "high"], "workers": 1}}
    link = netns.Link().up()
    a = DaemonProcess("a", root / "a", host=link.addr["a"], netns=link.command("a", []), extra=extra)
    b = DaemonProcess("b", root / "b", host=link.addr["b"], netns=link.command("b", []), extra=extra)
    a.peers, b.peers = [b.addr], [a.addr]
    b_engine = None
    try:
        for d in (a, b):
            d.start(wait=0)
        for d in (a, b):
            d.wait_healthy()
        wait_for(lambda: b.client().status()["peers_connected"], timeout=30, what="the hosts to connect")
        ids = lm.tokenizer.encode((corpus.wikitext_dir() / "test.txt").read_text()[60_000:120_000])
        question = lm.tokenizer.encode(" Question: what is the text above about? Answer:")
        docs = [ids[0:DOC], ids[3000:3000 + DOC]]
        try:
            a_engine = Engine(folder, connector_config(a.socket), root / "a.log", in_process=True)
        except FileNotFoundError as e:
            pytest.fail(str(e))
        with a_engine:
            computed = [a_engine.generate([doc + question])["tokens"][0] for doc in docs]
        for doc in docs:
            wait_for(lambda: b.client().lookup(lm.model_id, doc + question)["peers"].get("a") == len(doc),
                     timeout=120, what="b to see the chunks a's vLLM put")
        b_engine = Engine(folder, connector_config(b.socket, levels=["fp16"], deadline_ms=FETCH_DEADLINE_MS,
                                                   save=False), root / "b.log", in_process=True)
        yield {"lm": lm, "link": link, "a": a, "b": b, "b_engine": b_engine,
               "prompts": [doc + question for doc in docs], "computed": computed}
    finally:
        if b_engine is not None:
            b_engine.close()
        for d in (a, b):
            d.kill()
        link.down()


def fetching(d: DaemonProcess) -> bool:
    """A fetch is under way on the daemon."""
    return any(line.startswith("kvstreamd_fetches_active ") and float(line.split()[1]) > 0
               for line in d.client().metrics().splitlines())


def test_a_document_host_as_vllm_computed_is_fetched_over_the_link_and_host_b_answers_with_its_own_tokens(world):
    prompt, a, b = world["prompts"][0], world["a"], world["b"]
    world["link"].shape(1000)
    sent, received = a.counter("kvstreamd_chunks_total", direction="sent"), \
        b.counter("kvstreamd_chunks_total", direction="received")
    wire = b.counter("kvstreamd_fetch_bytes_total")
    assert world["b_engine"].generate([prompt])["tokens"][0] == world["computed"][0]
    # every chunk came from a over the link, as KV at fp16: none was recomputed
    assert a.counter("kvstreamd_chunks_total", direction="sent", level="fp16") - sent == DOC // CHUNK
    assert b.counter("kvstreamd_chunks_total", direction="received", level="fp16") - received == DOC // CHUNK
    lm = world["lm"]
    fp16_bytes = DOC * lm.num_layers * 2 * lm.num_kv_heads * lm.head_dim * 2
    assert b.counter("kvstreamd_fetch_bytes_total") - wire > 0.9 * fp16_bytes
    assert not world["b_engine"].said(r"kvstreamd: a fetch failed|as text \(or not at all\)")


def test_host_bs_daemon_killed_during_the_fetch_leaves_the_request_with_vllms_own_tokens_promptly(world):
    """(Last: b's daemon stays dead.) The fetch's socket closes when the daemon dies, so the
    connector sees the fetch end at once and vLLM recomputes: no wait for the client's timeout."""
    prompt, b = world["prompts"][1], world["b"]
    world["link"].shape(SLOW_MBIT)
    killed = threading.Event()

    def kill_once_fetching() -> None:
        wait_for(lambda: fetching(b), timeout=60, interval=0.05, what="b's fetch to start")
        time.sleep(0.5)
        b.kill()
        killed.set()

    killer = threading.Thread(target=kill_once_fetching, daemon=True)
    t0 = time.monotonic()
    killer.start()
    got = world["b_engine"].generate([prompt])["tokens"][0]
    seconds = time.monotonic() - t0
    killer.join(5)
    assert killed.is_set() and not b.alive()
    assert got == world["computed"][1]
    assert world["b_engine"].said(r"kvstreamd: a fetch failed")
    # the whole fetch at 20 Mbit/s takes ~10 s and the client's timeout is 60 s: the request ended
    # with a recompute soon after the kill
    assert seconds < 20, f"the request took {seconds:.1f} s after b's daemon died"
