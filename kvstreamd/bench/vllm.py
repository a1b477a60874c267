"""`kvstreamd bench vllm`: kvstreamd under a real vLLM on two hosts. Two daemons in two network
namespaces joined by a tbf-shaped veth pair (e2e.hosts), a vLLM engine beside each (the engines
run in the root namespace: they reach their daemon over its Unix socket). Host a's vLLM computes
a WikiText-2 document and its connector puts the whole chunks into a's daemon -- the KV host b
loads is vLLM's own. Host b then answers document + question three ways, one prompt at a time,
time to first token (max_tokens=1) and the 8 greedy tokens (max_tokens=8, a separate call):

- vllm: b's engine without a connector, vLLM's own prefill of the whole prompt (vLLM as it is
  run today; a connected engine on a document nobody holds would add its lookup and its put);
- kvstreamd: b's connected engine, the daemons' adaptive levels (`max` among them: the hosts
  store it) under the deadline an operator who wants the floor's speed-up sets: the connector's
  `speedup` = TTFT_FLOOR over vLLM's own prefill rate, measured on b (so the best quality that
  keeps the floor: vLLM's own tokens, near ties included, at `max`);
- fp16: b's connected engine, connector levels ["fp16"]: raw KV, whatever it takes;
- and a miss: TTFT for documents nobody holds, by b's engine without a connector and by one with
  it as deployed (its lookup finds nothing; it puts the prompt afterwards): what a miss costs.

b's daemon keeps nothing it fetched and b's engines for the three methods put nothing, so every call crosses the link;
vLLM's prefix caching is off in every engine. One engine runs at a time (a's first, then b's
four in turn, each after a warm-up request on a document nobody holds): each holds ~3.5 GB.
Bytes and levels are b's daemon's metrics."""
from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .. import models
from ..limits import speedup_deadline_ms
from ..lab import corpus
from ..lab.daemons import DaemonProcess, wait_for
from ..lab.vllm_engine import NEW_TOKENS, Engine, connector_config
from ..models.engine_folder import engine_folder
from . import e2e, profile_keys, write_json

METHODS = ["vllm", "kvstreamd", "fp16"]
CHUNK_TOKENS = 256
FP16_DEADLINE_MS = e2e.BASELINE_DEADLINE_MS  # raw KV moves whole, however long it takes
PUT_WAIT_S = 300  # a's daemon encodes every stored level of every chunk before b can see them
STORE_BUDGET = "6GiB"  # each daemon's memory budget: a holds every document at every level


# The floor on TTFT (times lower than vLLM's own prefill) per model, at its documented
# point: SmolLM2 at 4096 tokens, Gemma-3 at 16K, both at 100 Mbit/s.
TTFT_FLOOR = {"smollm2-135m": 3.0, "gemma3-270m": 4.0}


def _counter(d: DaemonProcess, name: str, **labels: str) -> dict[str, float]:
    """A daemon's series of metric `name` (with these labels), keyed by their label text."""
    out = {}
    for line in d.client().metrics().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            series, value = line.rsplit(" ", 1)
            out[series[len(name):]] = float(value)
    return out


def _snapshot(b: DaemonProcess) -> dict:
    return {"bytes": sum(_counter(b, "kvstreamd_fetch_bytes_total").values()),
            "fetch_s": sum(_counter(b, "kvstreamd_fetch_seconds_sum").values()),
            "fetches": sum(_counter(b, "kvstreamd_fetch_seconds_count").values()),
            "chunks": {k.split('level="')[1].split('"')[0]: v
                       for k, v in _counter(b, "kvstreamd_fetch_chunks_total").items()}}


def _since(before: dict, after: dict) -> dict:
    """What b's daemon did between two snapshots: wire bytes, fetch seconds, chunks per level."""
    levels = {lv: int(n - before["chunks"].get(lv, 0)) for lv, n in after["chunks"].items()
              if n - before["chunks"].get(lv, 0) > 0}
    return {"bytes": int(after["bytes"] - before["bytes"]), "fetches": int(after["fetches"] - before["fetches"]),
            "daemon_fetch_s": round(after["fetch_s"] - before["fetch_s"], 3), "levels": levels}


def _call(engine: Engine, b: DaemonProcess, prompt: list[int], max_tokens: int) -> dict:
    before = _snapshot(b)
    out = engine.generate([prompt], max_tokens=max_tokens)
    return {"seconds": out["seconds"][0], "tokens": out["tokens"][0], **_since(before, _snapshot(b))}


def _warm_up(engine: Engine, prompt: list[int]) -> float:
    """An engine's first request (a document nobody holds: computed by vLLM) is off the clock;
    its seconds."""
    return engine.generate([prompt], max_tokens=1)["seconds"][0]


def _measure(engine: Engine, method: str, b: DaemonProcess, docs: list[list[int]], question: list[int],
             rows: dict, log) -> None:
    """Each document + question on b by one method: TTFT (max_tokens=1), then the 8 tokens."""
    for r, doc in enumerate(docs):
        first = _call(engine, b, doc + question, 1)
        eight = _call(engine, b, doc + question, NEW_TOKENS)
        rows[(r, method)].update(tokens=len(doc), prompt_tokens=len(doc + question), ttft_s=first["seconds"],
                                 first=first, eight=eight)
        log(f"  {method:10} document {r + 1}: TTFT {first['seconds']:.2f} s, {first['bytes'] / 1e6:.1f} MB, "
            f"levels {first['levels']}, b's daemon's fetch {first['daemon_fetch_s']:.2f} s")


def wait_held(d: DaemonProcess, model_id: str, prompt: list[int], tokens: int, what: str) -> None:
    """Until daemon `d` finds at least `tokens` of `prompt` held (in the cluster)."""
    wait_for(lambda: d.client().lookup(model_id, prompt)["found_tokens"] >= tokens, timeout=PUT_WAIT_S,
             interval=0.5, what=what)


def _miss(folder: Path, b: DaemonProcess, model_id: str, unheld: list[list[int]], warm: list[int],
          question: list[int], chunk_tokens: int, root: Path, max_model_len: int, log) -> dict:
    """What a miss costs: documents nobody holds, each answered by an engine without a connector
    and by one with it as deployed (its lookup finds nothing; it puts the prompt's chunks after
    the first token). Both engines are up together and take turns, the order alternating per
    document, so the machine's drift falls on both alike; after each connector call b's daemon
    is left to store the put before the next timed call (its encoding is CPU work after the
    request's first token, which on this 2-core machine would land on the next call)."""
    plain_s, connector_s = [], []
    with Engine(folder, None, root / "b-miss-plain.log", max_model_len=max_model_len) as plain, \
            Engine(folder, connector_config(b.socket), root / "b-miss.log", max_model_len=max_model_len) as conn:
        for engine in (plain, conn):  # a prompt nobody holds (the connector puts it: waited for below)
            _warm_up(engine, warm[:4 * chunk_tokens] + question)
        wait_held(b, model_id, warm[:4 * chunk_tokens], 4 * chunk_tokens, "b's daemon to store the warm-up's put")
        for i, doc in enumerate(unheld):
            prompt = doc + question
            held = len(doc) - len(doc) % chunk_tokens
            for engine in ((plain, conn) if i % 2 == 0 else (conn, plain)):
                t = engine.generate([prompt], max_tokens=1)["seconds"][0]
                (plain_s if engine is plain else connector_s).append(t)
                if engine is conn:
                    wait_held(b, model_id, prompt, held, "b's daemon to store the miss's put")
            log(f"  a miss, document {i + 1}: TTFT {connector_s[-1]:.2f} s with the connector, "
                f"{plain_s[-1]:.2f} s without")
    return {"vllm_s": plain_s, "connector_s": connector_s,
            "cost": statistics.median(c / p for c, p in zip(connector_s, plain_s)) - 1}


def needed_fp16_bytes(lm, tokens: int, chunk_tokens: int) -> int:
    """What the model needs of a `tokens`-token document's held prefix (its whole chunks), in
    fp16: every token of each full-attention layer, the last window of each sliding layer
    (rounded to whole chunks, as a fetch moves them), K and V."""
    prefix = tokens - tokens % chunk_tokens
    return lm.layout.token_layers(prefix, chunk_tokens) * 2 * lm.num_kv_heads * lm.head_dim * 2


def documents(lm, tokens: int, count: int) -> tuple[list[list[int]], list[int]]:
    """`count` contexts (a user turn opening with a test.txt window, `tokens` in all) and the
    question that closes the turn: the e2e bench's prompts."""
    question = lm.tokenizer.encode(lm.spec.turn_close)
    head = lm.tokenizer.document(lm.spec.turn_open)
    return [head + w[:tokens - len(head)] for w in corpus.windows(lm.tokenizer, "test", count, tokens - len(head))], \
        question


@contextmanager
def vllm_hosts(model: str | None, bandwidth_mbit: float, chunk_tokens: int, codec: dict, prefix: str,
               log, memory_budget: str = "2GiB") -> Iterator[tuple[e2e.Hosts, Path, Path]]:
    """Two daemons as two hosts across a link shaped to `bandwidth_mbit` (b keeps nothing it
    fetches), a scratch folder, and the model folder vLLM serves: (hosts, scratch, folder)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, \
            e2e.hosts(Path(tmp), chunk_tokens, b_keeps_fetched=False, codec=codec,
                      memory_budget=memory_budget) as (h, why_not):
        root = Path(tmp)
        if why_not:
            log(f"NOTE: no network namespaces here ({why_not}): the two hosts talk over plain loopback, "
                "unshaped, so --bandwidth has no effect")
        h.shape(bandwidth_mbit)
        yield h, root, engine_folder(model, root / "model")


def run(tokens: int = 4096, bandwidth_mbit: float = 100.0, runs: int = 3, chunk_tokens: int = CHUNK_TOKENS,
        model: str | None = None, json_path: str | None = None, log=print, profile: str | None = None) -> dict:
    lm = models.load(model)
    codec = profile_keys(lm.model_id, profile)
    max_model_len = tokens + 512  # the document, the question and the answer
    # a warm-up document first: it times vLLM's own prefill, the rate the adaptive rule prices TEXT at
    docs, question = documents(lm, tokens, 2 * runs + 1)
    # and documents nobody holds: a miss, with the connector (its lookup and its put) and without
    warm, docs, unheld = docs[0], docs[1:runs + 1], docs[runs + 1:]
    speedup = TTFT_FLOOR.get(lm.name, 3.0)
    codec = {**codec, "levels": ["max", *e2e.STORED_LEVELS]}
    # a's store holds every document at every stored level (SmolLM2, 4096 tokens: ~220 MB each;
    # Gemma-3, 16K: ~700 MB): past the budget the first ones would be evicted, and computed
    with vllm_hosts(model, bandwidth_mbit, chunk_tokens, codec, "kvstreamd-bvllm-", log,
                    memory_budget=STORE_BUDGET) as (h, root, folder):
        rows = {(r, m): {"run": r, "method": m} for r in range(runs) for m in METHODS}
        # One engine at a time (each holds ~3.5 GB; the others are closed, not idle beside it).
        log("host a's vLLM computes the documents; its connector puts them into a's daemon")
        with Engine(folder, connector_config(h.a.socket), root / "a.log", max_model_len=max_model_len) as a:
            for r, doc in enumerate(docs):
                t0 = time.perf_counter()
                a.generate([doc], max_tokens=1)
                held = len(doc) - len(doc) % chunk_tokens
                wait_held(h.b, lm.model_id, doc + question, held, "b to see a's chunks")
                log(f"  document {r + 1}/{runs} ({len(doc)} tokens): computed and put in "
                    f"{time.perf_counter() - t0:.1f} s")
        for r, doc in enumerate(docs):  # still held, every one: an evicted document would be computed on b
            held = len(doc) - len(doc) % chunk_tokens
            found = h.b.client().lookup(lm.model_id, doc + question)["found_tokens"]
            if found < held:
                raise RuntimeError(f"document {r + 1}: {found} of its {held} tokens still held after every put: "
                                   f"a's store ({STORE_BUDGET}) is too small for {runs} documents")
        with Engine(folder, None, root / "b-vllm.log", max_model_len=max_model_len) as plain:
            t = _warm_up(plain, warm + question)
            prefill_tps = len(warm + question) / t
            log(f"vLLM's own prefill on b: {prefill_tps:.0f} tokens/s (a warm-up of {len(warm + question)} tokens)")
            _measure(plain, "vllm", h.b, docs, question, rows, log)
        with Engine(folder, connector_config(h.b.socket, save=False, speedup=speedup,
                                             recompute_tokens_per_s=prefill_tps), root / "b-kvstreamd.log",
                    max_model_len=max_model_len) as e:
            _warm_up(e, warm + question)
            _measure(e, "kvstreamd", h.b, docs, question, rows, log)
        with Engine(folder, connector_config(h.b.socket, save=False, levels=["fp16"], deadline_ms=FP16_DEADLINE_MS),
                    root / "b-fp16.log", max_model_len=max_model_len) as e:
            _warm_up(e, warm + question)
            _measure(e, "fp16", h.b, docs, question, rows, log)
        miss = _miss(folder, h.b, lm.model_id, unheld, warm, question, chunk_tokens, root, max_model_len, log)
        said = {name: [ln for ln in (root / f"{name}.log").read_text().splitlines() if "vllm_connector.py" in ln][-20:]
                for name in ("a", "b-vllm", "b-kvstreamd", "b-fp16", "b-miss", "b-miss-plain")}
    for (r, m), row in rows.items():
        ref = rows[(r, "vllm")]
        row["first_token_match"] = row["first"]["tokens"] == ref["first"]["tokens"]
        row["tokens_match"] = row["eight"]["tokens"] == ref["eight"]["tokens"]
    report = {"model": lm.model_id, "ttft_floor": speedup, "shaped": h.shaped, "bandwidth_mbit": bandwidth_mbit, "tokens": tokens,
              "chunk_tokens": chunk_tokens, "speedup": speedup,
              # the kvstreamd fetches' deadline, as the connector sets it from `speedup`: their
              # prefix's prefill time on b's vLLM over `speedup`
              "deadline_ms": speedup_deadline_ms(tokens - tokens % chunk_tokens, prefill_tps, speedup),
              "vllm_prefill_tokens_per_s": prefill_tps,
              "generate": NEW_TOKENS, "results": summarise(list(rows.values())), "runs": list(rows.values()),
              "needed_fp16_bytes": needed_fp16_bytes(lm, tokens, chunk_tokens), "miss": miss,
              "connector_log_lines": said}
    write_json(report, json_path)
    return report


def summarise(rows: list[dict]) -> list[dict]:
    base = statistics.median(r["ttft_s"] for r in rows if r["method"] == "vllm")
    out = []
    for method in METHODS:
        rs = [r for r in rows if r["method"] == method]
        ttft = statistics.median(r["ttft_s"] for r in rs)
        out.append({"method": method, "runs": len(rs), "ttft_s": round(ttft, 3), "speed_up": round(base / ttft, 2),
                    "ttft_runs_s": [round(r["ttft_s"], 3) for r in rs],
                    "eight_s": round(statistics.median(r["eight"]["seconds"] for r in rs), 3),
                    "bytes": int(statistics.median(r["first"]["bytes"] for r in rs)),
                    "daemon_fetch_s": round(statistics.median(r["first"]["daemon_fetch_s"] for r in rs), 3),
                    "first_token_match": [r["first_token_match"] for r in rs],
                    "tokens_match": [r["tokens_match"] for r in rs]})
    return out


# Bytes a fetch may move past what the model needs: each chunk's header and framing (a few hundred
# bytes on a chunk of megabytes).
FRAMING = 0.01


def floors(report: dict) -> dict[str, bool]:
    """The issue's floors for kvstreamd on the second vLLM: TTFT at least TTFT_FLOOR times lower
    than vLLM's own prefill, the first token equal in every run, all 8 in at least 90% of runs;
    raw KV (fp16) no more bytes than the model needs (a hybrid model's sliding layers: their
    window only); a miss at most 5% slower than no connector."""
    k = next(r for r in report["results"] if r["method"] == "kvstreamd")
    fp16 = next(r for r in report["results"] if r["method"] == "fp16")
    floor = report.get("ttft_floor", 3.0)
    return {f"ttft_{floor:g}x": k["speed_up"] >= floor, "first_token_every_run": all(k["first_token_match"]),
            "eight_tokens_90pct": sum(k["tokens_match"]) / len(k["tokens_match"]) >= 0.9,
            "bytes_as_needed": fp16["bytes"] <= report["needed_fp16_bytes"] * (1 + FRAMING),
            "miss_cost_5pct": report["miss"]["cost"] <= 0.05}


def table(report: dict) -> str:
    lines = [f"{report['model']}, {report['tokens']}-token documents computed by host a's vLLM, "
             f"{report['bandwidth_mbit']:g} Mbit/s" + ("" if report["shaped"] else " [loopback: not shaped]")
             + f", chunks of {report['chunk_tokens']}, deadline {report['deadline_ms']} ms "
             f"(vLLM's own prefill / {report.get('speedup', 0):g})",
             f"{'method':10} {'TTFT s':>7} {'speed-up':>8} {'8 tokens s':>10} {'MB moved':>8} {'daemon fetch s':>14} "
             f"{'1st token = vllm':>16} {'8 tokens = vllm':>15}"]
    for r in report["results"]:
        first = "".join("y" if m else "n" for m in r["first_token_match"])
        eight = "".join("y" if m else "n" for m in r["tokens_match"])
        lines.append(f"{r['method']:10} {r['ttft_s']:>7.2f} {r['speed_up']:>7.2f}x {r['eight_s']:>10.2f} "
                     f"{r['bytes'] / 1e6:>8.1f} {r['daemon_fetch_s']:>14.2f} {first:>16} {eight:>15}")
    lines.append(f"medians of {report['results'][0]['runs']} runs (a fresh document each); per-run matches y/n "
                 "against vLLM's own tokens; daemon fetch: b's daemon's time from the fetch to its last chunk")
    m = report["miss"]
    lines.append(f"a miss (a document nobody holds): TTFT {statistics.median(m['connector_s']):.2f} s with the "
                 f"connector, {statistics.median(m['vllm_s']):.2f} s without: {m['cost']:+.1%} (median of per-document "
                 "ratios)")
    lines.append(f"what the model needs of the held prefix, in fp16: {report['needed_fp16_bytes'] / 1e6:.1f} MB")
    lines.append("floors: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in floors(report).items()))
    return "\n".join(lines)


__all__ = ["run", "table", "floors", "documents", "vllm_hosts", "TTFT_FLOOR"]
