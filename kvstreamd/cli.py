"""The `kvstreamd` command: run the daemon, talk to a running one over its Unix socket
(status, doctor, contexts, peers, put, fetch, preload, ab report) and profile calibration;
the benchmarks and the demo are bench/commands.py's."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from .bench import commands


def _profile_calibrate(args: argparse.Namespace) -> int:
    import torch

    from . import models
    from .lab import calibrate

    torch.manual_seed(0)
    from codec import Profile
    from codec.tuning import registry

    lm = models.load(args.model)
    sens = Profile.load(args.sensitivity_from).tensors["sensitivity"] if args.sensitivity_from else None
    prof = calibrate.calibrate(lm, split=args.split, contexts=args.contexts, tokens=args.tokens, sensitivity=sens,
                               texts=args.texts or calibrate.TUNING_TEXTS,
                               tuning_contexts=args.tuning_contexts or calibrate.TUNING_CONTEXTS,
                               tuning_tokens=args.tuning_tokens or calibrate.TUNING_TOKENS,
                               tuning_continuation=args.tuning_continuation or calibrate.TUNING_CONTINUATION,
                               rate_control=args.rate_control, token_power=args.token_steps)
    out = Path(args.out) if args.out else registry.user_file(prof)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    print(f"profile {prof.id.hex()} for {prof.model_id} written to {out}")
    if args.out:
        print(f"code with it: --profile {out} (the benchmarks and demos) or [codec] profile (the daemon)")
    else:
        print(f"in the user profile folder: every kvstreamd command and daemon of this user codes "
              f"{prof.model_id} with it (the newest there), unless told --profile or [codec] profile")
    print("level scales:", prof.meta["level_scales"])
    return 0


def _profile_retune(args: argparse.Namespace) -> int:
    """`profile tune-rate` and `profile costs`: an existing profile's per-chunk rate control
    retuned (tune-rate only; calibrate.tune_targets) and its level costs measured again
    (calibrate.level_costs, which depend on the rate control), written as a new profile: the
    statistics, steps and level scales stay as they are."""
    from . import models
    from .lab import calibrate
    from codec import Profile
    from codec.tuning import registry, tuned

    untuned = [t for t in args.texts or () if t not in calibrate.TUNING_TEXTS]
    if untuned:
        raise CommandError(f"--texts {untuned[0]}: not a kind of text tuned on (those are "
                           f"{', '.join(calibrate.TUNING_TEXTS)}; the others are held out from tuning)")
    try:
        models.resolve(args.model)
    except (ValueError, OSError) as e:
        raise CommandError(f"--model: {e}") from None
    lm = models.load(args.model)
    prof = registry.for_model(lm.model_id, args.profile)  # a --profile that does not load, or is another model's: refused
    prof = Profile(dict(prof.meta), dict(prof.tensors))  # a new profile, its id taken afresh
    tuning = calibrate.tuning_cases(lm, texts=args.texts or calibrate.TUNING_TEXTS)
    costs = calibrate.chunk_costs(lm, prof, tuning)
    if args.profile_command == "tune-rate":
        tuned.write(prof, rate_control=calibrate.tune_targets(lm, prof, tuning, costs=costs))
    tuned.write(prof, level_dppl=calibrate.level_costs(lm, prof, tuning, costs))
    out = Path(args.out) if args.out else registry.user_file(prof)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    print(f"profile {prof.id.hex()} for {prof.model_id} written to {out}")
    print("rate control:", prof.meta.get("rate_control"))
    print("level costs:", prof.meta["level_dppl"])
    return 0


def _model_folder(args: argparse.Namespace) -> int:
    from .limits import MODEL_META
    from .models.engine_folder import engine_folder
    out = engine_folder(args.model, args.out)
    print(f"{out}: serve it with vLLM; its contexts are filed under {(out / MODEL_META).read_text()}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from kvstreamd.node import daemon
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
    from kvstreamd.ops import doctor
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
    from kvstreamd.ops import ab_report, outcomes as outcome_log

    if args.source:
        try:
            outcomes = outcome_log.read_file(Path(args.source))
        except OSError as e:
            print(f"kvstreamd ab report: --from {args.source}: {e.strerror or e}", file=sys.stderr)
            return 2
    else:
        outcomes = [outcome_log.Outcome.from_json(o) for o in _client(args).ab()["outcomes"]]
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
    """Prefill a text file with the real model and store its KV in the daemon, with what coding
    each chunk costs the model (models.put)."""
    from .models.put import put_context
    lm, _, tokens = _text_tokens(args)
    reply = put_context(lm, _client(args), tokens, dtype=getattr(__import__("torch"), args.dtype))
    _print({"tokens": len(tokens), **reply})
    return 0


@_guard
def _preload(args: argparse.Namespace) -> int:
    """Prefill documents and store them pinned (kvstreamd/ops/preload.py); 1 if any failed."""
    from kvstreamd.ops import preload
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
    with _client(args).fetch(lm.model_id, tokens, deadline_ms=args.deadline_ms) as f:
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

    mf = sub.add_parser("model-folder", help="a folder vLLM serves, for the same weights (and model id) as --model")
    mf.add_argument("--out", required=True)
    model_option(mf)
    mf.set_defaults(func=_model_folder)

    commands.add(sub, model_option)

    prof = sub.add_parser("profile", help="codec profiles")
    psub = prof.add_subparsers(dest="profile", required=True)
    cal = psub.add_parser("calibrate", help="make a codec profile from calibration text with the real model")
    cal.add_argument("--out", metavar="PATH",
                     help="where to write it (default: the user profile folder, $KVSTREAMD_PROFILE_DIR or "
                          "$XDG_DATA_HOME/kvstreamd/profiles, as MODEL-ID8.kvprofile, which every command and "
                          "daemon searches)")
    cal.add_argument("--split", default="valid", help="WikiText-2 split to calibrate on (never test)")
    cal.add_argument("--contexts", type=int, default=4)
    cal.add_argument("--tokens", type=int, default=2048)
    model_option(cal)
    cal.add_argument("--texts", nargs="+", default=None, metavar="KIND",
                     help="kinds of text whose valid split the level scales are tuned on (default: every kind "
                          "tuned on; never manual, held out from tuning)")
    cal.add_argument("--tuning-contexts", type=int, default=None, metavar="N",
                     help="contexts of each kind of text the sensitivity and level scales are measured on "
                          "(default 3; fewer, and fewer tokens, make a quick rough profile)")
    cal.add_argument("--tuning-tokens", type=int, default=None, metavar="N",
                     help="tokens of each such context (default 3072), followed by --tuning-continuation more (default 256)")
    cal.add_argument("--tuning-continuation", type=int, default=None, metavar="N")
    cal.add_argument("--sensitivity-from", metavar="PROFILE",
                     help="reuse the sensitivity measured for an earlier profile of the same model")
    cal.add_argument("--no-rate-control", dest="rate_control", action="store_false",
                     help="no per-chunk rate control: every chunk at its level's one scale (for a model whose "
                          "held-out text breaks the floors under it, as Gemma-3-270M's does)")
    cal.add_argument("--token-steps", type=float, default=None, metavar="POWER",
                     help="per-token steps (codec/tuning/token_steps.py): each token's step times (its probe weight over "
                          "the layer's mean) ** -POWER, within 1..8; the level scales are tuned with them (0.25: "
                          "what Gemma-3-270M's profile takes)")
    cal.set_defaults(func=_profile_calibrate)
    retunes = {"tune-rate": "tune a profile's per-chunk rate control (each level's target) and measure its "
                            "level costs again, on calibration text, and write it as a new profile",
               "costs": "measure a profile's level costs (what a sender's level choice weighs for its model) "
                        "on calibration text, and write it as a new profile"}
    for name, what in retunes.items():
        tr = psub.add_parser(name, help=what)
        tr.add_argument("--profile", metavar="PATH", help="the profile to start from (default: the model's)")
        tr.add_argument("--out", metavar="PATH", help="where to write it (default: the user profile folder)")
        tr.add_argument("--texts", nargs="+", default=None, metavar="KIND",
                        help="kinds of text whose valid split it is measured on (default: every kind "
                             "tuned on; never manual, held out from tuning)")
        model_option(tr)
        tr.set_defaults(func=_profile_retune, profile_command=name)
    return p


class CommandError(ValueError):
    """A command's options that cannot work: one line naming the option, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        # CommandError, or codec.errors.ProfileError (a --profile that does not load or is another
        # model's, or none for the model): one line, exit status 2. Looked up, not imported:
        # importing the codec loads torch, which a command that codes nothing never needs.
        errors = sys.modules.get("codec.errors")
        if not isinstance(e, CommandError) and (errors is None or not isinstance(e, errors.ProfileError)):
            raise
        command = " ".join(itertools.takewhile(lambda word: not word.startswith("-"), argv))
        print(f"kvstreamd {command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
