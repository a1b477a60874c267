"""End to end, as a user meets it (`make demo`, `kvstreamd demo`, `kvstreamd bench e2e`): two
daemons as two hosts -- two network namespaces joined by a veth pair shaped to a bandwidth when
run as root, plain loopback (unshaped, said so) otherwise. Host a prefills a long WikiText-2
document with the real model and stores its KV through the local API; on host b a prompt that
starts with the document arrives, and the model answers it four ways, TTFT measured the same way
for each (from the prompt's arrival to the first generated token, `models.prefix.generate`):

- recompute: prefill the whole prompt on b (in blocks, as models.adapter runs every prefill:
  a long prompt's attention masks and logits stay bounded), TTFT at the first greedy token;
- fp16 / int8: fetch the prefix's KV at exactly that level through the daemons;
- kvstreamd: fetch it with the adaptive per-chunk level choice under the deadline.

Quality, off the clock: Δperplexity of the document's continuation on the KV each method ended
with, against the exact cache, and whether the generated tokens equal the recompute ones."""
from __future__ import annotations

import os
import statistics
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from codec.tuning.levels import LADDER

from .. import models
from ..limits import MAX_DEADLINE_MS
from ..lab import corpus, netns, quality
from ..lab.daemons import DaemonProcess, wait_for
from ..models.prefix import generate
from ..models.put import put_context
from . import profile_keys, write_json

METHODS = ["recompute", "fp16", "int8", "kvstreamd"]
# kvstreamd's own levels for kvstreamd (the hosts also store the baselines, to fetch those)
FETCH_LEVELS = {"fp16": ["fp16"], "int8": ["int8"], "kvstreamd": [*LADDER, "int8"]}
BASELINES = ("fp16", "int8")
# The fixed-level baselines move the whole context whatever it takes: their fetch gets a deadline
# no transfer here reaches (a fetch gives up on chunks not there by its deadline plus grace).
BASELINE_DEADLINE_MS = MAX_DEADLINE_MS
STORED_LEVELS = ["high", "balanced", "fast", "int8", "fp16"]
# Chunks of 256 tokens: the unit a plan splits a context at, so the finer the chunks, the nearer
# the head computed here (TEXT) and the tail streamed meet at the point where both take as long
# (20 Mbit/s, 4096 tokens, 3 fetches each: TTFT 3.57-4.20 s at 256, 3.68-4.80 at 512, 4.22-4.69 at
# 1024; docs/benchmarks.md "The slow end"). The vLLM bench uses the same size.
CHUNK_TOKENS = 256
CONTINUATION = 256  # tokens of the document's continuation that Δppl is measured on
GENERATE = 8  # tokens generated per answer (the first is what TTFT waits for)
# The untimed fetch before anything is measured (warm_up): its context, and a link it decodes on
WARM_UP_TOKENS = 2048
WARM_UP_MBIT = 1000.0
DEADLINE_MS_PER_1K = 500  # the default SLO: half a second per 1024 tokens of context (2 s for 4096)


def deadline_for(tokens: int) -> int:
    """The default deadline of a fetch of a `tokens`-token context, in ms (DEADLINE_MS_PER_1K)."""
    return round(DEADLINE_MS_PER_1K * tokens / 1024)


@dataclass
class Hosts:
    a: DaemonProcess
    b: DaemonProcess
    link: netns.Link | None

    @property
    def shaped(self) -> bool:
        return self.link is not None

    def shape(self, mbit: float) -> None:
        if self.link is not None:
            self.link.shape(mbit)


@contextmanager
def hosts(root: Path, chunk_tokens: int = CHUNK_TOKENS, workers: int = 0, b_keeps_fetched: bool = True,
          codec: dict | None = None, memory_budget: str = "2GiB"):
    """Two daemons, a and b, peers of each other; in two namespaces if it can make them.
    `b_keeps_fetched=False`: b stores nothing it fetched, so every fetch of a's context crosses the link.
    `codec`: more [codec] keys (profile_keys); `memory_budget`: each store's ([store]). The hosts are handed over once their codec tables
    are built ([codec] warm_tables = "start"), as a daemon that has run a while has them: a first
    fetch's builds (~12 CPU-seconds, measured apart in docs/benchmarks.md) would otherwise share
    this machine's two cores with the model process's compute in whatever is measured first."""
    ok, why = netns.available()
    link = netns.Link().up() if ok else None
    extra = {"codec": {"chunk_tokens": chunk_tokens, "levels": STORED_LEVELS, "workers": workers,
                       "warm_tables": "start", **(codec or {})},
             "store": {"memory_budget": memory_budget, "disk_budget": 0}}
    extra_b = {**extra, "store": {**extra["store"], "keep_fetched": b_keeps_fetched}}
    if link is not None:
        a = DaemonProcess("host-a", root / "a", host=link.addr["a"], netns=link.command("a", []), extra=extra)
        b = DaemonProcess("host-b", root / "b", host=link.addr["b"], netns=link.command("b", []), extra=extra_b)
    else:
        a = DaemonProcess("host-a", root / "a", extra=extra)
        b = DaemonProcess("host-b", root / "b", extra=extra_b)
    a.peers, b.peers = [b.addr], [a.addr]
    try:
        a.start(wait=0)
        b.start(wait=0)
        a.wait_healthy()
        b.wait_healthy()
        wait_for(lambda: b.client().status()["peers_connected"], timeout=30, what="the hosts to connect")
        wait_for(lambda: not any(n.client().status()["codec"]["tables_warming"] for n in (a, b)), timeout=300,
                 what="the hosts' codec tables")
        yield Hosts(a, b, link), (None if ok else why)
    finally:
        for n in (a, b):
            n.stop()
        if link is not None:
            link.down()


@contextmanager
def trace_shaper(h: Hosts, trace: list[float] | None, step_s: float):
    """Reshape the link to trace[k] Mbit/s at step k of step_s seconds, cycling, while the block runs."""
    if not trace or h.link is None:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        k = 0
        while not stop.is_set():
            h.shape(trace[k % len(trace)])
            k += 1
            stop.wait(step_s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _bar(progress: bool, total: int, desc: str, unit: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, leave=False)


def _prefill_with_progress(lm, tokens: list[int], progress: bool, step: int, timed: list[tuple[int, int, float]]
                           ) -> tuple[torch.Tensor, float, float | None]:
    """Host a's prefill, `step` tokens at a time on one running cache (as host b computes a TEXT
    head) so a bar can follow it; returns (KV, and what the steps' times say of the model's
    prefill: the tokens/s at the start of a prompt and the position where a token costs twice
    that, prefill_rate). The two are what the model process tells its daemon
    (recompute_tokens_per_s, recompute_doubling_tokens), so that senders price a TEXT chunk by
    where it lies (transport.policy.text_seconds). They are fitted to every step this process
    has timed (`timed`, extended here), as a model process that has run a while knows its rate:
    one document's 16 steps of 256 tokens fitted 570-805 tokens/s doubling at 1616-2520 tokens
    across three documents, and the fit that said 805/1616 priced TEXT out of a 20 Mbit/s fetch."""
    with _bar(progress, len(tokens), "host a: prefill", "tok") as bar:
        kv, steps = models.prefill_timed(lm, tokens, step, bar.update)
    timed.extend(steps)
    return (kv, *prefill_rate(timed))


def prefill_rate(steps: list[tuple[int, int, float]]) -> tuple[float, float | None]:
    """(tokens/s at the start of a prompt, the position where a token costs twice that) fitted
    to prefill steps (start, tokens, seconds): a step's seconds per token grow in a line with
    the position of its middle (attention reads every token before it). SmolLM2 on this
    machine's two cores: ~550 tokens/s, doubling at ~5000 tokens. One step, or a fit that does
    not grow: the mean rate, and None."""
    mids = np.array([s + (n - 1) / 2 for s, n, _ in steps])
    per_token = np.array([t / n for _, n, t in steps])
    if len(steps) < 2:
        return float(1 / per_token.mean()), None
    slope, at_start = np.polyfit(mids, per_token, 1)
    if slope <= 0 or at_start <= 0:
        return float(1 / per_token.mean()), None
    return float(1 / at_start), float(at_start / slope)


def _quality(lm, kv, doc: list[int], cont: list[int], ref_ppl: float) -> float:
    """Δppl % of the document's continuation on this KV (a PrefixKV) of a prefix of `doc`: the
    rest of the document, if any, runs with the continuation."""
    found = 0 if kv is None else kv.tokens
    logits = models.continuation_logits(lm, kv, doc[found:] + cont[:-1])[len(doc) - found:]
    return (quality.perplexity(logits, torch.tensor(cont[1:])) / ref_ppl - 1) * 100


def _per_chunk(reuse) -> list[dict]:
    """Each chunk's level, kind and bytes, when the daemon had it (`arrived_ms`, `ready_ms`: its
    clock, from its fetch's start) and when the model process read its event (`seen_ms`: from
    the request), and the rate its bytes were seen at."""
    out, prev = [], 0.0
    for e, seen in zip(reuse.events, reuse.seen_s):
        arrived = e.arrived_ms or e.t_ms
        dt = max(arrived - prev, 1e-3)
        out.append({"i": e.i, "level": e.level, "kind": e.kind, "bytes": e.bytes, "arrived_ms": arrived,
                    "ready_ms": e.t_ms, "seen_ms": round(seen * 1000, 1), "seen_mbit": round(e.bytes * 8 / 1e6 / (dt / 1000), 2) if e.kind == "kv" else None})
        prev = arrived
    return out


def one_context(lm, h: Hosts, doc: list[int], cont: list[int], bandwidths: list[float], deadline_ms: int,
                methods: list[str], trace: list[float] | None, trace_step_s: float, progress: bool,
                log=print, chunk_tokens: int = CHUNK_TOKENS, timed: list | None = None) -> list[dict]:
    """Store one document on host a, then answer the prompt on host b by every method at every
    bandwidth. Recompute does not touch the link: it is measured once and reported at each.
    `timed`: the prefill steps timed before (extended with this document's)."""
    timed = [] if timed is None else timed
    question = lm.tokenizer.encode(lm.spec.turn_close)
    prompt = doc + question
    kv_exact, prefill_tps, doubling = _prefill_with_progress(lm, doc, progress, chunk_tokens, timed)
    ref_ppl = quality.perplexity(models.continuation_logits(lm, kv_exact, cont[:-1]), torch.tensor(cont[1:]))
    put = put_context(lm, h.a.client(), doc, kv_exact)
    wait_for(lambda: h.b.client().lookup(lm.model_id, prompt)["found_tokens"] == len(doc), timeout=30,
             what="host b to see host a's chunks")
    del kv_exact
    client = h.b.client()
    rows, quality_cache = [], {}
    reference = None
    if "recompute" in methods:
        # Recompute is host b's own prefill of the whole prompt, in blocks (models.adapter: what
        # bounds a long prompt's masks and logits), then greedy decoding: TTFT is the first token.
        timings: dict = {}
        ref_tokens = models.generate_greedy(lm, None, prompt, GENERATE, timings=timings)
        reference = ref_tokens
        rec = {"method": "recompute", "ttft_s": timings["first_token_s"], "dppl_pct": 0.0, "tokens_match": True,
               "first_token_match": True, "bytes": 0,
               "levels": [], "found_tokens": 0, "text_tokens": 0, "generated": ref_tokens}
        log(f"  recompute: TTFT {timings['first_token_s']:.2f} s")
    else:
        reference = models.generate_greedy(lm, None, prompt, GENERATE)
    for bw in bandwidths:
        h.shape(bw)
        if "recompute" in methods:
            rows.append({**rec, "bandwidth_mbit": bw})
        for method in [m for m in methods if m != "recompute"]:
            with _bar(progress, (len(doc) + chunk_tokens - 1) // chunk_tokens, f"host b: {method} fetch", "chunk") as bar, \
                    trace_shaper(h, trace, trace_step_s):
                new, reuse = generate(lm.model, prompt, client, lm.model_id, max_new_tokens=GENERATE,
                                      deadline_ms=BASELINE_DEADLINE_MS if method in BASELINES else deadline_ms,
                                      levels=FETCH_LEVELS[method],
                                      recompute_tokens_per_s=prefill_tps, recompute_doubling_tokens=doubling,
                                      on_chunk=lambda _e: bar.update(1),
                                      keep_kv=True)
            # the KV this method ended with, for quality (decoding is deterministic: same levels, same KV)
            key = tuple(reuse.levels)
            if key not in quality_cache:
                quality_cache[key] = _quality(lm, reuse.kv, doc, cont, ref_ppl)
            reuse.kv = None
            rows.append({"method": method, "bandwidth_mbit": bw, "ttft_s": reuse.ttft_s,
                         "dppl_pct": quality_cache[key], "tokens_match": new == reference,
                         "first_token_match": new[:1] == reference[:1], "bytes": reuse.bytes,
                         "levels": reuse.levels, "found_tokens": reuse.found_tokens, "text_tokens": reuse.text_tokens,
                         "fetch_s": reuse.fetch_s, "recompute_s": reuse.recompute_s,
                         "recompute_after_s": reuse.recompute_after_s, "text_blocks": reuse.text_blocks,
                         "cache_s": reuse.cache_s, "generated": new,
                         "recompute_tokens_per_s": prefill_tps, "recompute_doubling_tokens": doubling,
                         "recompute_tokens_per_s_told": reuse.recompute_tokens_per_s_told,
                         "deadline_missed": reuse.end.deadline_missed if reuse.end else None,
                         "stage_s": reuse.end.timings if reuse.end else None,  # the daemon's: total, receive, decode, fill
                         "end_seen_s": reuse.end_seen_s,  # when the model process read the end event
                         "chunks": _per_chunk(reuse)})
            log(f"  {bw:g} Mbit/s {method}: TTFT {reuse.ttft_s:.2f} s, {reuse.bytes / 1e6:.1f} MB, "
                f"levels {','.join(reuse.levels)}, Δppl {quality_cache[key]:+.2f}%, tokens match {new == reference}")
    h.a.client().delete_context(put["keys"][-1])
    # What the model needs of the prefix: every token of its full-attention layers, the last
    # window of its sliding ones (whole chunks of it); fp16 of that is the raw-KV floor.
    needed = lm.layout.token_layers(len(doc), chunk_tokens)
    for r in rows:
        r.update(tokens=len(doc), prompt_tokens=len(prompt), reference=reference, needed_token_layers=needed,
                 needed_fp16_bytes=needed * 2 * lm.num_kv_heads * lm.head_dim * 2,
                 all_token_layers=lm.num_layers * len(doc))
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Median TTFT per (method, bandwidth, tokens) over runs; Δppl as the mean and the worst run
    (the floor holds in every run); tokens_match as the share of runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["bandwidth_mbit"], r["tokens"]), []).append(r)
    out = []
    for (method, bw, tokens), rs in groups.items():
        out.append({"method": method, "bandwidth_mbit": bw, "tokens": tokens,
                    "ttft_s": round(statistics.median(r["ttft_s"] for r in rs), 3),
                    "dppl_pct": round(statistics.mean(r["dppl_pct"] for r in rs), 3),
                    "dppl_max_pct": round(max(r["dppl_pct"] for r in rs), 3),
                    "tokens_match": round(sum(r["tokens_match"] for r in rs) / len(rs), 3),
                    "first_token_match": round(sum(r["first_token_match"] for r in rs) / len(rs), 3),
                    "runs": len(rs), "bytes": int(statistics.median(r["bytes"] for r in rs)),
                    "needed_token_layers": rs[0]["needed_token_layers"], "all_token_layers": rs[0]["all_token_layers"],
                    "needed_fp16_bytes": rs[0]["needed_fp16_bytes"],
                    "ttft_runs_s": [round(r["ttft_s"], 3) for r in rs]})
    return out


def warm_up(lm, h: Hosts, chunk_tokens: int, timed: list) -> None:
    """One untimed fetch of WARM_UP_TOKENS of valid.txt (a split no run measures on), as
    kvstreamd fetches, on a link fast enough to decode chunks rather than recompute them, before
    anything is measured. Host b then plans with the decode rate it measures in a fetch, as a
    daemon that has run a while does, not its prior: on this machine, whose two cores also run
    host a, the prior is 1.7x what a fetch gets (224 against 132 MB/s), and the first fetch at
    1000 Mbit/s took 10 of 16 chunks at `high` where 5 keep the wire and the decoder both busy
    (1.05 s against 0.67-0.71 s). Its prefill's steps join `timed`, the steps the prefill rate
    is fitted to."""
    doc = corpus.windows(lm.tokenizer, "valid", 1, WARM_UP_TOKENS)[0]
    kv, _, _ = _prefill_with_progress(lm, doc, False, chunk_tokens, timed)
    put = put_context(lm, h.a.client(), doc, kv, measure=False)
    wait_for(lambda: h.b.client().lookup(lm.model_id, doc)["found_tokens"] == len(doc), timeout=30,
             what="host b to see the warm-up context")
    h.shape(WARM_UP_MBIT)
    generate(lm.model, doc + lm.tokenizer.encode(lm.spec.turn_close), h.b.client(), lm.model_id, max_new_tokens=1,
             deadline_ms=deadline_for(len(doc)), levels=FETCH_LEVELS["kvstreamd"])
    h.a.client().delete_context(put["keys"][-1])


def run(bandwidths: list[float], token_counts: list[int], runs: int = 1, deadline_ms: int | None = None,
        methods: list[str] | None = None, trace: list[float] | None = None, trace_step_s: float = 0.5,
        json_path: str | None = None, plot_path: str | None = None, progress: bool = True, log=print,
        chunk_tokens: int | None = None, model: str | None = None, profile: str | None = None) -> dict:
    methods = methods or METHODS
    chunk_tokens = chunk_tokens or CHUNK_TOKENS
    torch.set_num_threads(os.cpu_count() or 1)
    lm = models.load(model)
    codec = profile_keys(lm.model_id, profile)
    rows: list[dict] = []
    # the model's first forward in a process is slow (kernels, allocator): not one whose time
    # prices TEXT (prefill_rate)
    models.prefill(lm, lm.tokenizer.encode(lm.spec.turn_close) * 32, all_logits=False)
    with tempfile.TemporaryDirectory(prefix="kvstreamd-e2e-") as tmp, \
            hosts(Path(tmp), chunk_tokens, b_keeps_fetched=False, codec=codec) as (h, why_not):
        if why_not:
            log(f"NOTE: no network namespaces here ({why_not}): the two hosts talk over plain loopback, "
                "unshaped, so --bandwidth has no effect")
        timed: list[tuple[int, int, float]] = []  # every prefill step timed, for the rate (_prefill_with_progress)
        warm_up(lm, h, chunk_tokens, timed)
        for tokens in token_counts:
            question = len(lm.tokenizer.encode(lm.spec.turn_close))
            head = lm.tokenizer.document(lm.spec.turn_open)  # (BOS first, for a model that needs one)
            # The stored context, head included. It leaves room for the prompt's question and answer,
            # and for the continuation Δppl is scored on: at SmolLM2's 8192 positions a full-length
            # document left 26 tokens to score, and three documents with `balanced` tails scored
            # -4.25% to +2.02% on them.
            doc_len = min(tokens, lm.max_positions - max(question + GENERATE, CONTINUATION + 1))
            cont_len = CONTINUATION
            text_len = doc_len - len(head)
            for r, w in enumerate(corpus.windows(lm.tokenizer, "test", runs, text_len + cont_len + 1)):
                log(f"{tokens} tokens, run {r + 1}/{runs}: a user turn opening with {text_len} tokens of test.txt")
                deadline = deadline_ms or deadline_for(doc_len)
                new = one_context(lm, h, head + w[:text_len], w[text_len:], bandwidths, deadline, methods, trace,
                                  trace_step_s, progress, log, chunk_tokens, timed)
                for row in new:
                    row.update(run=r, tokens=tokens, doc_tokens=doc_len, deadline_ms=deadline)
                rows += new
        report = {"model": lm.model_id, "shaped": h.shaped, "trace": trace,
                  "deadline_ms": deadline_ms or f"{DEADLINE_MS_PER_1K} per 1024 tokens", "chunk_tokens": chunk_tokens,
                  "question": lm.spec.turn_close, "generate": GENERATE, "results": summarise(rows), "runs": rows}
    write_json(report, json_path)
    if plot_path:
        plot(report, plot_path)
    report["answer"] = lm.tokenizer.decode(next((r["generated"] for r in rows if r["method"] == "kvstreamd"), []))
    return report


def table(report: dict) -> str:
    res = report["results"]
    best = {}
    for r in res:
        k = (r["bandwidth_mbit"], r["tokens"])
        if r["method"] in ("recompute", "fp16"):
            best[k] = min(best.get(k, float("inf")), r["ttft_s"])
    lines = [f"{'Mbit/s':>7} {'tokens':>6} {'method':10} {'TTFT s':>7} {'speed-up':>9} {'MB moved':>9} "
             f"{'Δppl %':>7} {'worst':>7} {'8 tokens match':>14} {'1st token':>9}"]
    for r in sorted(res, key=lambda r: (r["tokens"], r["bandwidth_mbit"], METHODS.index(r["method"]))):
        k = (r["bandwidth_mbit"], r["tokens"])
        speed = f"{best[k] / r['ttft_s']:.2f}x" if k in best and r["method"] == "kvstreamd" else ""
        lines.append(f"{r['bandwidth_mbit']:>7g} {r['tokens']:>6} {r['method']:10} {r['ttft_s']:>7.2f} {speed:>9} "
                     f"{r['bytes'] / 1e6:>9.1f} {r['dppl_pct']:>+7.2f} {r['dppl_max_pct']:>+7.2f} "
                     f"{r['tokens_match'] * 100:>13.0f}% "
                     f"{r['first_token_match'] * 100:>8.0f}%")
    lines.append("speed-up: the best of recompute and fp16 over kvstreamd's TTFT; Δppl: the mean over runs, worst: "
                 "the worst run's; match: share of runs whose greedy "
                 f"tokens (all {GENERATE}, or the first) equal those of the exact cache")
    return "\n".join(lines)


def levels_line(report: dict) -> str:
    out = []
    for r in report["runs"]:
        if r["method"] == "kvstreamd":
            out.append(f"{r['bandwidth_mbit']:g} Mbit/s, {r['tokens']} tokens: " + " ".join(r["levels"]))
    return "\n".join(out)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fp16": "#888888", "int8": "#bbbbbb", "high": "#1b7837", "balanced": "#5aae61", "fast": "#a6dba0",
              "text": "#d6604d"}
    kvs = [r for r in report["runs"] if r["method"] == "kvstreamd"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if kvs:
        r = kvs[0]
        chunks = r["chunks"]
        xs = [c["i"] for c in chunks]
        ax1.bar(xs, [c["bytes"] / 1e6 for c in chunks], color=[colors.get(c["level"], "k") for c in chunks])
        ax1.set_xlabel("chunk")
        ax1.set_ylabel("MB sent (bar colour: level chosen)")
        ax1b = ax1.twinx()
        ax1b.plot(xs, [c["seen_mbit"] or 0 for c in chunks], "o-", color="#2166ac", label="bandwidth seen")
        if report["shaped"] and not report.get("trace"):
            ax1b.axhline(r["bandwidth_mbit"], ls="--", color="#2166ac", alpha=0.5, label="link rate (tbf)")
        ax1b.set_ylabel("Mbit/s seen by host b")
        ax1b.set_ylim(bottom=0, top=max([c["seen_mbit"] or 0 for c in chunks] + [r["bandwidth_mbit"]]) * 1.25)
        ax1b.legend(loc="upper right", fontsize=8)
        ax1.set_xticks(xs)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[lv]) for lv in colors if any(c["level"] == lv for c in chunks)]
        ax1.legend(handles, [lv for lv in colors if any(c["level"] == lv for c in chunks)], loc="upper left", fontsize=8)
        ax1.set_ylim(top=max(c["bytes"] for c in chunks) / 1e6 * 1.25)
        ax1.set_title(f"kvstreamd at {r['bandwidth_mbit']:g} Mbit/s, {r['tokens']} tokens")
    if len({x["bandwidth_mbit"] for x in report["results"]}) > 1:
        _ttft_by_bandwidth(ax2, report)
    else:
        _ttft_bars(ax2, report, kvs)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


METHOD_COLORS = {"recompute": "#d6604d", "fp16": "#888888", "int8": "#bbbbbb", "kvstreamd": "#1b7837"}


def _ttft_by_bandwidth(ax, report: dict) -> None:
    """The grid: each method's median TTFT against the link's rate, one line per context length
    (recompute does not use the link: a flat line)."""
    counts = sorted({x["tokens"] for x in report["results"]})
    styles = ["o-", "s--", "^:", "d-."]
    for method in METHODS:
        for k, tokens in enumerate(counts):
            pts = sorted((x["bandwidth_mbit"], x["ttft_s"]) for x in report["results"]
                         if x["method"] == method and x["tokens"] == tokens)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[k % len(styles)], color=METHOD_COLORS[method],
                        label=f"{method}, {tokens} tokens")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate, Mbit/s (tbf)" if report["shaped"] else "link rate asked, Mbit/s (loopback: unshaped)")
    ax.set_ylabel("time to first token on host b, s (median)")
    ax.set_title("TTFT against bandwidth, every method")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _ttft_bars(ax2, report: dict, kvs: list[dict]) -> None:
    """One bandwidth: each method's TTFT at the length of the first kvstreamd run."""
    res = [x for x in report["results"] if kvs and x["bandwidth_mbit"] == kvs[0]["bandwidth_mbit"]
           and x["tokens"] == kvs[0]["tokens"]] or report["results"]
    res = sorted(res, key=lambda x: METHODS.index(x["method"]))
    ax2.bar([x["method"] for x in res], [x["ttft_s"] for x in res], color=[METHOD_COLORS[x["method"]] for x in res])
    for i, x in enumerate(res):
        ax2.text(i, x["ttft_s"], f"{x['ttft_s']:.2f} s", ha="center", va="bottom", fontsize=9)
    ax2.set_ylabel("time to first token, s")
    ax2.set_title("TTFT on host b" + ("" if report["shaped"] else " (loopback, unshaped)"))


__all__ = ["run", "table", "plot", "levels_line"]
