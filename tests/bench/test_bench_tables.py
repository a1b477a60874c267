"""`kvstreamd bench tables` on the shipped SmolLM2 profile, one repeat: the JSON holds each figure
(no timing assertions: how long a build takes is the benchmark's to report)."""
from __future__ import annotations

import json

from kvstreamd import cli
from tests.fixtures import REPO

SMOL = REPO / "codec" / "profiles" / "smollm2-135m-instruct.kvprofile"


def test_bench_tables_reports_start_scale_and_grid_per_profile(tmp_path, capsys):
    out = tmp_path / "tables.json"
    assert cli.main(["bench", "tables", "--profiles", str(SMOL), "--repeats", "1", "--json", str(out)]) == 0
    (p,) = json.loads(out.read_text())["profiles"]
    assert p["profile"] == SMOL.name and p["streams"] == 60 and p["levels"] == ["high", "balanced", "fast"]
    assert p["grid_scales"] > 10 and p["start_s"] > 0 and p["grid_s"] > 0
    assert abs(p["scale_s"] * p["grid_scales"] - p["grid_s"]) < 1e-9
    assert "| smollm2-135m-instruct.kvprofile | 60 |" in capsys.readouterr().out


def test_bench_tables_refuses_a_missing_profile_in_one_line(tmp_path, capsys):
    assert cli.main(["bench", "tables", "--profiles", str(tmp_path / "nope.kvprofile")]) == 2
    assert capsys.readouterr().err.strip() == f"kvstreamd bench tables: no profile file {tmp_path / 'nope.kvprofile'}"
