"""`kvstreamd bench stream`: real KV chunks of the real model sent between two test hosts
over a tbf-shaped veth link, per method: raw fp16, int8, text (recompute), CacheGen's rule
and kvstreamd's adaptive rule; at fixed bandwidths and on CacheGen-style bandwidth traces."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from transport import traces as tracegen

from .. import models
from ..lab import netns
from . import stream_data, write_json
from .stream_peer import METHODS

PORT = 9400


def _dppl_table(codec_json: Path) -> dict[str, float]:
    """Measured Δppl per level from the codec benchmark, when it has been run; the catalog's
    figures otherwise."""
    from codec.tuning import catalog

    table = catalog.dppl_table(catalog.names())
    if codec_json.is_file():
        for r in json.loads(codec_json.read_text())["results"]:
            name = r["scheme"].split(":", 1)[-1]
            if name in table:
                table[name] = max(0.0, r["ppl_delta_pct"])  # below zero is noise, not a gain
    return table


def one_run(link: netns.Link, data_dir: Path, method: str, deadline_ms: int, dppl: dict,
            trace: list[float] | None = None, timeout: float = 300) -> dict:
    secret = os.urandom(16).hex()
    peer = [sys.executable, "-m", "kvstreamd.bench.stream_peer"]
    common = ["--dir", str(data_dir), "--method", method, "--secret", secret, "--port", str(PORT)]
    serve_args = ["serve", *common, "--dppl", json.dumps(dppl), "--dev", link.dev["a"]]
    with tempfile.NamedTemporaryFile("w", suffix=".trace", delete=False) as f:
        if trace:
            f.write("\n".join(map(str, trace)))
            serve_args += ["--trace", f.name]
    server = link.popen("a", peer + serve_args, stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{method}: the sender did not start")
        out = subprocess.run(link.command("b", peer + ["fetch", *common, "--addr", link.addr["a"],
                                                       "--deadline-ms", str(deadline_ms)]),
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{method}: the receiver failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        tail = server.stdout.readline().strip()
        result["reasons"] = json.loads(tail)["reasons"] if tail else []
        return result
    finally:
        server.kill()
        server.wait()
        os.unlink(f.name)


def _summary(method: str, bw: float | None, tokens: int, runs: list[dict], dppl: dict, deadline_ms: int) -> dict:
    seconds = statistics.median(r["seconds"] for r in runs)
    levels = runs[len(runs) // 2]["levels"]
    nbytes = statistics.median(r["bytes"] for r in runs)
    out = {"method": method, "bandwidth_mbit": bw, "tokens": tokens, "seconds": round(seconds, 3),
           "dppl_pct": round(statistics.mean(dppl[lv] for lv in levels), 3),
           "deadline_met": seconds * 1000 <= deadline_ms, "deadline_ms": deadline_ms, "levels": levels,
           "bytes": int(nbytes), "runs": len(runs)}
    if bw:
        out["link_utilisation"] = round(min(1.0, nbytes * 8 / (seconds * bw * 1e6)), 3)
    return out


def _save(json_path: str | None, report: dict) -> None:
    write_json(report, json_path)


def run(bandwidths: list[float], tokens: int = 4096, runs: int = 3, deadline_ms: int | None = None,
        trace_file: str | None = None, n_traces: int = 0, methods: list[str] | None = None,
        trace_deadline_ms: int | None = None, json_path: str | None = None, log=print,
        model: str | None = None, profile: str | None = None) -> dict:
    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"bench stream needs network namespaces: {why}")
    methods = methods or METHODS
    deadline_ms = deadline_ms or tokens // 2  # 0.5 s per 1024 tokens
    # On traces (5-500 Mbit/s per chunk) a 0.5 s/chunk deadline is out of reach for every rule
    # on most traces; 1.5 s/chunk is where the choice of levels decides the outcome.
    trace_deadline_ms = trace_deadline_ms or tokens * 3 // 2
    data_dir = Path("bench-out") / f"stream-{Path(model or models.DEFAULT).name}-{tokens}"
    if profile:  # chunks coded with another profile are prepared apart
        data_dir = data_dir.with_name(f"{data_dir.name}-{Path(profile).stem}")
    if not (data_dir / "manifest.json").is_file():
        log(f"preparing {tokens}-token context chunks in {data_dir}")
        stream_data.prepare(data_dir, tokens=tokens, log=log, model=model, profile_path=profile)
    dppl = _dppl_table(Path("bench-out/codec.json"))
    results = []
    for bw in bandwidths:
        with netns.Link(rate_mbit=bw) as link:
            for method in methods:
                rs = [one_run(link, data_dir, method, deadline_ms, dppl) for _ in range(runs)]
                r = _summary(method, bw, tokens, rs, dppl, deadline_ms)
                log(f"  {bw:5g} Mbit/s {method:14s} {r['seconds']:7.2f} s  dppl {r['dppl_pct']:.2f}%  "
                    f"levels {' '.join(r['levels'])}")
                results.append(r)
                _save(json_path, {"tokens": tokens, "deadline_ms": deadline_ms, "results": results, "partial": True})
    trace_list = []
    if trace_file:
        trace_list.append(("file", tracegen.load(trace_file)))
    n_chunks = -(-tokens // 1024)
    trace_list += [(f"seed{k}", tracegen.generate(k, n_chunks)) for k in range(n_traces)]
    trace_results = []
    for name, trace in trace_list:
        with netns.Link(rate_mbit=trace[0]) as link:
            for method in ("cachegen-rule", "adaptive"):
                r = _summary(method, None, tokens, [one_run(link, data_dir, method, trace_deadline_ms, dppl, trace)],
                             dppl, trace_deadline_ms)
                r["trace"] = name
                r["trace_mbit"] = [round(x, 1) for x in trace]
                log(f"  trace {name} {method:14s} {r['seconds']:6.2f} s met {r['deadline_met']}  "
                    f"dppl {r['dppl_pct']:.2f}%  levels {' '.join(r['levels'])}")
                trace_results.append(r)
    report = {"tokens": tokens, "deadline_ms": deadline_ms, "trace_deadline_ms": trace_deadline_ms,
              "results": results, "trace_results": trace_results}
    if trace_results:
        report["trace_summary"] = {m: {"deadline_met": sum(r["deadline_met"] for r in trace_results if r["method"] == m),
                                       "traces": sum(1 for r in trace_results if r["method"] == m),
                                       "mean_dppl_pct": round(statistics.mean(r["dppl_pct"] for r in trace_results
                                                                              if r["method"] == m), 3)}
                                   for m in ("cachegen-rule", "adaptive")}
    _save(json_path, report)
    return report


def table(report: dict) -> str:
    rows = ["| bandwidth | method | seconds to KV | Δppl | deadline met | link utilisation | levels |",
            "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        rows.append(f"| {r['bandwidth_mbit']:g} Mbit/s | {r['method']} | {r['seconds']:.2f} | {r['dppl_pct']:.2f}% | "
                    f"{'yes' if r['deadline_met'] else 'no'} | {r.get('link_utilisation', 0):.2f} | {' '.join(r['levels'])} |")
    if report.get("trace_summary"):
        rows += ["", "| rule | traces with deadline met | mean Δppl |", "|---|---|---|"]
        for m, s in report["trace_summary"].items():
            rows.append(f"| {m} | {s['deadline_met']} / {s['traces']} | {s['mean_dppl_pct']:.2f}% |")
    return "\n".join(rows)
