"""`kvstreamd bench codec`: size, quality and speed of every scheme on real KV caches of the
real model, on the held-out split (test.txt) of each kind of text (`kvstreamd.lab.corpus`:
WikiText-2, licence texts, Python source), contexts taken from well-separated parts of the file.

Quality is measured by running continuation tokens on top of the decompressed cache and
comparing with the exact cache: perplexity, KL of next-token distributions, top-1 agreement;
and `prefix_kl`, what a prompt that ends at a chunk boundary inside the context sees (a context
is found by its prefix): the KL of the context's own `continuation` tokens after each boundary,
on the chunks before it, decoded (mean and worst over the boundaries and contexts).
Speeds are per core (one process, one thread) and with all cores (a CodecPool).
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

import codec
from codec import baselines, bitstream as bs, steps
from codec.tuning import rate, registry, token_steps
from codec.tuning.levels import LEVELS

from .. import models
from ..models import rate_probe, token_weight
from ..lab import corpus, quality
from . import profile_and_pool, write_json

# cachegen:LEVEL codes each chunk at the scale its own costs give it (codec.tuning.rate, as the daemon
# does for a put that brings them); cachegen:LEVEL/fixed at the level's one scale, as before.
SCHEMES = ["fp16", "int8", "kivi2", "zstd-fp16", "cachegen-paper", "cachegen:max", "cachegen:high", "cachegen:balanced",
           "cachegen:fast", "cachegen:high/fixed", "cachegen:balanced/fixed", "cachegen:fast/fixed"]
FIXED = "/fixed"


class _Ours:
    def __init__(self, level: str, profile, per_chunk: bool):
        self.level, self.profile, self.per_chunk = level, profile, per_chunk
        self.scales: list[float | None] = []  # the case's chunks' scales (rate control), set per case
        self.classes = None  # the case's token classes [L, T] (codec.tuning.token_steps), set per case

    def for_case(self, costs: list, weights) -> None:
        self.scales = rate.scales(self.level, self.profile, costs) if self.per_chunk else [None] * len(costs)
        self.classes = token_steps.classes_for(weights, self.profile)

    def chunk_classes(self, start: int, tokens: int):
        return None if self.classes is None else self.classes[:, start:start + tokens]

    def encode(self, kv, start, index):
        return codec.encode(kv, self.level, self.profile, start=start, scale=self.scales[index],
                            token_classes=self.chunk_classes(start, kv.shape[2]))

    def decode(self, data):
        return codec.decode(data, self.profile)


class _Baseline:
    def __init__(self, scheme):
        self.scheme = scheme

    def encode(self, kv, start, index):
        return self.scheme.encode(kv)

    def decode(self, data):
        return self.scheme.decode(data)


def _coder(name: str, profile):
    if name in baselines.SCHEMES:
        return _Baseline(baselines.SCHEMES[name])
    level = name.split(":", 1)[-1]
    return _Ours(level.removesuffix(FIXED), profile, not level.endswith(FIXED))


class _Case(NamedTuple):
    """One held-out context, measured on the exact cache."""
    kv: torch.Tensor  # fp16, as it is put
    cont: list[int]  # the continuation's tokens
    ref: torch.Tensor  # their exact logits
    costs: list  # each chunk's cost (rate_probe)
    probe_s: float  # seconds the probes took
    prefixes: list  # (a chunk boundary inside the context, the tokens after it, their exact logits)
    weights: object  # [L, T]: how much the probes read each token (models.token_weight)


def _cases(lm, kind: str, tokens: int, contexts: int, continuation: int, chunk_tokens: int, profile,
           log) -> list[_Case]:
    """Up to `contexts` held-out contexts of the kind (fewer when its test.txt holds fewer)."""
    length = tokens + continuation + 1
    n = min(contexts, corpus.fit(lm.tokenizer, "test", length, kind))
    if n < 1:
        raise ValueError(f"{kind} test.txt holds fewer than {length} tokens")
    if n < contexts:
        log(f"{kind} test.txt holds {n} contexts of {length} tokens, not {contexts}: measuring {n}")
    cases = []
    for i, w in enumerate(corpus.windows(lm.tokenizer, "test", n, length, kind=kind)):
        log(f"prefill {kind} test context {i + 1}/{n} ({tokens} tokens)")
        _, kv, weights = token_weight.weighed_prefill(lm, w[:tokens], all_logits=False)
        cont = w[tokens:]
        ref = models.continuation_logits(lm, kv, cont[:-1])
        prefixes = [(cut, w[cut:cut + continuation], models.continuation_logits(lm, kv[:, :, :cut], w[cut:cut + continuation]))
                    for cut in range(chunk_tokens, tokens, chunk_tokens) if cut + continuation <= tokens]
        kv = kv.to(torch.float16)
        t0 = time.perf_counter()
        costs = rate_probe.chunk_costs(lm, w[:tokens], kv, chunk_tokens, profile)
        cases.append(_Case(kv, cont, ref, costs, time.perf_counter() - t0, prefixes, weights))
    return cases


def _measure(lm, profile, pool, schemes: list[str], cases: list[_Case], chunk_tokens: int, log
             ) -> tuple[float, list[dict]]:
    """(exact-cache perplexity, one row per scheme) over one kind's cases."""
    exact_ppl = statistics.mean(quality.perplexity(c.ref, torch.tensor(c.cont[1:])) for c in cases)
    results = []
    for name in schemes:
        coder = _coder(name, profile)
        nbytes = elements = 0
        enc_rates, dec_rates, pool_enc, pool_dec = [], [], [], []
        ppls, kls, top1, chosen, prefix_kls, classes = [], [], [], [], [], []
        for kv, cont, ref, costs, _, prefixes, weights in cases:
            parts, encoded = [], []
            if isinstance(coder, _Ours):
                coder.for_case(costs, weights)
                chosen += [s / LEVELS[coder.level].scale_in(profile) for s in coder.scales if s is not None]
                if coder.classes is not None and token_steps.applies(coder.level, profile):
                    classes.append(coder.classes.ravel())
            for index, start in enumerate(range(0, kv.shape[2], chunk_tokens)):
                chunk = kv[:, :, start:start + chunk_tokens].contiguous()
                mb = chunk.numel() * 2 / 1e6
                threads = torch.get_num_threads()
                torch.set_num_threads(1)  # per-core figures
                try:
                    t0 = time.perf_counter()
                    data = coder.encode(chunk, start, index)
                    t1 = time.perf_counter()
                    dec = coder.decode(data)
                    t2 = time.perf_counter()
                finally:
                    torch.set_num_threads(threads)
                enc_rates.append(mb / (t1 - t0))
                dec_rates.append(mb / (t2 - t1))
                if not torch.isfinite(dec).all() or dec.shape != chunk.shape:
                    raise AssertionError(f"{name} decoded a wrong tensor")
                nbytes += len(data)
                elements += chunk.numel()
                parts.append(dec)
                encoded.append((chunk, start, data))
            if isinstance(coder, _Ours):
                # All cores: the whole context through the pool, as a fetch's stages see it.
                mb = sum(c.numel() for c, _, _ in encoded) * 2 / 1e6
                t0 = time.perf_counter()
                again = [pool.encode(c, coder.level, profile, start=s, scale=sc,
                                     token_classes=coder.chunk_classes(s, c.shape[2]))
                         for (c, s, _), sc in zip(encoded, coder.scales)]
                t1 = time.perf_counter()
                decoded = pool.decode_many(again, profile)
                t2 = time.perf_counter()
                if again != [d for _, _, d in encoded] or not all(torch.equal(a, b) for a, b in zip(decoded, parts)):
                    raise AssertionError(f"{name}: the pool's result differs from the single-process codec")
                pool_enc.append(mb / (t1 - t0))
                pool_dec.append(mb / (t2 - t1))
            decoded_kv = torch.cat(parts, 2)
            logits = models.continuation_logits(lm, decoded_kv, cont[:-1])
            prefix_kls += [quality.kl(exact, models.continuation_logits(lm, decoded_kv[:, :, :cut], ids))
                           for cut, ids, exact in prefixes]
            ppls.append(quality.perplexity(logits, torch.tensor(cont[1:])))
            kls.append(quality.kl(ref, logits))
            top1.append(quality.top1_agreement(ref, logits))
        bits = nbytes * 8 / elements
        ppl = statistics.mean(ppls)
        r = {"scheme": name, "bits_per_element": round(bits, 4), "ratio_vs_fp16": round(16 / bits, 3),
             "ratio_vs_int8": None,  # filled in once int8's size is known
             "ppl": round(ppl, 4), "ppl_delta_pct": round(100 * (ppl / exact_ppl - 1), 3),
             "top1_agreement": round(statistics.mean(top1), 4), "kl": round(statistics.mean(kls), 6),
             "prefix_kl": round(statistics.mean(prefix_kls), 6) if prefix_kls else None,
             "prefix_kl_max": round(max(prefix_kls), 6) if prefix_kls else None,
             "encode_MBps": round(statistics.median(enc_rates), 1),
             "decode_MBps": round(statistics.median(dec_rates), 1),
             "encode_MBps_all_cores": round(statistics.median(pool_enc), 1) if pool_enc else None,
             "decode_MBps_all_cores": round(statistics.median(pool_dec), 1) if pool_dec else None,
             # each chunk's scale over its level's one scale (rate control), over every case
             "chunk_scales": {"min": round(min(chosen), 3), "median": round(statistics.median(chosen), 3),
                              "max": round(max(chosen), 3)} if chosen else None,
             "token_steps": _class_spread(np.concatenate(classes)) if classes else None}
        results.append(r)
        log(f"  {name:18s} {bits:6.3f} bits/elem  x{16 / bits:5.2f}  dppl {r['ppl_delta_pct']:+.3f}%  "
            f"KL {r['kl']:.5f}  top1 {r['top1_agreement']:.4f}  dec {r['decode_MBps']} MB/s")
    int8_bits = next((r["bits_per_element"] for r in results if r["scheme"] == "int8"), None)
    for r in results:
        r["ratio_vs_int8"] = round(int8_bits / r["bits_per_element"], 3) if int8_bits else None
    return exact_ppl, results


def _class_spread(classes) -> dict:
    """What per-token steps did to a scheme's tokens (codec.tuning.token_steps): the share of
    (layer, token)s in each class and the mean multiplier on their steps."""
    share = np.bincount(classes, minlength=bs.TOP_CLASS + 1) / classes.size
    return {"class_share": [round(float(x), 4) for x in share],
            "mean_multiplier": round(float(steps.multipliers(classes).mean()), 3)}


def run(tokens: int = 3072, contexts: int = 3, continuation: int = 256, chunk_tokens: int = 1024,
        schemes: list[str] | None = None, json_path: str | None = None, plot_path: str | None = None,
        texts: list[str] | None = None, log=print, model: str | None = None,
        profile: str | Path | None = None) -> dict:
    """Every scheme on the held-out split (test.txt) of each kind of text (default: all kinds,
    WikiText first), coded with the model's profile (`profile`: a profile file, else the
    registry's choice). The report's top-level `exact_ppl` and `results` are the first kind's (as
    before kinds existed); `texts` has every kind's."""
    schemes = schemes or SCHEMES
    texts = list(dict.fromkeys(texts or corpus.KINDS))
    for kind in texts:
        corpus.get(kind)
    lm = models.load(model)
    per_text = {}
    workers = os.cpu_count() or 1
    prof, pool = profile_and_pool(lm.model_id, profile, workers)
    used = {"id": prof.id.hex(), "path": str(prof.path) if prof.path else None, "source": registry.source(prof)}
    log(f"coding with the {used['source']} profile {used['id']} ({used['path']})")
    with pool:
        for kind in texts:
            cases = _cases(lm, kind, tokens, contexts, continuation, chunk_tokens, prof, log)
            log(f"{kind}: {corpus.get(kind).title}")
            exact_ppl, results = _measure(lm, prof, pool, schemes, cases, chunk_tokens, log)
            per_text[kind] = {"title": corpus.get(kind).title, "split": "test", "contexts": len(cases),
                              "exact_ppl": round(exact_ppl, 4), "results": results,
                              "probe_s": round(statistics.median(c.probe_s for c in cases), 3)}
    first = per_text[texts[0]]
    report = {"model": lm.model_id, "tokens": tokens, "contexts": contexts, "continuation": continuation,
              "chunk_tokens": chunk_tokens, "workers": workers, "text": texts[0],
              "profile": used,
              "exact_ppl": first["exact_ppl"], "results": first["results"], "texts": per_text}
    write_json(report, json_path)
    if plot_path:
        plot(report, plot_path)
    return report


def table(report: dict, kind: str | None = None) -> str:
    """Every scheme's row on one kind of text (default: the report's first)."""
    results = report["texts"][kind]["results"] if kind else report["results"]
    head = ("| scheme | bits/elem | x fp16 | x int8 | ppl | Δppl | top-1 | KL | prefix KL (worst) | enc MB/s/core "
            "| dec MB/s/core | enc MB/s all cores | dec MB/s all cores |")
    rows = [head, "|" + "---|" * 13]
    for r in results:
        x_int8 = f"{r['ratio_vs_int8']:.2f}" if r["ratio_vs_int8"] else "-"
        prefix = f"{r['prefix_kl']:.5f} ({r['prefix_kl_max']:.5f})" if r.get("prefix_kl") is not None else "-"
        rows.append(f"| {r['scheme']} | {r['bits_per_element']:.3f} | {r['ratio_vs_fp16']:.2f} | "
                    f"{x_int8} | {r['ppl']:.3f} | {r['ppl_delta_pct']:+.2f}% | "
                    f"{r['top1_agreement']:.4f} | {r['kl']:.5f} | {prefix} | {r['encode_MBps']:.0f} | {r['decode_MBps']:.0f} | "
                    f"{r['encode_MBps_all_cores'] or '-'} | {r['decode_MBps_all_cores'] or '-'} |")
    return "\n".join(rows)


def texts_table(report: dict) -> str:
    """Each scheme's KL, Δppl and size on each kind of text, side by side."""
    kinds = list(report["texts"])
    rows = ["| scheme | " + " | ".join(f"{k}: KL | Δppl | x fp16" for k in kinds) + " |",
            "|---|" + "---|---|---|" * len(kinds)]
    for i, r in enumerate(report["results"]):
        cells = []
        for k in kinds:
            s = report["texts"][k]["results"][i]
            cells.append(f"{s['kl']:.5f} | {s['ppl_delta_pct']:+.2f}% | {s['ratio_vs_fp16']:.2f}")
        rows.append(f"| {r['scheme']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    first = report.get("text", "wikitext")
    texts = report.get("texts") or {first: {"results": report["results"]}}  # a report from before kinds
    for i, r in enumerate(report["results"]):
        if r["scheme"].startswith("cachegen:"):
            continue  # drawn per kind of text below
        kl = max(r["kl"], 1e-6)  # lossless schemes sit on the floor of the log axis
        ax.scatter(r["bits_per_element"], kl, marker="s", s=50, color="tab:gray")
        label = r["scheme"] + (" (lossless)" if r["kl"] < 1e-6 else "")
        ax.annotate(label, (r["bits_per_element"], kl), textcoords="offset points",
                    xytext=(-40 if i % 2 else 5, 10 if i % 2 else 4), fontsize=8)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for j, (kind, t) in enumerate(texts.items()):
        ours = sorted((r for r in t["results"] if r["scheme"].startswith("cachegen:")),
                      key=lambda r: r["bits_per_element"])
        color = colors[j % len(colors)]
        xs, ys = [r["bits_per_element"] for r in ours], [max(r["kl"], 1e-6) for r in ours]
        ax.plot(xs, ys, color=color, lw=1, marker="o", label=f"kvstreamd levels, {kind}")
        if kind == first:
            for r in ours:
                ax.annotate(r["scheme"], (r["bits_per_element"], max(r["kl"], 1e-6)), textcoords="offset points",
                            xytext=(5, 4), fontsize=8)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bits per KV element (everything the bitstream carries)")
    ax.set_ylabel("KL divergence vs exact cache (next token)")
    kinds = ", ".join(texts)
    ax.set_title(f"{report['model']}: rate vs quality\n{report['contexts']} x {report['tokens']} tokens, "
                 f"test splits of {kinds}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
