"""[api] metrics_listen: GET /metrics over TCP for a Prometheus server to scrape, and nothing
of the API; a bad value or a taken port stops start-up naming the key. Real sockets, daemons
in the test's event loop."""
from __future__ import annotations

import logging
import socket

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstreamd import config

from kvstreamd.node import daemon
from kvstreamd.config import ConfigError


async def get(d, method: str, path: str) -> tuple[int, str]:
    host, port = d.metrics_address
    async with aiohttp.ClientSession() as s:
        async with s.request(method, f"http://{host}:{port}{path}") as r:
            return r.status, await r.text()


async def test_metrics_listen_serves_the_metrics_over_tcp(inprocess):
    (a,) = await inprocess(["a"], peered=False, api={"metrics_listen": "127.0.0.1:0"})
    status, text = await get(a, "GET", "/metrics")
    assert status == 200
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"kvstreamd_fetch_seconds", "kvstreamd_peer_up", "kvstreamd_store_bytes"} <= names


async def test_metrics_listen_serves_nothing_of_the_api(inprocess):
    (a,) = await inprocess(["a"], peered=False, api={"metrics_listen": "127.0.0.1:0"})
    for method, path in (("GET", "/v1/status"), ("GET", "/v1/contexts"), ("POST", "/v1/fetch"),
                         ("DELETE", "/v1/contexts/" + "00" * 32), ("GET", "/healthz")):
        assert (await get(a, method, path))[0] in (404, 405), (method, path)


async def test_without_metrics_listen_there_is_no_tcp_listener(inprocess):
    (a,) = await inprocess(["a"], peered=False)
    assert a.cfg.api.metrics_listen is None and a.metrics_address is None


async def test_a_taken_metrics_port_stops_start_up_naming_the_key(tmp_path, caplog, small_profile):
    from kvstreamd.lab.daemons import DaemonProcess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = DaemonProcess("a", tmp_path / "a", extra={"api": {"metrics_listen": f"127.0.0.1:{port}"},
                                                          "codec": {"workers": 1, "chunk_tokens": 256}})
        node.root.mkdir(parents=True)
        node.config_path.write_text(node.config_text())
        caplog.set_level(logging.INFO)
        assert await daemon._main(config.load(node.config_path)) == 1  # noqa: SLF001 - `kvstreamd run` minus the loop
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot start")]
    assert line.startswith(f"cannot start: [api] metrics_listen 127.0.0.1:{port}: "), line


@pytest.mark.parametrize("value,fragment", [
    ('"nohost"', '"nohost" is not host:port'),
    ('"h:99999"', "port '99999' is not 0..65535"),
    ("9401", 'expected a string "host:port"'),
])
def test_a_bad_metrics_listen_names_the_file_and_key(tmp_path, value, fragment):
    path = tmp_path / "kvstreamd.toml"
    path.write_text(f"[api]\nmetrics_listen = {value}\n")
    with pytest.raises(ConfigError) as err:
        config.load(path, {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_STATE_HOME": str(tmp_path / "state")})
    msg = str(err.value)
    assert msg.startswith(f"{path}: [api] metrics_listen"), msg
    assert fragment in msg, msg

