"""Benchmarks: each writes JSON and prints the table that docs/benchmarks.md carries."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ..limits import MAX_DEADLINE_MS


def write_json(report: dict, json_path: str | None) -> None:
    """A benchmark's report as JSON at `json_path` (its folder made), when one is given."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))


def profile_and_pool(model_id: str, profile_path: str | Path | None = None, workers: int | None = None):
    """What a benchmark that codes in-process codes model_id's KV with: the profile
    (codec.tuning.registry.for_model: the file `profile_path`, its --profile, where one is given, else
    the user folder's, else the shipped one) and a CodecPool of `workers` (default: one per
    core) whose workers are handed that profile's file. (profile, pool): close the pool."""
    from codec.tuning import registry
    from codec.pool.parallel import CodecPool

    profile = registry.for_model(model_id, profile_path)
    return profile, CodecPool(workers, profile_paths=(profile.path,) if profile.path else ())


def profile_keys(model_id: str, profile_path: str | Path | None) -> dict:
    """The [codec] keys that make a benchmark's daemons code model_id with its --profile:
    {"profile": the file}, once it is known to be model_id's (a daemon codes a model its
    `[codec] profile` is not for with the registry's choice), or {} without one."""
    if profile_path is None:
        return {}
    from codec.tuning import registry

    registry.for_model(model_id, profile_path)
    return {"profile": str(Path(profile_path).absolute())}


DEADLINE_MS = MAX_DEADLINE_MS  # a timed fetch takes exactly the level asked, however long it takes


def timed_fetch(d, model_id: str, tokens: list[int], level: str) -> dict:
    """Fetch on daemon `d` (a lab.daemons.DaemonProcess) at exactly `level`: its seconds, the
    End's timings, bytes and errors, and where its chunks came from."""
    t0 = time.perf_counter()
    with d.client().fetch(model_id, tokens, deadline_ms=DEADLINE_MS, levels=[level]) as f:
        events = list(f)
        end = f.end
    return {"seconds": time.perf_counter() - t0, "timings": end.timings,
            "kv_chunks": sum(ev.kind == "kv" for ev in events), "chunks": len(events),
            "sources": sorted({ev.source for ev in events}), "bytes": end.bytes, "errors": end.errors,
            "by_source": {s: sum(ev.source == s for ev in events) for s in {ev.source for ev in events}}}


def prefilled_document(model: str | None, tokens: int, log=print):
    """The model (models.load(model)), the first `tokens`-token window of WikiText-2 test.txt,
    and its KV as fp16, prefilled in blocks of 1024 as the e2e bench prefills:
    (lm, doc, kv)."""
    import torch

    from .. import models
    from ..lab import corpus

    torch.set_num_threads(os.cpu_count() or 1)
    lm = models.load(model)
    doc = corpus.windows(lm.tokenizer, "test", 1, tokens)[0]
    log(f"prefilling {tokens} tokens of test.txt with {lm.model_id}")
    kv = None
    for s in range(0, len(doc), 1024):
        _, kv = models.prefill(lm, doc[s:s + 1024], kv, all_logits=False)
    return lm, doc, kv.half()


def link_peer_parser(prog: str, roles: list[str], port: int) -> argparse.ArgumentParser:
    """The command line of a link benchmark's two ends (run inside its namespaces): role, the
    cluster secret, where to listen or dial, and the chunks to move."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("role", choices=roles)
    p.add_argument("--secret", required=True, help="hex")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--addr")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--chunks", type=int, required=True)
    p.add_argument("--chunk-bytes", type=int, required=True)
    return p
