"""`kvstreamd bench agreement`: how often a scheme changes what the model answers. For each of N
documents (bench vllm's prompts: a user turn opening with a test.txt window, then the question
that closes it), the model's greedy tokens after document + question on the exact cache, and on
the document's KV coded chunk by chunk at each scheme (a codec level through encode and decode, at
its one scale, as a vLLM connector's put codes it; a baseline through its own); per scheme, the
documents whose first token, and whose first `new_tokens`, are unchanged, and where each first
changed. What a lossy cache changes is a near tie between two next tokens, now and then, at a
rate that falls with the coding error: the measure behind `max` (docs/benchmarks.md)."""
from __future__ import annotations

import time

import torch

from .. import models
from . import write_json
from .vllm import documents

SCHEMES = ["int8", "high", "max"]
CHUNK_TOKENS = 256  # the daemons' chunk size in bench vllm and e2e


def coded(kv: torch.Tensor, scheme: str, profile, chunk_tokens: int) -> tuple[torch.Tensor, int]:
    """kv [L, 2, T, H, D] fp16 after coding each chunk at `scheme`, and the coded bytes."""
    import codec
    from codec import baselines
    from codec.tuning import catalog

    parts, size = [], 0
    for start in range(0, kv.shape[2], chunk_tokens):
        chunk = kv[:, :, start:start + chunk_tokens].contiguous()
        if catalog.is_level(scheme):
            data = codec.encode(chunk, scheme, profile, start)
            parts.append(codec.decode(data, profile))
        else:
            data = baselines.SCHEMES[scheme].encode(chunk)
            parts.append(baselines.SCHEMES[scheme].decode(data))
        size += len(data)
    return torch.cat(parts, dim=2), size


def first_change(reference: list[int], got: list[int]) -> int | None:
    """The index of the first token that differs, None if none does."""
    return next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), None)


def run(tokens: int = 4096, docs: int = 30, schemes: list[str] | None = None, new_tokens: int = 8,
        chunk_tokens: int = CHUNK_TOKENS, model: str | None = None, profile: str | None = None,
        json_path: str | None = None, log=print) -> dict:
    from codec.tuning import catalog, registry

    schemes = list(schemes or SCHEMES)
    for name in schemes:
        catalog.get(name)  # an unknown name fails before the model loads
    lm = models.load(model)
    prof = registry.for_model(lm.model_id, profile)
    prompts, question = documents(lm, tokens, docs + 1)
    rows = []
    for d, doc in enumerate(prompts[1:]):  # bench vllm's first is its warm-up
        t0 = time.perf_counter()
        kv = models.prefill(lm, doc, all_logits=False)[1].to(torch.float16)
        reference = models.generate_greedy(lm, kv.float(), question, new_tokens)
        row = {"doc": d, "reference": reference, "schemes": {}}
        for name in schemes:
            dec, size = coded(kv, name, prof, chunk_tokens)
            got = models.generate_greedy(lm, dec.float(), question, new_tokens)
            row["schemes"][name] = {"tokens": got, "changed_at": first_change(reference, got),
                                    "ratio": kv.numel() * 2 / size}
        rows.append(row)
        log(f"  document {d + 1}/{docs}: " + ", ".join(
            f"{n} {'kept' if s['changed_at'] is None else 'changed at ' + str(s['changed_at'])}"
            for n, s in row["schemes"].items()) + f" ({time.perf_counter() - t0:.0f} s)")
    report = {"model": lm.model_id, "profile": prof.id.hex(), "tokens": tokens, "chunk_tokens": chunk_tokens,
              "new_tokens": new_tokens, "schemes": schemes, "documents": rows, "results": summarise(rows, schemes)}
    write_json(report, json_path)
    return report


def summarise(rows: list[dict], schemes: list[str]) -> list[dict]:
    out = []
    for name in schemes:
        changed = [r["schemes"][name]["changed_at"] for r in rows]
        out.append({"scheme": name, "documents": len(rows),
                    "ratio": sum(r["schemes"][name]["ratio"] for r in rows) / len(rows),
                    "first_kept": sum(c != 0 for c in changed), "all_kept": sum(c is None for c in changed),
                    "changed_at": sorted(c for c in changed if c is not None)})
    return out


def table(report: dict) -> str:
    lines = [f"{report['model']}: {len(report['documents'])} documents of {report['tokens']} tokens + a question, "
             f"{report['new_tokens']} greedy tokens, chunks of {report['chunk_tokens']} coded one by one",
             f"{'scheme':10} {'x fp16':>7} {'first token kept':>16} {'all kept':>9}  changed at (token index)"]
    for r in report["results"]:
        n = r["documents"]
        lines.append(f"{r['scheme']:10} {r['ratio']:>6.2f}x {r['first_kept']:>11}/{n:<4} {r['all_kept']:>5}/{n:<3}  "
                     + (" ".join(map(str, r["changed_at"])) or "-"))
    return "\n".join(lines)


__all__ = ["run", "table", "summarise", "first_change", "coded"]
