"""The two ends of one `kvstreamd bench stream` run, each a process on its own test host:
`serve` sends a prepared context's chunks with a method's level choice through the daemon's
own sender loop (transport.send.send_chunks), reshaping its link per chunk when given a trace;
`fetch` asks for the context, decodes chunks in a process pool as they land (recomputing TEXT
chunks with the real model) and prints one JSON line."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from codec.tuning import catalog
from kvstreamd.store.keys import chunk_keys
from kvstreamd.lab import netns
from transport import aio
from transport.messages import Fetch
from transport.bandwidth import BandwidthEstimator
from transport.frames import text_wire_bytes
from transport.policy import TEXT, adaptive_rule, cachegen_rule, fixed_rule
from transport.send import send_chunks

METHODS = ["fp16", "int8", "text", "cachegen-rule", "adaptive"]
ADAPTIVE_LEVELS = ["fp16", "int8", "high", "balanced", "fast", TEXT]  # what the rules may pick from
CACHEGEN_LEVELS = ["high", "balanced", "fast", TEXT]  # CacheGen's ladder: its levels plus text


def rule_and_levels(method: str):
    if method == "cachegen-rule":
        return cachegen_rule, CACHEGEN_LEVELS
    if method == "adaptive":
        return adaptive_rule, ADAPTIVE_LEVELS
    return fixed_rule(method), [method]


def load(data_dir: Path) -> tuple[dict, dict[str, list[bytes]]]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    payloads = {lv: [(data_dir / f"chunk{c['i']}.{lv}").read_bytes() for c in manifest["chunks"]]
                for lv in manifest["levels"]}
    return manifest, payloads


def receiver_work(manifest: dict) -> dict[str, float]:
    """Receiver seconds per chunk at each level, as measured when the data was prepared."""
    chunks = manifest["chunks"]
    work = {lv: statistics.median(c["decode_s"][lv] for c in chunks) for lv in manifest["levels"]}
    # Recomputing chunk i attends over the i chunks before it, so later chunks cost more
    # (1.9 s for the first 1024 tokens here, 4.5 s for the fourth); the rules take one figure
    # per level, and text is the last resort, so they get the dearest.
    work[TEXT] = max(c["recompute_s"] for c in chunks)
    return work


def set_rate(dev: str, mbit: float) -> None:
    """Reshape this host's side of the link (the sender runs inside its namespace, as root)."""
    subprocess.run(["tc", "qdisc", "replace", "dev", dev, "root", *netns.tbf(mbit)], check=True)


async def serve(args) -> None:
    manifest, payloads = load(Path(args.dir))
    rule, levels = rule_and_levels(args.method)
    work = receiver_work(manifest)
    dppl = {**catalog.dppl_table(lv for lv in levels if lv in catalog.SCHEMES), **json.loads(args.dppl or "{}")}
    trace = [float(x) for x in Path(args.trace).read_text().split()] if args.trace else None
    done = asyncio.get_running_loop().create_future()

    async def handler(served: aio.ServedFetch, fetch) -> None:
        text = [text_wire_bytes(c["tokens"], served.req, i) for i, c in enumerate(manifest["chunks"])]
        sizes = {lv: [len(p) for p in payloads[lv]] if lv != TEXT else text for lv in levels}
        estimator = BandwidthEstimator()
        receiver = dict(work)
        if fetch.decode_mbps:
            # The receiver's own word on its entropy-decode speed beats our measurement.
            chunk_mb = manifest["chunks"][0]["bytes"]["fp16"] / 1e6  # the fp16 KV a chunk decodes to
            receiver.update({lv: chunk_mb / fetch.decode_mbps for lv in ("high", "balanced", "fast")})
        if trace:
            set_rate(args.dev, trace[0])  # the probe crosses the first chunk's link
        sent = await send_chunks(
            served, sizes, lambda i, lv: payloads[lv][i], lambda i: manifest["chunks"][i]["tokens"],
            rule, estimator, {lv: receiver[lv] for lv in levels}, {lv: dppl[lv] for lv in levels},
            before_send=(lambda i, _lv: set_rate(args.dev, trace[i % len(trace)])) if trace else None)
        if not done.done():
            done.set_result([c.reason for c in sent.sender.choices])

    server = await aio.serve(args.host, args.port, "bench-sender", bytes.fromhex(args.secret), handler)
    print("ready", flush=True)
    reasons = await done
    print(json.dumps({"reasons": reasons}), flush=True)
    server.close()


async def fetch(args) -> None:
    from codec import baselines
    from codec.tuning import registry
    from codec.pool.parallel import CodecPool

    from kvstreamd import models

    from kvstreamd.bench.stream_data import PROFILE_FILE

    manifest = json.loads((Path(args.dir) / "manifest.json").read_text())
    profile_file = Path(args.dir) / PROFILE_FILE
    profiles = ()
    if profile_file.is_file():  # (data prepared before it was kept there: the registry's profile)
        registry.for_model(manifest["model"], profile_file)
        profiles = (profile_file,)
    # Loaded before the clock starts: a serving host has its model loaded already.
    lm = models.load(manifest.get("model_name")) if args.method in ("text", "cachegen-rule", "adaptive") else None
    _, levels = rule_and_levels(args.method)
    with CodecPool(profile_paths=profiles) as pool:
        loop = asyncio.get_running_loop()
        peer = await aio.connect(args.addr, args.port, "bench-receiver", bytes.fromhex(args.secret))
        keys = chunk_keys(manifest["model"], [t for c in manifest["chunks"] for t in c["tokens"]],
                          manifest["chunk_tokens"])  # the keys a daemon would ask for
        t0 = loop.time()
        # Tell the sender how fast this host decodes entropy-coded chunks (its pool, measured
        # when the data was prepared), so it can weigh decode time against link time.
        chunk_mb = manifest["chunks"][0]["bytes"]["fp16"] / 1e6
        decode_mbps = chunk_mb / statistics.median(c["decode_s"]["balanced"] for c in manifest["chunks"])
        call = peer.fetch(Fetch.ask(keys, args.deadline_ms, levels, decode_mbps=decode_mbps))
        decoded: list[asyncio.Future] = []
        got, nbytes = [], 0

        def decode(msg) -> torch.Tensor:
            if msg.level in baselines.SCHEMES:
                return baselines.SCHEMES[msg.level].decode(msg.payload)
            return pool.decode(msg.payload)

        async def recompute(i: int, tokens: list[int]) -> torch.Tensor:
            prior = [await f for f in decoded[:i]]
            kv = torch.cat(prior, 2).float() if prior else None
            _, full = await asyncio.to_thread(models.prefill, lm, tokens, kv, all_logits=False)
            return full[:, :, full.shape[2] - len(tokens):]

        async for msg in call:
            if hasattr(msg, "payload"):
                nbytes += len(msg.payload)
                got.append(msg.level)
                decoded.append(asyncio.ensure_future(asyncio.to_thread(decode, msg)))
            else:
                nbytes += text_wire_bytes(msg.tokens, msg.req, msg.i)
                got.append(TEXT)
                decoded.append(asyncio.ensure_future(recompute(msg.i, msg.tokens)))
        kv = [await f for f in decoded]
        seconds = loop.time() - t0
        shapes_ok = all(k.shape[2] == len(c["tokens"]) for k, c in zip(kv, manifest["chunks"]))
        peer.close()
    print(json.dumps({"seconds": seconds, "levels": got, "bytes": nbytes, "complete": shapes_ok,
                      "deadline_missed": bool(call.end.deadline_missed) if call.end else None}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstreamd.bench.stream_peer")
    p.add_argument("role", choices=["serve", "fetch"])
    p.add_argument("--dir", required=True)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--secret", required=True, help="hex")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--addr")
    p.add_argument("--port", type=int, default=9400)
    p.add_argument("--deadline-ms", type=int, default=10_000)
    p.add_argument("--trace")
    p.add_argument("--dev")
    p.add_argument("--dppl", help="JSON map level -> measured Δppl %%")
    args = p.parse_args(argv)
    # The sender only moves bytes; the receiver recomputes TEXT chunks with every core, as a
    # serving host would (its decode pool has processes of its own).
    torch.set_num_threads(1 if args.role == "serve" else (os.cpu_count() or 1))
    aio.run(serve(args) if args.role == "serve" else fetch(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
