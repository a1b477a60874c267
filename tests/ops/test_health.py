"""The health thresholds (kvstreamd/ops/health.py) as GET /v1/status and `kvstreamd status` show
them: ok / warn past a bound with what to check, "no data" before there is any, judged over
the node's own latest fetches. Daemons in the test's event loop, the CLI as a real process."""
from __future__ import annotations

import asyncio
import json
import sys

import pytest

from tests.fixtures import synthetic_kv
from kvstreamd.ops import health
from kvstreamd.client import AsyncClient

MODEL = "synthetic-test-model"


def test_a_value_past_a_bound_warns_with_what_to_check():
    j = health.judge(health.TIME_TO_FIRST_TOKEN, 2.5)
    assert (j["status"], j["value"], j["reads"], j["ok_when"]) == ("warn", 2.5, "2.5 s", "< 2 s")
    assert j["check"] == health.TIME_TO_FIRST_TOKEN.bounds[0].check


def test_a_value_on_its_bound_is_ok():
    j = health.judge(health.COMPRESSION_RATIO, {"high": 3.0, "fast": 11.5})
    assert (j["status"], j["reads"], j["ok_when"]) == ("ok", "high 3:1, fast 11.5:1", "> 3:1")
    assert "check" not in j


def test_one_link_past_either_side_of_the_range_warns_with_that_side_checks():
    under, saturated = health.LINK_UTILISATION.bounds
    j = health.judge(health.LINK_UTILISATION, {"b": 0.7, "c": 0.9})
    assert (j["status"], j["ok_when"], j["reads"]) == ("warn", "60% to 80%", "b 70%, c 90%")
    assert j["check"] == saturated.check
    j = health.judge(health.LINK_UTILISATION, {"b": 0.3, "c": 0.9})
    assert j["check"] == f"{under.check} {saturated.check}"


def test_no_value_is_no_data_not_ok():
    assert health.judge(health.DECODE_SHARE, None)["status"] == "no data"
    assert health.judge(health.LINK_UTILISATION, {})["status"] == "no data"


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


async def test_status_shows_every_threshold_as_no_data_before_any_fetch_or_put(inprocess):
    (a,) = await inprocess(["a"], peered=False)
    async with client(a) as ca:
        th = (await ca.status())["thresholds"]
    assert set(th) == {t.name for t in health.THRESHOLDS}
    assert {n: j["status"] for n, j in th.items()} == {t.name: "no data" for t in health.THRESHOLDS}


async def test_status_judges_the_fetch_thresholds_over_the_fetches_the_node_made(inprocess):
    (a,) = await inprocess(["a"], peered=False)
    tokens = list(range(1000, 1600))
    async with client(a) as ca:
        await ca.put(MODEL, tokens, synthetic_kv(600).half())
        async with await ca.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            end = await f.wait()
        th = (await ca.status())["thresholds"]
    ttft = th["time_to_first_token"]
    assert ttft["value"] == end.timings["total_s"] and ttft["fetches"] == 1  # p95 of one fetch
    assert ttft["status"] == ("warn" if ttft["value"] > 2 else "ok")
    # (the End event rounds both times to 0.1 ms, so their quotient is only close)
    assert th["decode_share"]["value"] == pytest.approx(end.timings["decode_s"] / end.timings["total_s"], rel=0.05)
    assert set(th["compression_ratio"]["value"]) == {"high", "balanced", "fast"}
    assert th["link_utilisation"]["status"] == "no data"  # it sent nothing to a peer


async def test_kvstreamd_status_prints_each_threshold_with_its_state_and_value(inprocess):
    (a,) = await inprocess(["a"], peered=False)
    tokens = list(range(1000, 1600))
    async with client(a) as ca:
        await ca.put(MODEL, tokens, synthetic_kv(600).half())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvstreamd.cli", "status", "--socket", str(a.cfg.api.socket),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    ratio = json.loads(out)["thresholds"]["compression_ratio"]
    assert ratio["status"] in ("ok", "warn") and set(ratio["value"]) == {"high", "balanced", "fast"}
    assert ratio["status"] == ("warn" if min(ratio["value"].values()) < 3 else "ok")
