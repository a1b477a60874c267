"""bench e2e's table and plot from a report (no daemons, no model): the grid's worst-run Δppl
and its TTFT-against-bandwidth panel."""
from __future__ import annotations

import pytest

from kvstreamd.bench import e2e


def _row(method: str, bw: float, tokens: int, ttft: float, dppl: float, run: int) -> dict:
    return {"method": method, "bandwidth_mbit": bw, "tokens": tokens, "ttft_s": ttft, "dppl_pct": dppl,
            "tokens_match": True, "first_token_match": True, "bytes": 0 if method == "recompute" else 10**6,
            "needed_token_layers": 1, "all_token_layers": 1, "needed_fp16_bytes": 1, "run": run,
            "levels": ["high"], "chunks": [{"i": 0, "level": "high", "kind": "kv", "bytes": 10**6, "seen_mbit": bw}]}


def _report(bandwidths: list[float]) -> dict:
    rows = [_row(m, bw, t, ttft * t / 4096 * (1 if m == "recompute" else 100 / bw + 0.1), dppl, r)
            for bw in bandwidths for t in (4096, 8192) for r, dppl in enumerate((0.2, 1.4, 0.1))
            for m, ttft in (("recompute", 10.0), ("fp16", 8.0), ("kvstreamd", 1.5))]
    return {"model": "m", "shaped": True, "trace": None, "runs": rows, "results": e2e.summarise(rows)}


def test_the_table_gives_the_worst_runs_dppl_beside_the_mean():
    report = _report([20.0, 100.0])
    row = next(r for r in report["results"] if r["method"] == "kvstreamd" and r["bandwidth_mbit"] == 20.0)
    assert row["dppl_pct"] == pytest.approx(0.567, abs=1e-3) and row["dppl_max_pct"] == 1.4
    assert "+1.40" in e2e.table(report)


@pytest.mark.parametrize("bandwidths", [[20.0, 100.0, 1000.0], [100.0]])
def test_the_plot_is_written_for_a_grid_and_for_one_link(tmp_path, bandwidths):
    path = tmp_path / "e2e.png"
    e2e.plot(_report(bandwidths), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
