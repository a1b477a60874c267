"""A/B of a level policy on a fraction of fetches: the arm of a request (a stable hash, so a
retry stays in its arm), `[policy] experiment` and its errors, the FETCH `rule` a sender obeys
or refuses, the outcome log, `kvstreamd ab report`'s verdicts on simulated fetches, and a real
daemon pair whose candidate arm shows in /metrics, /v1/ab and the chunks' levels."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import until
from kvstreamd.ops import ab_report
from kvstreamd.client import AsyncClient
from kvstreamd.config import ConfigError, load
from kvstreamd.experiment import CANDIDATE, CONTROL, Experiment
from kvstreamd.ops.outcomes import FetchOutcomes, Outcome, read_file
from transport import aio, messages
from transport.messages import BAD_MESSAGE, Fetch

REPO = Path(__file__).resolve().parents[2]
MODEL = "synthetic-test-model"  # the inprocess fixture's profile
SECRET = b"cluster-test-secret"  # kvstreamd.lab.daemons.DaemonProcess's [peer] secret
FETCHES = 2000


def prompts(n: int = FETCHES, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of 64..512 token ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 49152, int(rng.integers(64, 512))).tolist() for _ in range(n)]


# -- the arm of a request ------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.01, 0.5])
def test_the_candidate_share_of_2000_fetches_is_within_binomial_bounds(fraction):
    exp = Experiment(fraction, "cachegen")
    k = sum(exp.arm(MODEL, p) == CANDIDATE for p in prompts())
    sigma = math.sqrt(FETCHES * fraction * (1 - fraction))
    assert abs(k - FETCHES * fraction) <= 4.5 * sigma, (k, FETCHES * fraction, sigma)


@pytest.mark.parametrize("fraction", [0.01, 0.5])
def test_a_retry_lands_in_the_arm_of_its_first_try(fraction):
    exp = Experiment(fraction, "cachegen")
    first = [exp.arm(MODEL, p) for p in prompts()]
    again = [exp.arm(MODEL, list(p)) for p in reversed(prompts())][::-1]  # fresh lists, other order
    assert first == again
    assert CANDIDATE in first and CONTROL in first


@pytest.mark.system  # a Python subprocess
def test_a_request_keeps_its_arm_in_another_process_with_another_hash_seed(tmp_path):
    """What a daemon restart is to the arm: a new interpreter, another str hash seed."""
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts(300)))
    here = [Experiment(0.5, "cachegen").arm(MODEL, p) for p in prompts(300)]
    code = ("import json, sys; from kvstreamd.experiment import Experiment; "
            f"print(json.dumps([Experiment(0.5, 'cachegen').arm({MODEL!r}, p) for p in json.load(open(sys.argv[1]))]))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}, timeout=60)
    assert json.loads(out.stdout) == here


def test_the_same_prompt_for_another_model_is_assigned_afresh():
    exp = Experiment(0.5, "cachegen")
    ps = prompts(200)
    assert [exp.arm(MODEL, p) for p in ps] != [exp.arm("another-model", p) for p in ps]


def test_no_experiment_puts_every_fetch_in_control():
    assert {Experiment().arm(MODEL, p) for p in prompts(200)} == {CONTROL}


# -- [policy] experiment -------------------------------------------------------------------------

def test_an_experiment_is_read_from_a_policy_table(env, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[policy.experiment]\nfraction = 0.01\nrule = "cachegen"\nlevels = ["balanced", "fast"]\n')
    assert load(path, env).policy.experiment == Experiment(0.01, "cachegen", ("balanced", "fast"))


def test_no_config_means_no_experiment(env):
    assert load(None, env).policy.experiment.fraction == 0


@pytest.mark.parametrize("table,where,fragment", [
    ("{ fraction = 1.5, rule = \"cachegen\" }", "experiment.fraction", "1.5 is not a share of fetches"),
    ("{ fraction = -0.1, rule = \"cachegen\" }", "experiment.fraction", "is not a share of fetches"),
    ("{ fraction = true, rule = \"cachegen\" }", "experiment.fraction", "is not a share of fetches"),
    ("{ fraction = 0.1, rule = \"greedy\" }", "experiment.rule", '"greedy" is not a rule (known: adaptive, cachegen)'),
    ("{ fraction = 0.1, levels = [\"hihg\"] }", "experiment.levels", '"hihg" is not a level'),
    ("{ fraction = 0.1, rule = \"cachegen\", share = 2 }", "experiment.share", "unknown key"),
    ("{ fraction = 0.1 }", "experiment", "neither rule nor levels"),
    ("0.1", "experiment", "expected a table"),
])
def test_a_bad_experiment_is_refused_naming_file_and_key(env, tmp_path, table, where, fragment):
    path = tmp_path / "c.toml"
    path.write_text(f"[policy]\nexperiment = {table}\n")
    with pytest.raises(ConfigError) as err:
        load(path, env)
    assert str(err.value).startswith(f"{path}: [policy] {where}"), str(err.value)
    assert fragment in str(err.value), str(err.value)


def test_the_experiment_is_reloadable(env, tmp_path):
    from kvstreamd.config import reloadable_changes
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("")
    b.write_text('[policy]\nexperiment = { fraction = 0.5, rule = "cachegen" }\n')
    assert reloadable_changes(load(a, env), load(b, env)) == (["[policy] experiment"], [])


# -- the outcome log -----------------------------------------------------------------------------

def outcome(i: int, arm: str = CONTROL, seconds: float = 0.5) -> Outcome:
    return Outcome.of(1.7e9 + i, arm, "fraction=0.5 rule=cachegen levels=-", seconds, False, ["balanced", "fast"],
                      1000 + i, 512)


def test_the_outcome_log_keeps_the_latest_records_across_a_restart_within_its_bound(tmp_path):
    path = tmp_path / "ab-fetches.jsonl"
    log = FetchOutcomes(path, max_records=100)
    for i in range(350):
        log.add(outcome(i))
    again = FetchOutcomes(path, max_records=100)
    assert [o.t for o in again.records] == [o.t for o in log.records] == [outcome(i).t for i in range(250, 350)]
    lines = [len(p.read_text().splitlines()) for p in (path, path.with_name(path.name + ".1"))]
    assert lines == [50, 100]  # the older file rotated away: the disk holds at most 2 x 100


def test_a_cut_short_last_line_is_skipped_and_the_rest_read(tmp_path):
    path = tmp_path / "ab-fetches.jsonl"
    log = FetchOutcomes(path)
    for i in range(3):
        log.add(outcome(i))
    with open(path, "a") as f:
        f.write('{"t": 1.7e9, "arm": "cont')
    assert len(read_file(path)) == 3


# -- ab report on simulated fetches ---------------------------------------------------------------

def simulated(fraction: float, slower: float, n: int = FETCHES, seed: int = 1) -> list[Outcome]:
    """n fetches of distinct prompts split by the real assignment; lognormal fetch times (median
    0.5 s, sigma 0.3), the candidate's `slower` x longer; 5% deadline misses in both arms."""
    rng = np.random.default_rng(seed)
    exp = Experiment(fraction, "cachegen")
    out = []
    for p in prompts(n, seed):
        arm = exp.arm(MODEL, p)
        s = rng.lognormal(math.log(0.5), 0.3) * (1 + slower if arm == CANDIDATE else 1)
        out.append(Outcome.of(0.0, arm, exp.label, s, bool(rng.random() < 0.05), ["balanced"] * 3, 3_000_000, 768))
    return out


def test_ab_report_finds_a_planted_20_percent_difference_in_fetch_time_significant():
    report = ab_report.compare(simulated(0.5, 0.20))
    assert report["significant"], report["verdict"]
    assert 0.12 < report["difference"]["median_s"]["relative"] < 0.28
    assert report["verdict"].startswith("significant")


def test_ab_report_finds_a_zero_difference_not_significant():
    report = ab_report.compare(simulated(0.5, 0.0))
    assert not report["significant"], report["verdict"]
    lo, hi = report["difference"]["median_s"]["ci"]
    assert lo < 0 < hi
    assert not report["difference"]["deadline_miss_rate"]["significant"]


def test_at_1_percent_of_2000_fetches_ab_report_says_it_needs_more_fetches():
    report = ab_report.compare(simulated(0.01, 0.20))
    assert not report["significant"]
    assert report["verdict"].startswith("not significant yet: the candidate arm has"), report["verdict"]


@pytest.mark.parametrize("slower,significant", [(0.20, True), (0.0, False)])
def test_at_1_percent_of_20000_fetches_ab_report_tells_a_planted_20_percent_from_none(slower, significant):
    report = ab_report.compare(simulated(0.01, slower, n=20_000))
    assert report["significant"] is significant, report["verdict"]


def test_ab_report_is_reproducible():
    data = simulated(0.5, 0.05)
    assert ab_report.compare(data) == ab_report.compare(data)


def test_ab_report_finds_a_planted_difference_in_deadline_misses_even_with_none_in_one_arm():
    data = [Outcome.of(o.t, o.arm, o.experiment, o.seconds, o.arm == CANDIDATE and i % 5 == 0, {}, 0, 0)
            for i, o in enumerate(simulated(0.5, 0.0))]
    d = ab_report.compare(data)["difference"]["deadline_miss_rate"]
    assert d["significant"] and d["ci"][0] > 0.1


def test_ab_report_compares_only_the_latest_experiments_outcomes():
    old = [Outcome.of(0.0, CANDIDATE, "fraction=0.5 rule=adaptive levels=fast", 9.0, True, {}, 0, 0)] * 50
    report = ab_report.compare(old + simulated(0.5, 0.0))
    assert report["other_experiments_skipped"] == 50
    assert report["arms"][CANDIDATE]["deadline_miss_rate"] < 0.2


@pytest.mark.system  # a subprocess of the CLI
def test_ab_report_from_a_recorded_log_on_the_command_line(tmp_path):
    path = tmp_path / "ab-fetches.jsonl"
    log = FetchOutcomes(path)
    for o in simulated(0.5, 0.20):
        log.add(o)
    run = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "ab", "report", "--from", str(path), "--json"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["significant"] and report["arms"][CANDIDATE]["levels"] == {"balanced": 1.0}


def test_ab_report_prints_a_table_with_the_verdict(tmp_path, capsys):
    from kvstreamd.cli import main
    path = tmp_path / "ab-fetches.jsonl"
    log = FetchOutcomes(path)
    for o in simulated(0.5, 0.0):
        log.add(o)
    assert main(["ab", "report", "--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "median fetch time" in out and "95% CI" in out
    assert out.rstrip().splitlines()[-1].startswith("not significant")


def test_ab_report_from_a_missing_file_says_so(capsys):
    from kvstreamd.cli import main
    assert main(["ab", "report", "--from", "/nonexistent/ab.jsonl"]) == 2
    assert "--from /nonexistent/ab.jsonl: No such file" in capsys.readouterr().err


# -- FETCH rule ----------------------------------------------------------------------------------

def test_a_fetch_rule_crosses_the_wire_and_a_non_string_one_is_a_bad_message():
    msg = Fetch(1, [b"k" * 32], 1000, ["balanced"], rule="cachegen")
    assert messages.from_wire(messages.to_wire(msg)) == msg
    assert "rule" not in messages.to_wire(Fetch(1, [b"k" * 32], 1000, ["balanced"]))
    with pytest.raises(messages.ProtocolError, match=r"FETCH\.rule: expected a string"):
        messages.from_wire({**messages.to_wire(msg), "rule": 3})


async def _holder_with_a_context(inprocess, tokens: int = 768):
    from tests.fixtures import synthetic_kv
    (a,) = await inprocess(["a"])
    toks = list(range(5000, 5000 + tokens))
    async with AsyncClient(a.cfg.api.socket, timeout=60) as c:
        put = await c.put(MODEL, toks, synthetic_kv(tokens, seed=3).half())
        port = (await c.status())["peer_port"]
    conn = await aio.connect("127.0.0.1", port, "fetcher", SECRET)
    return a, conn, [bytes.fromhex(k) for k in put["keys"]]


async def _levels(conn, keys, **kw) -> list[str]:
    return [m.level if hasattr(m, "level") else "text"
            async for m in conn.fetch(Fetch.ask(keys, 30_000, ["high", "balanced", "fast", "text"], **kw))]


async def test_a_sender_uses_the_rule_a_fetch_names(inprocess):
    """With decode priced far above recompute, kvstreamd's rule sends TEXT (it counts the
    receiver's work) and CacheGen's sends the best level that crosses in time (it does not)."""
    a, conn, keys = await _holder_with_a_context(inprocess)
    try:
        slow_decode = {"decode_mbps": 0.001, "recompute_tps": 1e9}
        assert await _levels(conn, keys, rule="cachegen", **slow_decode) == ["high"] * len(keys)
        assert await _levels(conn, keys, **slow_decode) == ["text"] * len(keys)
        assert await _levels(conn, keys, rule="adaptive", **slow_decode) == ["text"] * len(keys)
    finally:
        conn.close()


async def test_a_sender_refuses_an_unknown_rule_and_serves_the_next_fetch(inprocess):
    a, conn, keys = await _holder_with_a_context(inprocess)
    try:
        with pytest.raises(aio.FetchFailed) as err:
            await _levels(conn, keys, rule="greedy")
        assert err.value.code == BAD_MESSAGE
        assert "FETCH.rule: 'greedy' is not a level rule this node knows (known: adaptive, cachegen)" in err.value.msg
        assert len(await _levels(conn, keys)) == len(keys)
    finally:
        conn.close()


# -- a real daemon pair --------------------------------------------------------------------------

def _count(metrics: str, name: str, arm: str) -> float:
    m = re.search(rf'^{name}\{{arm="{arm}"\}} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


async def test_a_daemon_pair_runs_both_arms_and_the_candidate_ladder_reaches_the_sender(inprocess, caplog):
    from tests.fixtures import synthetic_kv
    exp = {"fraction": 0.5, "rule": "cachegen", "levels": ["fast"]}
    a, b = await inprocess(["a", "b"], per_node={"b": {"policy": {"experiment": exp}}})
    arm_of = b.cfg.policy.experiment.arm
    contexts = [list(range(s, s + 512)) for s in range(10_000, 10_000 + 40 * 1000, 1000)]
    chosen = ([t for t in contexts if arm_of(MODEL, t) == CANDIDATE][:3]
              + [t for t in contexts if arm_of(MODEL, t) == CONTROL][:3])
    assert len(chosen) == 6
    caplog.set_level(logging.INFO, logger="kvstreamd.cluster.serving")
    async with AsyncClient(a.cfg.api.socket, timeout=60) as ca, AsyncClient(b.cfg.api.socket, timeout=60) as cb:
        for i, toks in enumerate(chosen):
            await ca.put(MODEL, toks, synthetic_kv(512, seed=i).half())
        for toks in chosen:  # until b sees each at a
            for _ in range(200):
                if (await cb.lookup(MODEL, toks))["peers"].get("a") == 512:
                    break
                await asyncio.sleep(0.05)
        levels = {}
        for toks in chosen:
            async with await cb.fetch(MODEL, toks, deadline_ms=30_000) as f:
                levels[arm_of(MODEL, toks)] = levels.get(arm_of(MODEL, toks), []) + [ev.level async for ev in f]
        metrics = await cb.metrics()
        ab = await cb.ab()
    assert set(levels[CANDIDATE]) == {"fast"}, levels
    assert set(levels[CONTROL]) != {"fast"}, levels
    for arm in (CANDIDATE, CONTROL):
        assert _count(metrics, "kvstreamd_fetch_seconds_count", arm) == 3
        assert _count(metrics, "kvstreamd_fetch_bytes_total", arm) > 0
    assert f'kvstreamd_fetch_chunks_total{{arm="candidate",level="fast"}} {len(levels[CANDIDATE])}.0' in metrics
    assert sorted(o["arm"] for o in ab["outcomes"]) == [CANDIDATE] * 3 + [CONTROL] * 3
    assert ab["experiment"]["rule"] == "cachegen"

    def served(rule: str) -> int:
        return sum(m.startswith("served ") and f"(rule {rule})" in m for m in (r.getMessage() for r in caplog.records))

    async def each_logged() -> bool:  # a logs a FETCH served once its END is out: b may have ended first
        return served("cachegen") >= 3 and served("adaptive") >= 3

    await until("a to log each FETCH it served with the rule b asked for", each_logged, timeout=5)
