"""TLS for peer links (the standard library's ssl): the two SSLContexts a node needs, built
from its certificate and key and the cluster CA, and the server side's TLS handshake, done
before any PeerConnection exists so a peer the CA does not vouch for never gets a frame read.

Both sides present a certificate and both check the other's chain against the cluster CA
(mutual TLS: CERT_REQUIRED both ways), TLS 1.2 at least (1.3 is what two kvstreamd nodes
agree on). The dialler does not check that the server's certificate names the address it
dialled: a peer is dialled by IP or host name, and what the CA vouches for is membership of
the cluster, not a name. The HMAC handshake still runs inside the TLS channel."""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["PeerTLS", "TLSFileError", "contexts", "server_context", "client_context", "describe",
           "TLSListener", "TLS_FAILED", "lost_reason"]

log = logging.getLogger(__name__)

TLS_FAILED = "tls_failed"  # local only, never sent: the TLS layer refused the peer or failed


class TLSFileError(Exception):
    """A certificate, key or CA file that cannot be loaded; `which` is "cert", "key" or "ca"
    and `path` the file, so the caller can name its own setting."""

    def __init__(self, which: str, path: Path, why: str):
        super().__init__(f"{which} {str(path)!r}: {why}")
        self.which, self.path, self.why = which, Path(path), why


@dataclass(frozen=True)
class PeerTLS:
    """What a node's peer links run over: `server` for its listener, `client` for its dials."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    ca_subject: str  # the cluster CA's subject, e.g. "CN=kvstreamd cluster CA", for logs

    def __repr__(self) -> str:
        return f"<PeerTLS CA {self.ca_subject}>"


def _why(e: Exception) -> str:
    if isinstance(e, OSError) and not isinstance(e, ssl.SSLError):
        return e.strerror or str(e)
    return describe(e)


def _readable(which: str, path: Path) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise TLSFileError(which, path, f"cannot read: {_why(e)}") from None


def _subject(cert: dict) -> str:
    return ",".join(f"{k}={v}" for rdn in cert.get("subject", ()) for k, v in rdn) or "(empty subject)"


def _new(protocol: int, cert: Path, key: Path, ca: Path) -> tuple[ssl.SSLContext, str]:
    for which, path in (("cert", cert), ("key", key), ("ca", ca)):
        _readable(which, path)
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: the server asks for the client's certificate too
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, ValueError) as e:
        raise TLSFileError("ca", ca, f"not a PEM CA certificate: {_why(e)}") from None
    cas = [c for c in ctx.get_ca_certs() if c.get("subject")]
    if not cas:
        raise TLSFileError("ca", ca, "holds no CA certificate (one with basicConstraints CA:TRUE)")
    # The certificate alone first, so a bad one is not blamed on the key.
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(cert))
    except (ssl.SSLError, ValueError) as e:
        raise TLSFileError("cert", cert, f"not a PEM certificate: {_why(e)}") from None
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as e:
        why = ("does not match the certificate" if "KEY_VALUES_MISMATCH" in str(e)
               else f"not a PEM private key (unencrypted): {_why(e)}")
        raise TLSFileError("key", key, why) from None
    except OSError as e:
        raise TLSFileError("key", key, f"cannot load: {_why(e)}") from None
    return ctx, "; ".join(_subject(c) for c in cas)


def server_context(cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    """The listener's context: presents `cert`, requires a client certificate from `ca`."""
    return _new(ssl.PROTOCOL_TLS_SERVER, cert, key, ca)[0]


def client_context(cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    """The dialler's context: presents `cert`, requires the server's chain to end at `ca`;
    the server's name is not checked (see the module's docstring)."""
    ctx = _new(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca)[0]
    ctx.check_hostname = False  # the name is not checked ...
    ctx.verify_mode = ssl.CERT_REQUIRED  # ... the chain still is
    return ctx


def contexts(cert: str | Path, key: str | Path, ca: str | Path) -> PeerTLS:
    """Both contexts from one host's certificate, its key and the cluster CA (PEM files);
    TLSFileError naming the file that does not load."""
    cert, key, ca = Path(cert), Path(key), Path(ca)
    server, subject = _new(ssl.PROTOCOL_TLS_SERVER, cert, key, ca)
    return PeerTLS(server, client_context(cert, key, ca), subject)


def describe(e: BaseException) -> str:
    """A TLS failure in words: "certificate verify failed: unable to get local issuer
    certificate" rather than "[SSL: CERTIFICATE_VERIFY_FAILED] ... (_ssl.c:1006)"."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {e.verify_message}"
    if isinstance(e, ssl.SSLError):
        reason = (e.reason or str(e)).lower().replace("_", " ")
        if reason in ("wrong version number", "http request", "record layer failure",
                      "packet length too long", "unknown protocol"):
            reason += " (is the other side not using TLS?)"
        elif reason == "peer did not return a certificate":
            reason = "the peer presented no certificate"
        elif "alert" in reason:
            reason += " (the other side refused this TLS connection: see its log)"
        return reason
    if isinstance(e, (asyncio.TimeoutError, ConnectionAbortedError)):
        return f"TLS handshake not finished in time ({e})" if str(e) else "TLS handshake not finished in time"
    if isinstance(e, ConnectionError) or type(e) is OSError:
        return f"connection lost during the TLS handshake ({e.strerror or e})" if str(e) else \
            "connection lost during the TLS handshake"
    return f"{type(e).__name__}: {e}"


class TLSListener:
    """Listening sockets (as loop.create_server makes them) whose accepted connections must
    pass a TLS handshake before `make_protocol()` (a PeerConnection) gets any byte: each is
    handed to loop.connect_accepted_socket with the server context, and one the handshake
    refuses (no certificate, one from another CA, plaintext, too slow) is logged with its
    address and given to `on_refused(protocol, address, why)`; its protocol never saw a
    connection. Quacks like asyncio.Server where aio.Server uses it (sockets, close,
    wait_closed)."""

    def __init__(self, ctx: ssl.SSLContext, handshake_timeout: float,
                 make_protocol: Callable[[], asyncio.Protocol],
                 on_refused: Callable[[asyncio.Protocol, str, str], None]):
        self._ctx = ctx
        self._timeout = handshake_timeout
        self._make = make_protocol
        self._on_refused = on_refused
        self.sockets: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()  # accept loops and handshakes

    async def listen(self, host: str, port: int, backlog: int = 100) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        seen = set()
        for family, type_, proto, _, address in infos:
            if (family, address) in seen or (port == 0 and self.sockets):
                continue  # port 0: one socket (another address would get another port)
            seen.add((family, address))
            sock = socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(backlog)
                sock.setblocking(False)
            except OSError:
                sock.close()
                self.close()
                raise
            self.sockets.append(sock)
        for sock in self.sockets:
            self._spawn(self._accept(sock))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    conn, address = await loop.sock_accept(sock)
                except OSError as e:  # EMFILE and the like: as asyncio's server, wait and go on
                    log.warning("peer listener: accept failed: %s", e)
                    await asyncio.sleep(1.0)
                    continue
                self._spawn(self._handshake(conn, address))
        finally:
            sock.close()  # here, once the loop no longer waits on it

    async def _handshake(self, conn: socket.socket, address) -> None:
        loop = asyncio.get_running_loop()
        label = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
        protocol = None

        def factory() -> asyncio.Protocol:
            nonlocal protocol
            protocol = self._make()
            return protocol
        try:
            await loop.connect_accepted_socket(factory, conn, ssl=self._ctx,
                                               ssl_handshake_timeout=self._timeout)
        except asyncio.CancelledError:
            conn.close()
            if protocol is not None:
                self._on_refused(protocol, label, "server closing")
            raise
        except Exception as e:  # noqa: BLE001 - whatever failed, the peer is refused
            conn.close()
            why = describe(e)
            log.warning("peer %s: TLS handshake failed, refused before any frame: %s", label, why)
            if protocol is not None:
                self._on_refused(protocol, label, why)

    def close(self) -> None:
        """Stop accepting (each accept loop closes its socket) and refuse handshakes in flight."""
        for task in list(self._tasks):
            task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)


def lost_reason(exc: BaseException | None, state: str) -> str:
    """Why a TLS connection closed under a PeerConnection in `state`, for its close message."""
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {describe(exc)}"
    return (f"TLS: connection closed in state {state}{f' ({exc})' if exc else ''} (the other side may "
            "have refused this node's certificate: see its log)")
