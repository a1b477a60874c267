"""Seeded bandwidth traces, their files, and the simulation that plays a level-choice rule over
them (transport/traces.py)."""
from __future__ import annotations

import pytest

from tests.fixtures import DPPL, fixed, mbit
from transport import traces
from transport.bandwidth import Probe
from transport.policy import Choice


# --- traces and the simulation ----------------------------------------------------------------

def test_traces_are_seeded_log_uniform_in_5_to_500_mbit():
    trace = traces.generate(seed=7, chunks=2000)
    assert trace == traces.generate(seed=7, chunks=2000) != traces.generate(seed=8, chunks=2000)
    assert 5 <= min(trace) and max(trace) <= 500
    # log-uniform: half the draws below the geometric middle, 50 Mbit/s
    assert sum(v < 50 for v in trace) / len(trace) == pytest.approx(0.5, abs=0.04)


def test_trace_files_round_trip_and_bad_lines_are_named(tmp_path):
    path = tmp_path / "trace.txt"
    traces.save(path, [5.5, 100.0, 480.25])
    assert traces.load(path) == [5.5, 100.0, 480.25]
    path.write_text("# a comment\n10\n\nfast\n")
    with pytest.raises(ValueError, match=r"trace.txt:4: not a bandwidth"):
        traces.load(path)


def test_simulation_pipelines_decode_with_the_link():
    sizes, work = traces.smollm2_chunks(4)
    result = traces.simulate(fixed(["high"] * 4), [100.0] * 4, sizes, 10.0, work, DPPL)
    link = sizes["high"][0] / mbit(100)  # 0.36 s, longer than the 0.197 s decode
    probe = Probe().size / mbit(100)
    assert result.total_seconds == pytest.approx(probe + 4 * link + work["high"])
    assert result.levels == ("high",) * 4 and result.mean_dppl == 0.0 and result.deadline_met


def test_simulated_rule_sees_only_the_past():
    seen = []

    def rule(s):
        seen.append(s.bandwidth)
        return Choice("high", 0.0, "")

    sizes, work = traces.smollm2_chunks(3)
    traces.simulate(rule, [10.0, 100.0, 400.0], sizes, 10.0, work, DPPL)
    # The probe and chunk 0 both cross at 10 Mbit/s; chunk 1's rate is only known after it.
    assert seen == pytest.approx([mbit(10), mbit(10), 3 / (2 / mbit(10) + 1 / mbit(100))])
