"""The demo, shortened, end to end as `make demo` runs it: two daemons as two hosts (network
namespaces and a shaped veth pair as root, loopback otherwise), the real model storing a context
on host a and answering on host b by recompute, fp16, int8 and kvstreamd."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.system  # a subprocess of the CLI: the demo's daemon processes and the real model


def test_short_demo_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "demo", "--tokens", "700", "--chunk-tokens", "256",
                          "--bandwidth", "50mbit", "--deadline-ms", "3000", "--quiet",
                          "--json", str(tmp_path / "demo.json"), "--plot", str(tmp_path / "demo.png")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "demo.json").read_text())
    by = {r["method"]: r for r in report["results"]}
    assert set(by) == {"recompute", "fp16", "int8", "kvstreamd"}
    runs = {r["method"]: r for r in report["runs"]}
    # every fetch found the whole stored context (its last chunk is partial: 700 = 2 x 256 + 188)
    for m in ("fp16", "int8", "kvstreamd"):
        assert runs[m]["found_tokens"] == 700, runs[m]
        assert len(runs[m]["levels"]) == 3
    assert runs["fp16"]["levels"] == ["fp16"] * 3 and runs["int8"]["levels"] == ["int8"] * 3
    assert by["fp16"]["dppl_pct"] < 0.1 and by["int8"]["dppl_pct"] < 1.0
    assert by["kvstreamd"]["dppl_pct"] < 2.0
    assert by["kvstreamd"]["bytes"] < by["int8"]["bytes"] < by["fp16"]["bytes"]
    assert runs["fp16"]["tokens_match"]  # lossless KV answers exactly as recompute does
    for m in ("fp16", "int8", "kvstreamd"):  # when the model process read each event, and the end after them
        seen = [c["seen_ms"] for c in runs[m]["chunks"]]
        assert len(seen) == 3 and seen == sorted(seen) and 0 < seen[-1] <= runs[m]["end_seen_s"] * 1000, runs[m]
        assert runs[m]["end_seen_s"] <= runs[m]["fetch_s"] and runs[m]["stage_s"]["total_s"] > 0
    assert all(r["ttft_s"] > 0 for r in report["results"])
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert "kvstreamd" in out.stdout and "TTFT" in out.stdout
