"""The commands of the harness: `kvstreamd bench ...` (each benchmark's options, its run and
its table) and `kvstreamd demo`, added to the `kvstreamd` command by cli.py."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def _report(text: str, json_path: str | None) -> None:
    """A benchmark's table, and where its JSON went."""
    print()
    print(text)
    if json_path:
        print(f"\nJSON written to {json_path}")


def _bench_codec(args: argparse.Namespace) -> int:
    from . import codec as bench

    report = bench.run(tokens=args.tokens, contexts=args.contexts, continuation=args.continuation,
                       chunk_tokens=args.chunk_tokens, schemes=args.schemes, json_path=args.json,
                       plot_path=args.plot, texts=args.texts, model=args.model, profile=args.profile)
    used = report["profile"]
    print(f"\n{report['model']}: coded with the {used['source']} profile {used['id']} ({used['path']})")
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
    from . import stream as bench

    bandwidths = [float(b.lower().removesuffix("mbit")) for b in args.bandwidth]
    report = bench.run(bandwidths, tokens=args.tokens, runs=args.runs, deadline_ms=args.deadline_ms,
                       trace_file=args.trace, n_traces=args.traces, methods=args.methods, json_path=args.json,
                       model=args.model, profile=args.profile)
    print()
    print(f"{report['tokens']}-token context, deadline {report['deadline_ms']} ms")
    print(bench.table(report))
    if args.json:
        print(f"\nJSON written to {args.json}")
    return 0


def _bench_tls(args: argparse.Namespace) -> int:
    from . import tls as bench

    report = bench.run(_mbits([args.bandwidth])[0], runs=args.runs, mib=args.mib, chunk_mib=args.chunk_mib,
                       json_path=args.json)
    _report(bench.summary(report), args.json)
    return 0


def _bench_window(args: argparse.Namespace) -> int:
    from . import window as bench

    report = bench.run(_mbits([args.bandwidth])[0], delay_ms=args.delay_ms, chunks=args.chunks,
                       chunk_mib=args.chunk_mib, runs=args.runs, json_path=args.json)
    _report(bench.summary(report), args.json)
    return 0


def _mbits(values: list[str]) -> list[float]:
    return [float(b.lower().removesuffix("mbit")) for b in values]


def _trace(path: str | None) -> list[float] | None:
    return [float(x) for x in Path(path).read_text().split()] if path else None


def _demo(args: argparse.Namespace) -> int:
    from . import e2e

    report = e2e.run(_mbits([args.bandwidth]), [args.tokens], runs=1, deadline_ms=args.deadline_ms,
                     trace=_trace(args.trace), trace_step_s=args.trace_step_ms / 1000, json_path=args.json,
                     plot_path=args.plot, progress=not args.quiet, chunk_tokens=args.chunk_tokens,
                     model=args.model, profile=args.profile)
    print()
    print(f"{report['model']}, document of {report['runs'][0]['doc_tokens']} WikiText-2 tokens stored on host a, "
          f"prompt = document + question on host b, deadline {report['runs'][0]['deadline_ms']} ms"
          + ("" if report["shaped"] else "  [loopback: not shaped]"))
    print(e2e.table(report))
    print("\nlevels kvstreamd chose per chunk:", e2e.levels_line(report))
    print(f"host b's answer (kvstreamd): {report['answer']!r}")
    print(f"\nplot: {args.plot}   JSON: {args.json}")
    return 0


def _demo_vllm(args: argparse.Namespace) -> int:
    from . import vllm_demo

    report = vllm_demo.run(tokens=args.tokens, bandwidth_mbit=_mbits([args.bandwidth])[0], model=args.model,
                           chunk_tokens=args.chunk_tokens, json_path=args.json, profile=args.profile)
    print()
    print(vllm_demo.summary(report))
    print(f"\nJSON: {args.json}")
    return 0


def _bench_e2e(args: argparse.Namespace) -> int:
    from . import e2e

    report = e2e.run(_mbits(args.bandwidth), args.tokens, runs=args.runs, deadline_ms=args.deadline_ms,
                     methods=args.methods, trace=_trace(args.trace), trace_step_s=args.trace_step_ms / 1000,
                     json_path=args.json, plot_path=args.plot, progress=not args.quiet, model=args.model,
                     chunk_tokens=args.chunk_tokens, profile=args.profile)
    print()
    print(e2e.table(report))
    print(f"\nJSON written to {args.json}")
    return 0


def _bench_vllm(args: argparse.Namespace) -> int:
    from . import vllm as bench

    report = bench.run(tokens=args.tokens, bandwidth_mbit=_mbits([args.bandwidth])[0], runs=args.runs,
                       chunk_tokens=args.chunk_tokens, model=args.model, json_path=args.json,
                       profile=args.profile)
    _report(bench.table(report), args.json)
    return 0 if all(bench.floors(report).values()) else 1


def _bench_agreement(args: argparse.Namespace) -> int:
    from . import agreement as bench

    report = bench.run(tokens=args.tokens, docs=args.docs, schemes=args.schemes, new_tokens=args.new_tokens,
                       chunk_tokens=args.chunk_tokens, model=args.model, profile=args.profile, json_path=args.json)
    _report(bench.table(report), args.json)
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from . import gpu as bench

    report = bench.run(layers=args.layers, heads=args.heads, head_dim=args.head_dim, tokens=args.tokens,
                       chunk_tokens=args.chunk_tokens, level=args.level, device=args.device, reps=args.reps,
                       json_path=args.json, fit_tokens=args.fit_tokens, workers=args.workers,
                       progress=not args.quiet)
    _report(bench.summary(report), args.json)
    return 0


def _bench_fanout(args: argparse.Namespace) -> int:
    from . import fanout as bench

    report = bench.run(tokens=args.tokens, bandwidth_mbit=args.bandwidth, runs=args.runs, level=args.level,
                       holders=args.holders, model=args.model, json_path=args.json, profile=args.profile)
    _report(bench.table(report), args.json)
    return 0 if all(report["floors"].values()) else 1


def _bench_prefetch(args: argparse.Namespace) -> int:
    from . import prefetch as bench

    report = bench.run(tokens=args.tokens, bandwidth_mbit=args.bandwidth, runs=args.runs, level=args.level,
                       model=args.model, json_path=args.json, profile=args.profile)
    _report(bench.table(report), args.json)
    return 0 if all(report["floors"].values()) else 1


def _bench_directory(args: argparse.Namespace) -> int:
    from . import directory as bench

    try:
        report = bench.run(daemons=args.daemons, puts=args.puts, lease_s=args.lease_s, outage_s=args.outage_s,
                           json_path=args.json)
    except ValueError as e:
        print(f"kvstreamd bench directory: {e}", file=sys.stderr)
        return 2
    _report(bench.table(report), args.json)
    return 0 if all(report["floors"].values()) else 1


def _bench_scale(args: argparse.Namespace) -> int:
    import functools

    from . import scale as bench

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


def _bench_tables(args: argparse.Namespace) -> int:
    from . import tables as bench

    missing = [p for p in args.profiles or [] if not Path(p).is_file()]
    if missing:
        print(f"kvstreamd bench tables: no profile file {missing[0]}", file=sys.stderr)
        return 2
    report = bench.run([Path(p) for p in args.profiles or []], repeats=args.repeats, json_path=args.json)
    _report(bench.table(report), args.json)
    return 0


def profile_option(sp: argparse.ArgumentParser) -> None:
    """--profile, for a command that codes the model's KV (itself, or in the daemons it starts,
    as their [codec] profile): codec.tuning.registry's precedence."""
    sp.add_argument("--profile", metavar="PATH", default=None,
                    help="the codec profile file to code with, the model's (default: the model's newest in the "
                         "user profile folder, $KVSTREAMD_PROFILE_DIR or ~/.local/share/kvstreamd/profiles, "
                         "else the shipped one)")


def add(sub, model_option: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `bench` and `demo` to the `kvstreamd` command's subcommands."""
    bench = sub.add_parser("bench", help="benchmarks that write JSON and print tables")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bc = bsub.add_parser("codec", help="size, quality and speed of every codec scheme on the real model")
    model_option(bc)
    profile_option(bc)
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
    profile_option(bs)
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
    profile_option(be)
    be.add_argument("--bandwidth", nargs="+", default=["100mbit"])
    be.add_argument("--tokens", nargs="+", type=int, default=[4096])
    be.add_argument("--runs", type=int, default=3, help="documents per token count (medians are reported)")
    be.add_argument("--deadline-ms", type=int, default=None, help="default: 500 ms per 1024 tokens")
    be.add_argument("--methods", nargs="+", default=None, choices=["recompute", "fp16", "int8", "kvstreamd"])
    be.add_argument("--trace", help="bandwidth trace: Mbit/s per line, one step each --trace-step-ms")
    be.add_argument("--trace-step-ms", type=int, default=500)
    be.add_argument("--chunk-tokens", type=int, default=None,
                    help="the daemons' chunk size; default: e2e.CHUNK_TOKENS "
                         "(a hybrid model's window moves in whole chunks)")
    be.add_argument("--json", default="bench-out/e2e.json")
    be.add_argument("--plot", default="bench-out/e2e.png")
    be.add_argument("--quiet", action="store_true", help="no progress bars")
    be.set_defaults(func=_bench_e2e)

    bv = bsub.add_parser("vllm", help="TTFT of a real vLLM on host b for a document host a's vLLM computed: "
                                      "vLLM's own prefill, kvstreamd, raw fp16 KV (needs .venv-vllm)")
    model_option(bv)
    profile_option(bv)
    bv.add_argument("--bandwidth", default="100mbit", help="the link's rate, e.g. 100mbit")
    bv.add_argument("--tokens", type=int, default=4096, help="the document's tokens (the question follows)")
    bv.add_argument("--runs", type=int, default=3, help="documents, a fresh one each run (medians are reported)")
    bv.add_argument("--chunk-tokens", type=int, default=256, help="the daemons' chunk size")
    bv.add_argument("--json", default="bench-out/vllm.json")
    bv.set_defaults(func=_bench_vllm)

    ba = bsub.add_parser("agreement", help="how often each scheme changes the model's greedy answer after a long "
                                           "document (its KV coded chunk by chunk) and a question")
    model_option(ba)
    profile_option(ba)
    ba.add_argument("--tokens", type=int, default=4096, help="the document's tokens (the question follows)")
    ba.add_argument("--docs", type=int, default=30, help="documents (test.txt windows)")
    ba.add_argument("--schemes", nargs="+", default=None, help="levels and baselines (default: int8 high max)")
    ba.add_argument("--new-tokens", type=int, default=8, help="greedy tokens compared per document")
    ba.add_argument("--chunk-tokens", type=int, default=256)
    ba.add_argument("--json", default="bench-out/agreement.json")
    ba.set_defaults(func=_bench_agreement)

    bf = bsub.add_parser("fanout", help="one context from several holders at once, each behind its own shaped "
                                        "link, against one holder (needs root: network namespaces)")
    bf.add_argument("--tokens", type=int, default=4096)
    bf.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s of each holder's link")
    bf.add_argument("--runs", type=int, default=5, help="timed fetches of each kind (medians reported)")
    bf.add_argument("--level", default="high", help="the one level every chunk is stored and fetched at")
    bf.add_argument("--holders", type=int, default=3)
    bf.add_argument("--model", default=None, help="model to prefill with (default: SmolLM2-135M)")
    profile_option(bf)
    bf.add_argument("--json", default="bench-out/fanout.json")
    bf.set_defaults(func=_bench_fanout)

    bp = bsub.add_parser("prefetch", help="a user fetch's time alone and while a prefetch runs on its node, over "
                                          "a shaped link (needs root: network namespaces)")
    bp.add_argument("--tokens", type=int, default=4096, help="the user fetch's context (the prefetch's is 4x)")
    bp.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s of the link")
    bp.add_argument("--runs", type=int, default=5, help="timed fetches of each kind (medians reported)")
    bp.add_argument("--level", default="high", help="the one level every chunk is stored and fetched at")
    bp.add_argument("--model", default=None, help="model to prefill with (default: SmolLM2-135M)")
    profile_option(bp)
    bp.add_argument("--json", default="bench-out/prefetch.json")
    bp.set_defaults(func=_bench_prefetch)

    bd = bsub.add_parser("directory", help="the Redis directory with N daemon processes on one redis-server: "
                                           "seconds to find a put, to drop a killed host, to recover a restart")
    bd.add_argument("--daemons", type=int, default=16)
    bd.add_argument("--puts", type=int, default=5, help="contexts put, each on a different node")
    bd.add_argument("--lease-s", type=float, default=10.0, help="the daemons' [directory] lease_s")
    bd.add_argument("--outage-s", type=float, default=10.0, help="seconds redis-server stays stopped")
    bd.add_argument("--json", default="bench-out/directory.json")
    bd.set_defaults(func=_bench_directory)

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

    bb = bsub.add_parser("tables", help="CPU a codec worker spends building entropy tables: at start, per "
                                        "step scale, for rate control's whole grid")
    bb.add_argument("--profiles", nargs="+", metavar="PATH", default=None,
                    help="profile files (default: the shipped ones)")
    bb.add_argument("--repeats", type=int, default=3, help="fresh loads measured (the median is reported)")
    bb.add_argument("--json", default="bench-out/tables.json")
    bb.set_defaults(func=_bench_tables)

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
    profile_option(demo)
    demo.add_argument("--bandwidth", default="100mbit")
    demo.add_argument("--tokens", type=int, default=4096)
    demo.add_argument("--deadline-ms", type=int, default=None, help="default: 500 ms per 1024 tokens")
    demo.add_argument("--trace", help="bandwidth trace: Mbit/s per line, one step each --trace-step-ms")
    demo.add_argument("--trace-step-ms", type=int, default=500)
    demo.add_argument("--json", default="bench-out/demo.json")
    demo.add_argument("--plot", default="bench-out/demo.png")
    demo.add_argument("--chunk-tokens", type=int, default=None, help="default: as bench e2e's")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=_demo)

    dv = sub.add_parser("demo-vllm", help="two hosts, two vLLM servers with the connector: one computes a document, "
                                          "the other loads it through kvstreamd (needs .venv-vllm)")
    model_option(dv)
    profile_option(dv)
    dv.add_argument("--bandwidth", default="100mbit")
    dv.add_argument("--tokens", type=int, default=4096, help="the document's tokens (a question follows)")
    dv.add_argument("--chunk-tokens", type=int, default=256)
    dv.add_argument("--json", default="bench-out/demo-vllm.json")
    dv.set_defaults(func=_demo_vllm)
