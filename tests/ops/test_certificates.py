"""A node whose own TLS certificate has expired (or soon will) says so: at start-up, in
/healthz (degraded, reason "certificate"), in /v1/status and doctor, on GET /metrics for the
alert that fires days ahead, and its peers' refusals name the expiry."""
from __future__ import annotations

import datetime
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures import client, until
from kvstreamd.lab.certs import CA
from kvstreamd.ops import certificates, doctor

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CA(tmp_path_factory.mktemp("pki"), cn="kvstreamd test cluster CA", days=365)
    return {"ca": ca, "ok": ca.host("ok"), "expired": ca.host("expired", valid=(NOW - 30 * DAY, NOW - DAY)),
            "soon": ca.host("soon", valid=(NOW - 30 * DAY, NOW + 5 * DAY)),
            "early": ca.host("early", valid=(NOW + 2 * DAY, NOW + 90 * DAY))}


def tls_section(cert) -> dict:
    return {"tls_cert": str(cert.cert), "tls_key": str(cert.key), "tls_ca": str(cert.ca)}


def gauge(text: str, name: str) -> float:
    (value,) = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]
    return value


async def test_an_expired_certificate_is_said_at_start_up_in_healthz_status_doctor_and_metrics(inprocess, pki,
                                                                                                 caplog):
    caplog.set_level(logging.INFO)
    (a,) = await inprocess(["a"], peer=tls_section(pki["expired"]))
    said = [r for r in caplog.records if r.name == "kvstreamd.ops.certificates"]
    errors = [r.getMessage() for r in said if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "[peer] tls_cert" in errors[0] and "expired on" in errors[0], errors
    async with client(a) as ca:
        health = await ca.health()
        status = await ca.status()
        metrics = await ca.metrics()
    assert health["status"] == "degraded"
    assert [f["reason"] for f in health["degraded"]] == ["certificate"]
    assert "expired" in health["degraded"][0]["message"]
    files = {f["setting"]: f for f in status["certificate"]["files"]}
    assert files["[peer] tls_cert"]["state"] == "expired" and files["[peer] tls_cert"]["days_left"] < 0
    assert files["[peer] tls_ca"]["state"] == "valid"
    check = doctor.certificate(status["certificate"])
    assert check.status == doctor.FAIL and "expired" in check.figure
    assert gauge(metrics, "kvstreamd_tls_expiry_timestamp_seconds") == pytest.approx((NOW - DAY).timestamp(), abs=2)
    degraded = {s.labels["reason"]: s.value for fam in text_string_to_metric_families(metrics)
                for s in fam.samples if s.name == "kvstreamd_degraded"}
    assert degraded["certificate"] == 1


async def test_the_peer_refusing_an_expired_certificate_says_it_expired(inprocess, pki, caplog):
    (b,) = await inprocess(["b"], peer=tls_section(pki["ok"]))
    (a,) = await inprocess(["a"], peer=tls_section(pki["expired"]))
    a.peers.set_peers([("127.0.0.1", b.peers.port)])
    async def refused() -> bool:
        return b.peers.server.tls_refused > 0

    await until("b refuses a's certificate", refused)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("refused" in m and "expired" in m for m in said), said
    assert a.peers.connected() == []


async def test_a_certificate_ending_within_the_warning_days_warns_but_is_not_degraded(inprocess, pki, caplog):
    caplog.set_level(logging.INFO)
    (a,) = await inprocess(["a"], peer=tls_section(pki["soon"]))
    warned = [r.getMessage() for r in caplog.records
              if r.name == "kvstreamd.ops.certificates" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "expires on" in warned[0] and "in 5.0 days" in warned[0], warned
    async with client(a) as ca:
        assert (await ca.health())["status"] == "ok"
        check = doctor.certificate((await ca.status())["certificate"])
    assert check.status == doctor.WARN and check.data["[peer] tls_cert"]["state"] == certificates.EXPIRES_SOON


async def test_a_certificate_not_valid_yet_is_degraded_and_names_the_clock(inprocess, pki):
    (a,) = await inprocess(["a"], peer=tls_section(pki["early"]))
    async with client(a) as ca:
        health = await ca.health()
    assert [f["reason"] for f in health["degraded"]] == ["certificate"]
    assert "not valid before" in health["degraded"][0]["message"] and "clock" in health["degraded"][0]["message"]


async def test_plaintext_links_have_no_certificate_to_watch(inprocess):
    (a,) = await inprocess(["a"])
    async with client(a) as ca:
        status = await ca.status()
        metrics = await ca.metrics()
    assert status["certificate"] is None and status["health"]["status"] == "ok"
    assert doctor.certificate(status["certificate"]).status == doctor.OK
    assert gauge(metrics, "kvstreamd_tls_expiry_timestamp_seconds") == 0
