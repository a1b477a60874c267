"""Peer links over TLS ([peer] tls_cert, tls_key, tls_ca): a real CA and host certificates made
with `cryptography` in tmp_path (kvstreamd.lab.certs), real endpoints on 127.0.0.1, on both
event loops the daemon may run (asyncio's and uvloop's). A peer without a certificate from the
cluster CA is refused before any frame: the server's PeerConnection never gets a byte, the
server logs why, the dialler gets a clear error. Then the config rules and two in-process
daemons that fetch over TLS."""
from __future__ import annotations

import asyncio
import logging
import ssl

import pytest

from kvstreamd import config
from kvstreamd.config import ConfigError
from kvstreamd.lab.certs import CA
from transport import aio, tls
from transport.protocol import State
from transport.messages import Fetch

SECRET = b"tls-test-cluster-secret"
HOST = "127.0.0.1"
LIMIT = 10  # seconds; a bound on every test, never a timing assertion
PAYLOADS = [bytes([i]) * (50_000 + 1000 * i) for i in range(8)]
LOOPS = ["asyncio", "uvloop"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The cluster CA with hosts a and b, and another CA with host x (who trusts the cluster CA,
    so only its own certificate is wrong)."""
    root = tmp_path_factory.mktemp("pki")
    ca = CA(root / "cluster", cn="kvstreamd test cluster CA")
    other = CA(root / "other", cn="some other CA")
    return {"ca": ca, "other": other, "a": ca.host("a"), "b": ca.host("b"), "x": other.host("x"),
            # a certificate that names neither 127.0.0.1 nor anything a dialler uses
            "unnamed": ca.host("node-without-an-address", addresses=())}


def peer_tls(cert, ca_path=None) -> tls.PeerTLS:
    return tls.contexts(cert.cert, cert.key, ca_path or cert.ca)


def run_on(loop: str, coro):
    """Run coro on a new loop of the kind the daemon would use (aio.run picks uvloop)."""
    if loop == "uvloop":
        return aio.run(coro)
    return asyncio.run(coro)


async def streaming(served: aio.ServedFetch, fetch) -> None:
    for i, _ in enumerate(fetch.keys):
        await served.send_chunk(i, "high", PAYLOADS[i])
    await served.end()


class RecordingServer(aio.Server):
    """The real Server, keeping every PeerConnection it makes, so a test can say what each got."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.made: list[aio.PeerConnection] = []
        self.connected: list[aio.PeerConnection] = []

    def _new_connection(self) -> aio.PeerConnection:
        peer = super()._new_connection()
        self.made.append(peer)
        peer._on_connect = self.connected.append  # noqa: SLF001 - runs once the HMAC handshake is done
        return peer


async def tls_server(ctx: ssl.SSLContext | None, **kw) -> RecordingServer:
    srv = RecordingServer("srv", SECRET, streaming, ssl=ctx, **kw)
    await srv.listen(HOST, 0)
    return srv


def assert_no_frame_reached(srv: RecordingServer) -> None:
    """No connection of srv got past TLS: none was handed a transport or a byte."""
    assert srv.connected == []
    assert srv.connections == set()  # the refused ones were dropped, none is left open
    for peer in srv.made:
        assert peer.peer_node_id is None and peer.tls is None and peer.state is State.HELLO_SENT
        assert peer.conn.last_activity is None  # never fed a byte


# -- links that work ---------------------------------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_a_tls_link_authenticates_both_ways_and_carries_fetches_and_pings(pki, loop):
    a, b = peer_tls(pki["a"]), peer_tls(pki["b"])

    async def main():
        srv = await tls_server(a.server)
        async with srv:
            peer = await asyncio.wait_for(aio.connect(HOST, srv.port, "cli", SECRET, ssl=b.client), LIMIT)
            keys = [bytes([i]) * 32 for i in range(len(PAYLOADS))]
            got = [m async for m in peer.fetch(Fetch.ask(keys, 5000, ["high"]))]
            assert [m.payload for m in got] == PAYLOADS
            assert await peer.ping() >= 0  # a PING answered over TLS (uvloop's clock ticks in ms)
            (served,) = srv.connected
            for side, other_cn in ((peer, "a"), (served, "b")):
                sslobj = side._transport.get_extra_info("ssl_object")  # noqa: SLF001
                assert sslobj is not None and sslobj.version() == "TLSv1.3" and side.tls == "TLSv1.3"
                cert = sslobj.getpeercert()  # the other side's certificate, verified
                assert dict(x for rdn in cert["subject"] for x in rdn)["commonName"] == other_cn
            assert served.peer_node_id == "cli" and peer.peer_node_id == "srv"  # the HMAC handshake ran too
            peer.close()
            await peer.wait_closed()

    run_on(loop, main())


def test_the_dialled_address_need_not_be_named_in_the_certificate(pki):
    """The chain is checked against the cluster CA; the name is not (peers are dialled by IP)."""
    unnamed, b = peer_tls(pki["unnamed"]), peer_tls(pki["b"])

    async def main():
        async with await tls_server(unnamed.server) as srv:
            peer = await asyncio.wait_for(aio.connect(HOST, srv.port, "cli", SECRET, ssl=b.client), LIMIT)
            assert peer.tls == "TLSv1.3"
            peer.close()

    asyncio.run(main())


def test_the_contexts_are_mutual_tls_1_2_at_least(pki):
    t = peer_tls(pki["a"])
    for ctx in (t.server, t.client):
        assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert t.client.check_hostname is False
    assert t.ca_subject == "organizationName=kvstreamd test,commonName=kvstreamd test cluster CA"


# -- peers that are refused before any frame ---------------------------------------------------

@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_with_a_certificate_from_another_ca_is_refused_before_any_frame(pki, loop, caplog):
    a, x = peer_tls(pki["a"]), peer_tls(pki["x"], pki["ca"].path)
    caplog.set_level(logging.INFO, "transport")

    async def main():
        async with await tls_server(a.server) as srv:
            with pytest.raises(aio.HandshakeError) as e:
                await asyncio.wait_for(aio.connect(HOST, srv.port, "x", SECRET, ssl=x.client), LIMIT)
            await asyncio.sleep(0.1)  # let the server's side of the refusal finish
            assert e.value.code == tls.TLS_FAILED and "TLS" in e.value.msg, e.value
            assert srv.tls_refused == 1 and len(srv.made) == 1
            assert_no_frame_reached(srv)

    run_on(loop, main())
    refused = [r.getMessage() for r in caplog.records if "refused before any frame" in r.getMessage()]
    assert len(refused) == 1 and "certificate verify failed" in refused[0], refused
    assert not any("connected from" in r.getMessage() and "server" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_without_a_certificate_is_refused(pki, loop, caplog):
    a = peer_tls(pki["a"])
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts the CA, presents nothing
    bare.load_verify_locations(cafile=str(pki["ca"].path))
    bare.check_hostname = False
    caplog.set_level(logging.INFO, "transport")

    async def main():
        async with await tls_server(a.server) as srv:
            with pytest.raises(aio.HandshakeError) as e:
                await asyncio.wait_for(aio.connect(HOST, srv.port, "bare", SECRET, ssl=bare), LIMIT)
            await asyncio.sleep(0.1)
            assert e.value.code == tls.TLS_FAILED
            assert srv.tls_refused == 1
            assert_no_frame_reached(srv)

    run_on(loop, main())
    assert any("refused before any frame: the peer presented no certificate" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_plaintext_client_to_a_tls_server_is_refused(pki, loop, caplog):
    a = peer_tls(pki["a"])
    caplog.set_level(logging.INFO, "transport")

    async def main():
        async with await tls_server(a.server) as srv:
            with pytest.raises(aio.HandshakeError):
                await asyncio.wait_for(aio.connect(HOST, srv.port, "plain", SECRET), LIMIT)
            await asyncio.sleep(0.1)
            assert srv.tls_refused == 1
            assert_no_frame_reached(srv)

    run_on(loop, main())
    assert any("refused before any frame: wrong version number (is the other side not using TLS?)"
               in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_silent_client_is_refused_within_the_handshake_timeout(pki, caplog):
    a = peer_tls(pki["a"])
    caplog.set_level(logging.INFO, "transport")

    async def main():
        async with await tls_server(a.server, handshake_timeout=0.3) as srv:
            reader, writer = await asyncio.open_connection(HOST, srv.port)
            assert await asyncio.wait_for(reader.read(), LIMIT) == b""  # closed on us, nothing said
            writer.close()
            assert srv.tls_refused == 1
            assert_no_frame_reached(srv)

    asyncio.run(main())
    assert any("refused before any frame: TLS handshake not finished in time" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_server_with_a_certificate_from_another_ca_is_refused_by_the_dialler(pki, loop):
    x, b = peer_tls(pki["x"], pki["ca"].path), peer_tls(pki["b"])

    async def main():
        async with await tls_server(x.server) as srv:
            with pytest.raises(aio.HandshakeError) as e:
                await asyncio.wait_for(aio.connect(HOST, srv.port, "cli", SECRET, ssl=b.client), LIMIT)
            assert e.value.code == tls.TLS_FAILED
            assert e.value.msg == "TLS: certificate verify failed: unable to get local issuer certificate"
            assert srv.connected == []

    run_on(loop, main())


def test_a_tls_dialler_to_a_plaintext_server_says_so(pki):
    b = peer_tls(pki["b"])

    async def main():
        async with await tls_server(None) as srv:
            with pytest.raises(aio.HandshakeError) as e:
                await asyncio.wait_for(aio.connect(HOST, srv.port, "cli", SECRET, ssl=b.client), LIMIT)
            assert e.value.code == tls.TLS_FAILED and "is the other side not using TLS?" in e.value.msg, e.value

    asyncio.run(main())


# -- the files ---------------------------------------------------------------------------------

def test_files_that_do_not_load_are_named(pki, tmp_path):
    a, b = pki["a"], pki["b"]
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        ((tmp_path / "missing.pem", a.key, a.ca), "cert", "cannot read: No such file or directory"),
        ((a.cert, tmp_path / "missing.key", a.ca), "key", "cannot read"),
        ((a.cert, a.key, tmp_path / "missing-ca.pem"), "ca", "cannot read"),
        ((garbage, a.key, a.ca), "cert", "not a PEM certificate"),
        ((a.cert, garbage, a.ca), "key", "not a PEM private key"),
        ((a.cert, a.key, garbage), "ca", "not a PEM CA certificate"),
        ((a.cert, b.key, a.ca), "key", "does not match the certificate"),
    ]
    for (cert, key, ca), which, why in cases:
        with pytest.raises(tls.TLSFileError) as e:
            tls.contexts(cert, key, ca)
        path = {"cert": cert, "key": key, "ca": ca}[which]
        assert (e.value.which, e.value.path) == (which, path) and why in e.value.why, (which, str(e.value))


def write(tmp_path, text: str):
    path = tmp_path / "kvstreamd.toml"
    path.write_text(text)
    return path


def test_config_takes_all_three_or_none(env, tmp_path, pki):
    a = pki["a"]
    assert config.load(write(tmp_path, ""), env).tls() is None
    cfg = config.load(write(tmp_path, f'[peer]\ntls_cert = "{a.cert}"\ntls_key = "{a.key}"\ntls_ca = "{a.ca}"\n'), env)
    assert (cfg.peer.tls_cert, cfg.peer.tls_key, cfg.peer.tls_ca) == (a.cert, a.key, a.ca)
    assert cfg.tls().ca_subject.endswith("commonName=kvstreamd test cluster CA")
    path = write(tmp_path, f'[peer]\ntls_cert = "{a.cert}"\ntls_ca = "{a.ca}"\n')
    with pytest.raises(ConfigError) as e:
        config.load(path, env)
    assert str(e.value) == (f"{path}: [peer] tls_key: not set, but [peer] tls_cert, [peer] tls_ca is: TLS needs all "
                            "three of [peer] tls_cert, tls_key and tls_ca (or none of them, for plaintext)")
    with pytest.raises(ConfigError, match=r"\[peer\] tls_cert: not set"):
        config.load(write(tmp_path, '[peer]\ntls_key = "k.pem"\ntls_ca = "ca.pem"\n'), env)


def test_config_relative_paths_and_a_file_that_does_not_load(env, tmp_path, pki):
    a = pki["a"]
    (tmp_path / "host.pem").write_bytes(a.cert.read_bytes())
    path = write(tmp_path, f'[peer]\ntls_cert = "host.pem"\ntls_key = "gone.key"\ntls_ca = "{a.ca}"\n')
    cfg = config.load(path, env)  # loading the config reads no file; Config.tls() does, at start
    assert cfg.peer.tls_cert == tmp_path / "host.pem"
    with pytest.raises(ConfigError) as e:
        cfg.tls()
    assert str(e.value).startswith(f"{path}: [peer] tls_key: '{tmp_path / 'gone.key'}': cannot read: "), str(e.value)


def test_tls_keys_need_a_restart(env, tmp_path, pki):
    a = pki["a"]
    old = config.load(write(tmp_path, ""), env)
    new = config.load(write(tmp_path, f'[peer]\ntls_cert = "{a.cert}"\ntls_key = "{a.key}"\ntls_ca = "{a.ca}"\n'), env)
    assert config.reloadable_changes(old, new) == ([], ["[peer] tls_cert", "[peer] tls_key", "[peer] tls_ca"])


# -- daemons -----------------------------------------------------------------------------------

def tls_section(cert) -> dict:
    return {"tls_cert": str(cert.cert), "tls_key": str(cert.key), "tls_ca": str(cert.ca)}


async def test_two_daemons_fetch_over_tls_and_say_so_at_start_up(inprocess, pki, caplog):
    from tests.fixtures import MODEL, client, context, events_of, sees

    caplog.set_level(logging.INFO)
    (a,) = await inprocess(["a"], peer=tls_section(pki["a"]))
    (b,) = await inprocess(["b"], peer=tls_section(pki["b"]))
    b.peers.set_peers([(HOST, a.peers.port)])
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, kv)
        await sees(b, "a", tokens, 600)
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
    assert [ev.source for ev in events] == ["a"] * 3 and f.end.kv_tokens == 600
    conn = b.peers.connection("a")
    assert conn.tls == "TLSv1.3" and conn._transport.get_extra_info("ssl_object") is not None  # noqa: SLF001
    said = [r.getMessage() for r in caplog.records if r.name == "kvstreamd.cluster.peers"]
    assert sum("peer links are TLS, mutually authenticated" in m and "kvstreamd test cluster CA" in m
               for m in said) == 2, said


async def test_a_daemon_with_a_certificate_from_another_ca_cannot_join(inprocess, pki):
    (a,) = await inprocess(["a"], peer=tls_section(pki["a"]))
    x_tls = {**tls_section(pki["x"]), "tls_ca": str(pki["ca"].path)}
    (x,) = await inprocess(["x"], peer=x_tls)
    x.peers.set_peers([(HOST, a.peers.port)])  # x dials a: a refuses x's certificate
    a.peers.set_peers([(HOST, x.peers.port)])  # a dials x: a refuses x's certificate again

    async def errors():
        ex, ea = x.peers.configured[(HOST, a.peers.port)], a.peers.configured[(HOST, x.peers.port)]
        return (ex.last_error, ea.last_error) if ex.last_error and ea.last_error else None

    t0 = asyncio.get_running_loop().time()
    while not (got := await errors()):
        assert asyncio.get_running_loop().time() - t0 < LIMIT, "no dial failed"
        await asyncio.sleep(0.05)
    x_err, a_err = got
    assert x_err.startswith("HandshakeError: tls_failed: TLS: "), x_err
    assert a_err == "HandshakeError: tls_failed: TLS: certificate verify failed: unable to get local issuer certificate"
    assert a.peers.connected() == [] and x.peers.connected() == []
    assert a.peers.server.tls_refused >= 1


async def test_plaintext_says_at_start_up_what_it_does_not_protect(inprocess, caplog):
    caplog.set_level(logging.INFO)
    await inprocess(["a"])
    warned = [r for r in caplog.records if r.name == "kvstreamd.cluster.peers" and r.levelno == logging.WARNING]
    assert any("frames after the handshake are neither encrypted nor authenticated, so plaintext is for "
               "trusted networks only" in r.getMessage() for r in warned), [r.getMessage() for r in warned]


async def test_tls_files_that_do_not_load_stop_start_up_with_one_line(tmp_path, pki, caplog, small_profile):
    from kvstreamd.node import daemon
    from kvstreamd.lab.daemons import DaemonProcess

    a = pki["a"]
    node = DaemonProcess("a", tmp_path / "a", extra={"peer": {**tls_section(a), "tls_key": str(tmp_path / "nope.key")}})
    node.root.mkdir(parents=True)
    node.config_path.write_text(node.config_text())
    caplog.set_level(logging.INFO)
    assert await daemon._main(config.load(node.config_path)) == 2  # noqa: SLF001 - `kvstreamd run` minus the loop
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot start")]
    assert line.startswith(f"cannot start: {node.config_path}: [peer] tls_key: '{tmp_path / 'nope.key'}': cannot read: ")


# -- the benchmark's two ends, once, over a shaped link (needs root and iproute2) -------------

@pytest.mark.system  # a network namespace (root)
def test_the_tls_benchmark_moves_the_bytes_both_ways_over_a_shaped_link(pki):
    from kvstreamd.bench import tls as bench
    from kvstreamd.lab import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"cannot build network namespaces here: {why}")
    with netns.Link(rate_mbit=200) as link:
        plain = bench.one_run(link, None, chunks=3, chunk_bytes=2**20)
        over_tls = bench.one_run(link, {"a": pki["a"], "b": pki["b"]}, chunks=3, chunk_bytes=2**20)
    assert plain["bytes"] == over_tls["bytes"] == 3 * 2**20
    assert plain["tls"] is None and over_tls["tls"] == "TLSv1.3"
    assert 0 < plain["mbit_s"] < 200 * 1.1 and 0 < over_tls["mbit_s"] < 200 * 1.1  # the link's rate holds
