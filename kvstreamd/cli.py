"""The `kvstreamd` command: run the daemon, talk to a running one over its Unix socket
(status, contexts, peers, put, fetch), benchmarks and profile calibration."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _report(text: str, json_path: str | None) -> None:
    """A benchmark's table, and where its JSON went."""
    print()
    print(text)
    if json_path:
        print(f"\nJSON written to {json_path}")


def _bench_codec(args: argparse.Namespace) -> int:
    from .bench import codec as bench

    report = bench.run(tokens=args.tokens, contexts=args.contexts, continuation=args.continuation,
                       chunk_tokens=args.chunk_tokens, schemes=args.schemes, json_path=args.json,
                       plot_path=args.plot, texts=args.texts, model=args.model)
    for kind, t in report["texts"].items():
        print()
        print(f"{report['model']}: {t['contexts']} x {report['tokens']}-token {kind} test contexts ({t['title']}), "
              f"{report['continuation']} continuation tokens, exact-cache ppl {t['exact_ppl']:.3f}")
        print(bench.table(report, kind))
    if len(report["texts"]) > 1:
        print("\nEach scheme on each kind of text (test splits):")
        print(bench.texts_table(report))
    if args.json:
        print(f"\nJSON written to {args.json}")
    return 0


def _bench_stream(args: argparse.Namespace) -> int:
    from .bench import stream as bench

    bandwidths = [float(b.lower().removesuffix("mbit")) for b in args.bandwidth]
    report = bench.run(bandwidths, tokens=args.tokens, runs=args.runs, deadline_ms=args.deadline_ms,
                       trace_file=args.trace, n_traces=args.traces, methods=args.methods, json_path=args.json,
                       model=args.model)
    print()
    print(f"{report['tokens']}-token context, deadline {report['deadline_ms']} ms")
    print(bench.table(report))
    if args.json:
        print(f"\nJSON written to {args.json}")
    return 0


def _bench_tls(args: argparse.Namespace) -> int:
    from .bench import tls as bench

    report = bench.run(_mbits([args.bandwidth])[0], runs=args.runs, mib=args.mib, chunk_mib=args.chunk_mib,
                       json_path=args.json)
    _report(bench.summary(report), args.json)
    return 0


def _bench_window(args: argparse.Namespace) -> int:
    from .bench import window as bench

    report = bench.run(_mbits([args.bandwidth])[0], delay_ms=args.delay_ms, chunks=args.chunks,
                       chunk_mib=args.chunk_mib, runs=args.runs, json_path=args.json)
    _report(bench.summary(report), args.json)
    return 0


def _mbits(values: list[str]) -> list[float]:
    return [float(b.lower().removesuffix("mbit")) for b in values]


def _trace(path: str | None) -> list[float] | None:
    return [float(x) for x in Path(path).read_text().split()] if path else None


def _demo(args: argparse.Namespace) -> int:
    from .bench import e2e

    report = e2e.run(_mbits([args.bandwidth]), [args.tokens], runs=1, deadline_ms=args.deadline_ms,
                     trace=_trace(args.trace), trace_step_s=args.trace_step_ms / 1000, json_path=args.json,
                     plot_path=args.plot, progress=not args.quiet, chunk_tokens=args.chunk_tokens, model=args.model)
    print()
    print(f"{report['model']}, document of {report['runs'][0]['doc_tokens']} WikiText-2 tokens stored on host a, "
          f"prompt = document + question on host b, deadline {report['runs'][0]['deadline_ms']} ms"
          + ("" if report["shaped"] else "  [loopback: not shaped]"))
    print(e2e.table(report))
    print("\nlevels kvstreamd chose per chunk:", e2e.levels_line(report))
    print(f"host b's answer (kvstreamd): {report['answer']!r}")
    print(f"\nplot: {args.plot}   JSON: {args.json}")
    return 0


def _bench_e2e(args: argparse.Namespace) -> int:
    from .bench import e2e

    report = e2e.run(_mbits(args.bandwidth), args.tokens, runs=args.runs, deadline_ms=args.deadline_ms,
                     methods=args.methods, trace=_trace(args.trace), trace_step_s=args.trace_step_ms / 1000,
                     json_path=args.json, plot_path=args.plot, progress=not args.quiet, model=args.model,
                     chunk_tokens=args.chunk_tokens)
    print()
    print(e2e.table(report))
    print(f"\nJSON written to {args.json}")
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from .bench import gpu as bench

    report = bench.run(layers=args.layers, heads=args.heads, head_dim=args.head_dim, tokens=args.tokens,
                       chunk_tokens=args.chunk_tokens, level=args.level, device=args.device, reps=args.reps,
                       json_path=args.json, fit_tokens=args.fit_tokens, workers=args.workers,
                       progress=not args.quiet)
    _report(bench.summary(report), args.json)
    return 0


def _bench_fanout(args: argparse.Namespace) -> int:
    from .bench import fanout as bench

    report = bench.run(tokens=args.tokens, bandwidth_mbit=args.bandwidth, runs=args.runs, level=args.level,
                       holders=args.holders, model=args.model, json_path=args.json)
    _report(bench.table(report), args.json)
    return 0 if all(report["floors"].values()) else 1


def _bench_prefetch(args: argparse.Namespace) -> int:
    from .bench import prefetch as bench

    report = bench.run(tokens=args.tokens, bandwidth_mbit=args.bandwidth, runs=args.runs, level=args.level,
                       model=args.model, json_path=args.json)
    _report(bench.table(report), args.json)
    return 0 if all(report["floors"].values()) else 1


def _bench_scale(args: argparse.Namespace) -> int:
    import functools

    from .bench import scale as bench

    try:
        shapes = [bench.parse_shape(s) for s in args.shapes]
        tokens = bench.parse_tokens(args.tokens, [n for n, _ in shapes])
    except ValueError as e:
        print(f"kvstreamd bench scale: {e}", file=sys.stderr)
        return 2
    report = bench.run(shapes, tokens, level=args.level, chunk_tokens=args.chunk_tokens, workers=args.workers,
                       per_token_shape=args.per_token_shape, fit_tokens=args.fit_tokens,
                       cache_profiles=not args.no_profile_cache, json_path=args.json,
                       log=(lambda *a, **k: None) if args.quiet else functools.partial(print, flush=True))
    _report(bench.table(report), args.json)
    return 0 if report["pass"] else 1


def _profile_calibrate(args: argparse.Namespace) -> int:
    import torch

    from . import models
    from .lab import calibrate

    torch.manual_seed(0)
    from codec import Profile

    lm = models.load(args.model)
    sens = Profile.load(args.sensitivity_from).tensors["sensitivity"] if args.sensitivity_from else None
    prof = calibrate.calibrate(lm, split=args.split, contexts=args.contexts, tokens=args.tokens, sensitivity=sens,
                               texts=args.texts or calibrate.TUNING_TEXTS)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    print(f"profile {prof.id.hex()} for {prof.model_id} written to {out}")
    print("level scales:", prof.meta["level_scales"])
    return 0


def _run(args: argparse.Namespace) -> int:
    from . import daemon
    return daemon.run(args.config)


def _client(args: argparse.Namespace):
    from .client import Client
    return Client(args.socket)


def _print(obj) -> None:
    import json
    print(json.dumps(obj, indent=2, sort_keys=False))


def _guard(fn):
    def wrapped(args: argparse.Namespace) -> int:
        from .client import ClientError
        try:
            return fn(args)
        except ClientError as e:
            print(f"kvstreamd: {e}", file=sys.stderr)
            return 1
    return wrapped


def _doctor(args: argparse.Namespace) -> int:
    """The checklist for slow first tokens; exit 0 / 1 / 2 for ok / warn / fail."""
    from . import doctor
    checks = doctor.run(_client(args), args.probe_bytes, args.probe_timeout)
    if args.json:
        _print(doctor.to_json(checks))
    else:
        for c in checks:
            print(c.line())
    return doctor.EXIT[doctor.worst(checks)]


@_guard
def _status(args: argparse.Namespace) -> int:
    _print(_client(args).status())
    return 0


@_guard
def _contexts(args: argparse.Namespace) -> int:
    ctxs = _client(args).contexts()
    if args.json:
        _print(ctxs)
        return 0
    print(f"{'key':18} {'model':45} {'tokens':>7} {'chunks':>6} {'MB':>8}")
    for c in ctxs:
        print(f"{c['key'][:16]:18} {c['model_id'][:45]:45} {c['tokens']:>7} {c['chunks']:>6} {c['bytes'] / 1e6:>8.2f}"
              + ("" if c["complete"] else "  (partial)") + ("  (pinned)" if c.get("pinned") else ""))
    return 0


@_guard
def _peers(args: argparse.Namespace) -> int:
    _print(_client(args).peers())
    return 0


@_guard
def _ab_report(args: argparse.Namespace) -> int:
    from . import ab_report, fetch_outcomes

    if args.source:
        try:
            outcomes = fetch_outcomes.read_file(Path(args.source))
        except OSError as e:
            print(f"kvstreamd ab report: --from {args.source}: {e.strerror or e}", file=sys.stderr)
            return 2
    else:
        outcomes = [fetch_outcomes.Outcome.from_json(o) for o in _client(args).ab()["outcomes"]]
    report = ab_report.compare(outcomes, args.experiment, seed=args.seed)
    if args.json:
        _print(report)
    else:
        print(ab_report.text(report))
    return 0


def _text_tokens(args: argparse.Namespace):
    from . import models
    lm = models.load(args.model)
    text = Path(args.file).read_text()
    tokens = lm.tokenizer.document(text)
    if args.tokens:
        tokens = tokens[:args.tokens]
    return lm, models, tokens


@_guard
def _put(args: argparse.Namespace) -> int:
    """Prefill a text file with the real model and store its KV in the daemon."""
    import time
    lm, models, tokens = _text_tokens(args)
    t0 = time.perf_counter()
    _, kv = models.prefill(lm, tokens, all_logits=False)
    prefill_s = time.perf_counter() - t0
    reply = _client(args).put(lm.model_id, tokens, kv.to(getattr(__import__("torch"), args.dtype)))
    _print({"tokens": len(tokens), "prefill_s": round(prefill_s, 3), **reply})
    return 0


@_guard
def _preload(args: argparse.Namespace) -> int:
    """Prefill documents and store them pinned (kvstreamd/preload.py); 1 if any failed."""
    from . import preload
    outcomes = preload.run(args.paths, args.model, _client(args), progress=not args.quiet)
    return 1 if any(o.outcome == "failed" for o in outcomes) else 0


@_guard
def _unpin(args: argparse.Namespace) -> int:
    _client(args).unpin(args.key)
    return 0


@_guard
def _fetch(args: argparse.Namespace) -> int:
    """Fetch a text file's KV (longest prefix held locally or by peers) and report each chunk."""
    lm, models, tokens = _text_tokens(args)
    with _client(args).fetch(lm.model_id, tokens, args.deadline_ms) as f:
        print(f"found {f.found_tokens} of {len(tokens)} tokens")
        for ev in f:
            print(f"  chunk {ev.i:3d} tokens {ev.start:6d}-{ev.end:<6d} {ev.kind:4} {ev.level:9} from {ev.source:12} "
                  f"at {ev.t_ms:8.1f} ms" + (f"  ({ev.error})" if ev.error else ""))
        from .events import to_json
        _print(to_json(f.end))
    return 0


@_guard
def _generate(args: argparse.Namespace) -> int:
    """Greedy-generate after a text file, its longest cached prefix fetched from the cluster."""
    from .models.prefix import generate
    lm, _, tokens = _text_tokens(args)
    new, reuse = generate(lm.model, tokens, _client(args), lm.model_id, max_new_tokens=args.max_new_tokens,
                          deadline_ms=args.deadline_ms)
    _print({"tokens": len(tokens), "found_tokens": reuse.found_tokens, "kv_tokens": reuse.kv_tokens,
            "text_tokens": reuse.text_tokens, "levels": reuse.levels, "bytes": reuse.bytes,
            "ttft_s": round(reuse.ttft_s or 0.0, 3), "errors": reuse.errors, "generated": new,
            "text": lm.tokenizer.decode(new)})
    return 0


def model_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--model", default=None,
                    help="a shipped model (smollm2-135m, the default; gemma3-270m), a .gguf file, or a "
                         "folder with config.json + *.safetensors + tokenizer.json")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstreamd", description="Move LLM KV caches between hosts.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon (foreground; systemd runs it as a notify service)")
    run.add_argument("--config", help="config file (default: $KVSTREAMD_CONFIG, /etc/kvstreamd/config.toml, "
                                      "else built-in defaults)")
    run.set_defaults(func=_run)

    def talker(name: str, help: str, func):
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--socket", help="the daemon's API socket (default: $KVSTREAMD_SOCKET or the default path)")
        sp.set_defaults(func=func)
        return sp

    talker("status", "a running daemon's status", _status)
    dr = talker("doctor", "check a running daemon and its host for what slows first tokens (exit 0/1/2: "
                          "ok/warn/fail)", _doctor)
    dr.add_argument("--json", action="store_true")
    dr.add_argument("--probe-bytes", type=int, default=None, help="padding per peer probe (default 512 KiB)")
    dr.add_argument("--probe-timeout", type=float, default=None, help="seconds per peer probe (default 5)")
    talker("contexts", "contexts a running daemon holds", _contexts).add_argument("--json", action="store_true")
    talker("peers", "a running daemon's peers", _peers)
    ab = sub.add_parser("ab", help="A/B experiments on the level policy ([policy] experiment)")
    absub = ab.add_subparsers(dest="ab", required=True)
    abr = absub.add_parser("report", help="compare the arms: fetch time, deadline misses, levels, bytes")
    abr.add_argument("--socket", help="the daemon's API socket (default: $KVSTREAMD_SOCKET or the default path)")
    abr.add_argument("--from", dest="source", metavar="FILE",
                     help="a recorded outcome log (the store dir's ab-fetches.jsonl) instead of a running daemon")
    abr.add_argument("--experiment", help="the experiment to compare, as the report names it (default: the latest)")
    abr.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0: reproducible)")
    abr.add_argument("--json", action="store_true")
    abr.set_defaults(func=_ab_report)
    for name, func, helptext in (("put", _put, "prefill a text file with the model and store its KV"),
                                 ("fetch", _fetch, "fetch a text file's KV from the cluster"),
                                 ("generate", _generate, "answer a text file with the model, reusing the "
                                                         "longest prefix of it the cluster holds")):
        sp = talker(name, helptext, func)
        sp.add_argument("file")
        sp.add_argument("--tokens", type=int, default=0, help="only the first N tokens (0: all)")
        model_option(sp)
        if name == "put":
            sp.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
        else:
            sp.add_argument("--deadline-ms", type=int, default=None)
        if name == "generate":
            sp.add_argument("--max-new-tokens", type=int, default=32)
    pre = talker("preload", "prefill text files (or folders of *.txt) with the model and store them pinned; "
                            "documents held already are only pinned", _preload)
    pre.add_argument("paths", nargs="+", metavar="PATH", help="a text file, or a folder: its *.txt files")
    model_option(pre)
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    talker("unpin", "end a context's pin (it stays stored, evictable again)", _unpin).add_argument(
        "key", help="the context's key, as `kvstreamd contexts --json` shows it")

    bench = sub.add_parser("bench", help="benchmarks that write JSON and print tables")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bc = bsub.add_parser("codec", help="size, quality and speed of every codec scheme on the real model")
    model_option(bc)
    bc.add_argument("--tokens", type=int, default=3072)
    bc.add_argument("--contexts", type=int, default=3)
    bc.add_argument("--continuation", type=int, default=256)
    bc.add_argument("--chunk-tokens", type=int, default=1024)
    bc.add_argument("--schemes", nargs="+", default=None, help="default: all")
    bc.add_argument("--texts", nargs="+", default=None, metavar="KIND",
                    help="kinds of text to measure on, their test splits (wikitext, legal, code; default: all)")
    bc.add_argument("--json", default="bench-out/codec.json")
    bc.add_argument("--plot", default="bench-out/codec_rate_quality.png")
    bc.set_defaults(func=_bench_codec)

    bs = bsub.add_parser("stream", help="real chunks over a shaped link between two network namespaces")
    model_option(bs)
    bs.add_argument("--bandwidth", nargs="+", default=["100mbit"], help="e.g. 20mbit 100mbit 500mbit")
    bs.add_argument("--tokens", type=int, default=4096)
    bs.add_argument("--runs", type=int, default=3, help="runs per method and bandwidth (the median is kept)")
    bs.add_argument("--deadline-ms", type=int, default=None, help="default: 500 ms per 1024 tokens")
    bs.add_argument("--trace", help="a bandwidth trace file (one Mbit/s per chunk per line)")
    bs.add_argument("--traces", type=int, default=0, help="also run this many generated CacheGen-style traces")
    bs.add_argument("--methods", nargs="+", default=None)
    bs.add_argument("--json", default="bench-out/stream.json")
    bs.set_defaults(func=_bench_stream)

    bt = bsub.add_parser("tls", help="peer-link throughput with and without TLS over a shaped link")
    bt.add_argument("--bandwidth", default="1000mbit", help="the link's rate, e.g. 1000mbit")
    bt.add_argument("--runs", type=int, default=5, help="runs per mode, alternating (the median is kept)")
    bt.add_argument("--mib", type=int, default=256, help="MiB moved per run")
    bt.add_argument("--chunk-mib", type=int, default=4, help="MiB per chunk")
    bt.add_argument("--json", default="bench-out/tls.json")
    bt.set_defaults(func=_bench_tls)

    bw = bsub.add_parser("window", help="fixed 2 vs bandwidth-delay-product window on a long, fat link")
    bw.add_argument("--bandwidth", default="1000mbit", help="the link's rate, e.g. 1000mbit")
    bw.add_argument("--delay-ms", type=float, default=50, help="added each way by the relay")
    bw.add_argument("--chunks", type=int, default=16)
    bw.add_argument("--chunk-mib", type=float, default=4, help="MiB per chunk")
    bw.add_argument("--runs", type=int, default=5, help="runs per window, alternating (medians kept)")
    bw.add_argument("--json", default="bench-out/window.json")
    bw.set_defaults(func=_bench_window)

    be = bsub.add_parser("e2e", help="TTFT on host b of a context stored on host a: recompute, fp16, int8, kvstreamd")
    model_option(be)
    be.add_argument("--bandwidth", nargs="+", default=["100mbit"])
    be.add_argument("--tokens", nargs="+", type=int, default=[4096])
    be.add_argument("--runs", type=int, default=3, help="documents per token count (medians are reported)")
    be.add_argument("--deadline-ms", type=int, default=None, help="default: 500 ms per 1024 tokens")
    be.add_argument("--methods", nargs="+", default=None, choices=["recompute", "fp16", "int8", "kvstreamd"])
    be.add_argument("--trace", help="bandwidth trace: Mbit/s per line, one step each --trace-step-ms")
    be.add_argument("--trace-step-ms", type=int, default=500)
    be.add_argument("--chunk-tokens", type=int, default=1024,
                    help="the daemons' chunk size (a hybrid model's window moves in whole chunks)")
    be.add_argument("--json", default="bench-out/e2e.json")
    be.add_argument("--plot", default="bench-out/e2e.png")
    be.add_argument("--quiet", action="store_true", help="no progress bars")
    be.set_defaults(func=_bench_e2e)

    bf = bsub.add_parser("fanout", help="one context from several holders at once, each behind its own shaped "
                                        "link, against one holder (needs root: network namespaces)")
    bf.add_argument("--tokens", type=int, default=4096)
    bf.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s of each holder's link")
    bf.add_argument("--runs", type=int, default=5, help="timed fetches of each kind (medians reported)")
    bf.add_argument("--level", default="high", help="the one level every chunk is stored and fetched at")
    bf.add_argument("--holders", type=int, default=3)
    bf.add_argument("--model", default=None, help="model to prefill with (default: SmolLM2-135M)")
    bf.add_argument("--json", default="bench-out/fanout.json")
    bf.set_defaults(func=_bench_fanout)

    bp = bsub.add_parser("prefetch", help="a user fetch's time alone and while a prefetch runs on its node, over "
                                          "a shaped link (needs root: network namespaces)")
    bp.add_argument("--tokens", type=int, default=4096, help="the user fetch's context (the prefetch's is 4x)")
    bp.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s of the link")
    bp.add_argument("--runs", type=int, default=5, help="timed fetches of each kind (medians reported)")
    bp.add_argument("--level", default="high", help="the one level every chunk is stored and fetched at")
    bp.add_argument("--model", default=None, help="model to prefill with (default: SmolLM2-135M)")
    bp.add_argument("--json", default="bench-out/prefetch.json")
    bp.set_defaults(func=_bench_prefetch)

    bg = bsub.add_parser("gpu", help="GPU decode throughput and exactness on a synthetic 7B-sized context")
    bg.add_argument("--layers", type=int, default=32)
    bg.add_argument("--heads", type=int, default=8, help="KV heads")
    bg.add_argument("--head-dim", type=int, default=128)
    bg.add_argument("--tokens", type=int, default=8192)
    bg.add_argument("--chunk-tokens", type=int, default=256)
    bg.add_argument("--level", default="high", choices=["high", "balanced", "fast"])
    bg.add_argument("--device", default=None, help="cuda or cpu (default: cuda where codec.gpu can use it)")
    bg.add_argument("--reps", type=int, default=10, help="timed decodes (the median is reported)")
    bg.add_argument("--fit-tokens", type=int, default=None, help="calibration tokens (default: 2 x heads x head dim)")
    bg.add_argument("--workers", type=int, default=None, help="encoding processes (default: all cores)")
    bg.add_argument("--json", default="bench-out/gpu.json")
    bg.add_argument("--quiet", action="store_true", help="no progress bars")
    bg.set_defaults(func=_bench_gpu)

    bl = bsub.add_parser("scale", help="100K- and 32K-token synthetic contexts put on one daemon and fetched by "
                                       "another: seconds, bytes, peak memory, seconds per token")
    bl.add_argument("--shapes", nargs="+", default=["small:24x2x64", "llama8b:32x8x128"],
                    help="NAME:LAYERSxKV_HEADSxHEAD_DIM each")
    bl.add_argument("--tokens", nargs="+", default=None,
                    help="NAME:N,N,... per shape, or counts for every shape (default: small 8192 32768 102400, "
                         "llama8b 8192 32768)")
    bl.add_argument("--level", default="high", choices=["high", "balanced", "fast"],
                    help="the one level stored and fetched")
    bl.add_argument("--chunk-tokens", type=int, default=1024)
    bl.add_argument("--workers", type=int, default=0, help="codec workers per daemon (0: one per core)")
    bl.add_argument("--per-token-shape", default=None, help="the shape whose seconds per token are compared "
                                                            "(default: the first)")
    bl.add_argument("--fit-tokens", type=int, default=None, help="calibration tokens (default: 2 x heads x head dim)")
    bl.add_argument("--no-profile-cache", action="store_true", help="fit every profile afresh")
    bl.add_argument("--json", default="bench-out/scale.json")
    bl.add_argument("--quiet", action="store_true", help="no progress lines")
    bl.set_defaults(func=_bench_scale)

    demo = sub.add_parser("demo", help="two hosts, the real model: store a document on one, answer on the other")
    model_option(demo)
    demo.add_argument("--bandwidth", default="100mbit")
    demo.add_argument("--tokens", type=int, default=4096)
    demo.add_argument("--deadline-ms", type=int, default=None, help="default: 500 ms per 1024 tokens")
    demo.add_argument("--trace", help="bandwidth trace: Mbit/s per line, one step each --trace-step-ms")
    demo.add_argument("--trace-step-ms", type=int, default=500)
    demo.add_argument("--json", default="bench-out/demo.json")
    demo.add_argument("--plot", default="bench-out/demo.png")
    demo.add_argument("--chunk-tokens", type=int, default=1024)
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)

    prof = sub.add_parser("profile", help="codec profiles")
    psub = prof.add_subparsers(dest="profile", required=True)
    cal = psub.add_parser("calibrate", help="make a codec profile from calibration text with the real model")
    cal.add_argument("--out", required=True)
    cal.add_argument("--split", default="valid", help="WikiText-2 split to calibrate on (never test)")
    cal.add_argument("--contexts", type=int, default=4)
    cal.add_argument("--tokens", type=int, default=2048)
    model_option(cal)
    cal.add_argument("--texts", nargs="+", default=None, metavar="KIND",
                     help="kinds of text whose valid split the level scales are tuned on (default: all)")
    cal.add_argument("--sensitivity-from", metavar="PROFILE",
                     help="reuse the sensitivity measured for an earlier profile of the same model")
    cal.set_defaults(func=_profile_calibrate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
