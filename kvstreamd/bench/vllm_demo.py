"""`kvstreamd demo-vllm`: two hosts, each an OpenAI-compatible vLLM server with the kvstreamd
connector beside its own daemon (the two daemons in two network namespaces joined by a
tbf-shaped link, as in `bench e2e`). Host a's server answers a document + question, computing
it, and its connector puts the document's chunks into daemon a; host b's server is then asked the
same prompt and loads the document from daemon a through daemon b instead of computing it.
Printed: each server's time to first token (a streamed /v1/completions) and both answers.

Each server first answers a warm-up prompt of its own (off the clock, nobody else holds it).
Host a's time is vLLM computing the prompt plus what its connector adds on a miss (the lookup);
`kvstreamd bench vllm` measures vLLM without a connector, with medians over documents."""
from __future__ import annotations

from .. import models
from ..lab.vllm_engine import NEW_TOKENS, Server, connector_config
from . import e2e, profile_keys, write_json
from .vllm import CHUNK_TOKENS, documents, vllm_hosts, wait_held


def run(tokens: int = 4096, bandwidth_mbit: float = 100.0, model: str | None = None,
        chunk_tokens: int = CHUNK_TOKENS, json_path: str | None = None, log=print,
        profile: str | None = None) -> dict:
    lm = models.load(model)
    codec = profile_keys(lm.model_id, profile)
    docs, question = documents(lm, tokens, 3)
    warm_a, warm_b, doc = docs
    prompt = doc + question
    deadline_ms = e2e.deadline_for(tokens)
    with vllm_hosts(model, bandwidth_mbit, chunk_tokens, codec, "kvstreamd-demo-vllm-", log) as (h, root, folder):
        log(f"starting two vLLM servers ({lm.model_id}), each with the connector beside its daemon (20-60 s)")
        servers = [Server(folder, connector_config(d.socket, deadline_ms=deadline_ms), root / f"vllm-{d.name}.log",
                          max_model_len=tokens + 512) for d in (h.a, h.b)]
        try:
            for s in servers:
                s.start(wait=0)
            for s in servers:
                s.wait_ready()
            a, b = servers
            for server, daemon, warm in ((a, h.a, warm_a), (b, h.b, warm_b)):
                server.complete(warm[:4 * chunk_tokens] + question, 1)
                wait_held(daemon, lm.model_id, warm[:4 * chunk_tokens], 4 * chunk_tokens, "the warm-up's put")
            log(f"host a: a {len(prompt)}-token prompt (a {tokens}-token WikiText document and a question)")
            one = a.complete(prompt, NEW_TOKENS)
            held = tokens - tokens % chunk_tokens
            wait_held(h.b, lm.model_id, prompt, held, "host b to see host a's chunks")
            log(f"host b: the same prompt, over a {bandwidth_mbit:g} Mbit/s link")
            before = h.b.counter("kvstreamd_fetch_bytes_total")
            two = b.complete(prompt, NEW_TOKENS)
            moved = h.b.counter("kvstreamd_fetch_bytes_total") - before
        finally:
            for s in servers:
                s.stop()
    report = {"model": lm.model_id, "tokens": tokens, "prompt_tokens": len(prompt), "bandwidth_mbit": bandwidth_mbit,
              "shaped": h.shaped, "chunk_tokens": chunk_tokens, "deadline_ms": deadline_ms,
              "a": {"ttft_s": one["ttft"], "text": one["text"], "tokens": one["tokens"]},
              "b": {"ttft_s": two["ttft"], "text": two["text"], "tokens": two["tokens"], "fetch_bytes": moved},
              "same_answer": one["tokens"] == two["tokens"]}
    write_json(report, json_path)
    return report


def summary(report: dict) -> str:
    a, b = report["a"], report["b"]
    return "\n".join([
        f"{report['model']}, a {report['prompt_tokens']}-token prompt, {report['bandwidth_mbit']:g} Mbit/s"
        + ("" if report["shaped"] else " [loopback: not shaped]"),
        f"host a (vLLM computes it):            first token in {a['ttft_s']:.2f} s",
        f"host b (vLLM loads it through kvstreamd): first token in {b['ttft_s']:.2f} s "
        f"({a['ttft_s'] / b['ttft_s']:.1f}x sooner, {b['fetch_bytes'] / 1e6:.1f} MB over the link)",
        f"host a's answer: {a['text']!r}",
        f"host b's answer: {b['text']!r} ({'the same tokens' if report['same_answer'] else 'DIFFERENT tokens'})"])


__all__ = ["run", "summary"]
