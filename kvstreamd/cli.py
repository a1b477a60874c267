"""The `kvstreamd` command: benchmarks and profile calibration (the daemon's commands join
as they are built)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _bench_codec(args: argparse.Namespace) -> int:
    from .bench import codec as bench

    report = bench.run(tokens=args.tokens, contexts=args.contexts, continuation=args.continuation,
                       chunk_tokens=args.chunk_tokens, schemes=args.schemes, json_path=args.json,
                       plot_path=args.plot)
    print()
    print(f"{report['model']}: {report['contexts']} x {report['tokens']}-token WikiText-2 test contexts, "
          f"{report['continuation']} continuation tokens, exact-cache ppl {report['exact_ppl']:.3f}")
    print(bench.table(report))
    if args.json:
        print(f"\nJSON written to {args.json}")
    return 0


def _bench_stream(args: argparse.Namespace) -> int:
    from .bench import stream as bench

    bandwidths = [float(b.lower().removesuffix("mbit")) for b in args.bandwidth]
    report = bench.run(bandwidths, tokens=args.tokens, runs=args.runs, deadline_ms=args.deadline_ms,
                       trace_file=args.trace, n_traces=args.traces, methods=args.methods, json_path=args.json)
    print()
    print(f"{report['tokens']}-token context, deadline {report['deadline_ms']} ms")
    print(bench.table(report))
    if args.json:
        print(f"\nJSON written to {args.json}")
    return 0


def _profile_calibrate(args: argparse.Namespace) -> int:
    import torch

    from . import calibrate, models

    torch.manual_seed(0)
    from codec import Profile

    lm = models.load()
    sens = Profile.load(args.sensitivity_from).tensors["sensitivity"] if args.sensitivity_from else None
    prof = calibrate.calibrate(lm, split=args.split, contexts=args.contexts, tokens=args.tokens, sensitivity=sens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    print(f"profile {prof.id.hex()} for {prof.model_id} written to {out}")
    print("level scales:", prof.meta["level_scales"])
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstreamd", description="Move LLM KV caches between hosts.")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks that write JSON and print tables")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bc = bsub.add_parser("codec", help="size, quality and speed of every codec scheme on the real model")
    bc.add_argument("--tokens", type=int, default=3072)
    bc.add_argument("--contexts", type=int, default=3)
    bc.add_argument("--continuation", type=int, default=256)
    bc.add_argument("--chunk-tokens", type=int, default=1024)
    bc.add_argument("--schemes", nargs="+", default=None, help="default: all")
    bc.add_argument("--json", default="bench-out/codec.json")
    bc.add_argument("--plot", default="bench-out/codec_rate_quality.png")
    bc.set_defaults(func=_bench_codec)

    bs = bsub.add_parser("stream", help="real chunks over a shaped link between two network namespaces")
    bs.add_argument("--bandwidth", nargs="+", default=["100mbit"], help="e.g. 20mbit 100mbit 500mbit")
    bs.add_argument("--tokens", type=int, default=4096)
    bs.add_argument("--runs", type=int, default=3, help="runs per method and bandwidth (the median is kept)")
    bs.add_argument("--deadline-ms", type=int, default=None, help="default: 500 ms per 1024 tokens")
    bs.add_argument("--trace", help="a bandwidth trace file (one Mbit/s per chunk per line)")
    bs.add_argument("--traces", type=int, default=0, help="also run this many generated CacheGen-style traces")
    bs.add_argument("--methods", nargs="+", default=None)
    bs.add_argument("--json", default="bench-out/stream.json")
    bs.set_defaults(func=_bench_stream)

    prof = sub.add_parser("profile", help="codec profiles")
    psub = prof.add_subparsers(dest="profile", required=True)
    cal = psub.add_parser("calibrate", help="make a codec profile from calibration text with the real model")
    cal.add_argument("--out", required=True)
    cal.add_argument("--split", default="valid", help="WikiText-2 split to calibrate on (never test)")
    cal.add_argument("--contexts", type=int, default=4)
    cal.add_argument("--tokens", type=int, default=2048)
    cal.add_argument("--sensitivity-from", metavar="PROFILE",
                     help="reuse the sensitivity measured for an earlier profile of the same model")
    cal.set_defaults(func=_profile_calibrate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
