"""The alerting rules and dashboard (deploy/): promtool (Debian's `prometheus` package) checks the
rules and runs their unit tests, every alert is tested firing and not firing, the thresholds
they compare against are those of kvstreamd/ops/health.py, and every metric the rules and the
dashboard name is in a live daemon's GET /metrics. Fails, never skips, without promtool."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures import synthetic_kv
from kvstreamd.ops import health
from kvstreamd.client import AsyncClient, ClientError

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/kvstreamd.rules.yml"
RULE_TESTS = ROOT / "deploy/prometheus/kvstreamd.rules.test.yml"
DASHBOARD = ROOT / "deploy/grafana/kvstreamd.json"
MODEL = "synthetic-test-model"
METRIC = re.compile(r"\bkvstreamd_[a-z0-9_]+")  # (recording rules are kvstreamd:..., with colons)
COMPARISON = re.compile(r"([<>]=?|==|!=)\s*(-?[0-9.]+(?:e-?[0-9]+)?)")


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool is not installed: apt-get install prometheus (make install does)"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alerts(path: Path = RULES) -> dict[str, dict]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def words(text: str) -> str:
    return " ".join(text.split())


# -- promtool ----------------------------------------------------------------------------------

@pytest.mark.system  # promtool
def test_promtool_accepts_the_rules_file():
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.system  # promtool
def test_promtool_unit_tests_of_the_rules_pass():
    r = promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not():
    fired, quiet = set(), set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fired if t["exp_alerts"] else quiet).add(t["alertname"])
    names = set(alerts())
    assert names - fired == set(), "alerts no test fires"
    assert names - quiet == set(), "alerts no test holds quiet"
    assert (fired | quiet) - names == set(), "tests of alerts that do not exist"


@pytest.mark.system  # promtool
@pytest.mark.parametrize("bound", [b for t in health.THRESHOLDS for b in t.bounds], ids=lambda b: b.alert)
def test_the_unit_tests_fail_when_a_threshold_moves(tmp_path, bound):
    """The tests pin each threshold: moved well past their series (x10 up, /10 down), they fail."""
    moved = bound.limit * 10 if bound.op == ">" else bound.limit / 10
    doc = yaml.safe_load(RULES.read_text())
    (rule,) = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == bound.alert]
    rule["expr"], n = COMPARISON.subn(f"{bound.op} {moved:g}", rule["expr"], count=1)
    assert n == 1
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    assert promtool("check", "rules", RULES.name, cwd=tmp_path).returncode == 0
    r = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert r.returncode != 0 and bound.alert in r.stdout + r.stderr


@pytest.mark.system  # promtool
def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each panel's query (Grafana's variables set as Grafana would) parses as PromQL: promtool
    checks it as a recording rule."""
    exprs = [t["expr"].replace("$__rate_interval", "5m").replace("$instance", ".*")
             for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    assert exprs
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump(rules))
    r = promtool("check", "rules", "dashboard.rules.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


# -- one definition of each threshold --------------------------------------------------------

@pytest.mark.parametrize("threshold", health.THRESHOLDS, ids=lambda t: t.name)
def test_each_threshold_alert_compares_against_the_bound_in_health_py(threshold):
    rules = alerts()
    for b in threshold.bounds:
        assert b.alert in rules, f"{b.alert} is not in {RULES.name}"
        expr = rules[b.alert]["expr"]
        m = COMPARISON.search(expr)  # the first: what the alert is about (others may filter)
        assert m, f"{b.alert}: no comparison with a number in {expr!r}"
        assert (m.group(1), float(m.group(2))) == (b.op, b.limit), b.alert


@pytest.mark.parametrize("threshold", health.THRESHOLDS, ids=lambda t: t.name)
def test_each_threshold_alert_tells_the_operator_the_checks_in_health_py(threshold):
    rules = alerts()
    for b in threshold.bounds:
        assert words(rules[b.alert]["annotations"]["description"]) == words(b.check), b.alert


@pytest.mark.parametrize("threshold", health.THRESHOLDS, ids=lambda t: t.name)
def test_the_dashboard_marks_each_threshold_at_the_bounds_in_health_py(threshold):
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"]
              if p.get("description", "").startswith(f"Threshold {threshold.name}:")]
    assert len(panels) == 1, f"no one dashboard panel for {threshold.name}"
    steps = panels[0]["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert sorted(s["value"] for s in steps if s["value"] is not None) == sorted(b.limit for b in threshold.bounds)


# -- the metrics the rules and the dashboard name exist -------------------------------------------

def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


def named_metrics() -> dict[str, set[str]]:
    return {RULES.name: set(METRIC.findall(RULES.read_text())),
            DASHBOARD.name: set(METRIC.findall(DASHBOARD.read_text()))}


async def live_samples(inprocess) -> set[str]:
    """The sample names (with _total, _bucket, ...) two peered daemons export once a has put
    a context, b has fetched it from a, and a has answered a request with an error."""
    a, b = await inprocess(["a", "b"])
    tokens = list(range(1000, 1600))
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, synthetic_kv(600).half())
        for _ in range(400):  # until b has a's key list
            if (await cb.lookup(MODEL, tokens))["found_tokens"] == 600:
                break
            await asyncio.sleep(0.05)
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            end = await f.wait()
        assert end.kv_tokens == 600
        with pytest.raises(ClientError):
            await ca.delete_context("00" * 32)  # api_not_found: an error of a kind
        texts = [await ca.metrics(), await cb.metrics()]
    return {s.name for text in texts for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_every_metric_the_rules_and_the_dashboard_name_is_on_a_live_daemon(inprocess):
    named = named_metrics()
    assert all(named.values())  # (the pattern finds names at all)
    exported = await live_samples(inprocess)
    missing = {f: sorted(n - exported) for f, n in named.items() if n - exported}
    assert missing == {}


async def test_peer_up_is_1_for_a_reachable_configured_peer_and_0_for_one_that_refuses(inprocess):
    (b,) = await inprocess(["b"], peered=False)
    async with client(b) as cb:
        alive = f"127.0.0.1:{(await cb.status())['peer_port']}"
    with socket.socket() as closed:  # bound, never listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
        (a,) = await inprocess(["a"], peered=False, per_node={"a": {"peer": {"peers": [alive, dead]}}})
        async with client(a) as ca:
            for _ in range(400):
                up = {s.labels["peer"]: s.value for fam in text_string_to_metric_families(await ca.metrics())
                      if fam.name == "kvstreamd_peer_up" for s in fam.samples}
                if up.get(alive) == 1:
                    break
                await asyncio.sleep(0.05)
    assert up == {alive: 1.0, dead: 0.0}



def test_the_certificate_alert_fires_the_days_ahead_that_certificates_py_warns():
    from kvstreamd.ops import certificates

    expr = alerts()["KvstreamdCertificateExpiresSoon"]["expr"]
    (ahead,) = re.findall(r"time\(\)\s*<\s*([0-9.]+)", expr)
    assert float(ahead) == certificates.EXPIRES_SOON_DAYS * 86400
