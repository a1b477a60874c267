"""systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram of
"KEY=value" lines to the AF_UNIX socket named by $NOTIFY_SOCKET. Outside systemd (no
$NOTIFY_SOCKET) every call is a no-op returning False; a failed send is logged, never raised.

    sdnotify.ready("serving 0 chunks")   # Type=notify: systemctl start returns now
    sdnotify.reloading()                 # on SIGHUP, before re-reading the configuration
    sdnotify.ready()                     # ... and after it
    sdnotify.stopping()                  # on SIGTERM, before draining
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Mapping

log = logging.getLogger(__name__)


def notify(state: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving") to $NOTIFY_SOCKET. True if it was sent;
    False when not under systemd, or when sending failed (logged as a warning)."""
    addr = env.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":  # the abstract namespace
        addr = "\0" + addr[1:]
    elif addr[0] != "/":
        log.warning("NOTIFY_SOCKET=%r: only AF_UNIX sockets are supported; not notifying", addr)
        return False
    data = state.encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            sent = s.sendto(data, addr)
    except OSError as e:
        log.warning("sd_notify to %r failed: %s", env.get("NOTIFY_SOCKET"), e)
        return False
    if sent != len(data):  # pragma: no cover - datagrams go whole or not at all
        log.warning("sd_notify to %r: sent %d of %d bytes", env.get("NOTIFY_SOCKET"), sent, len(data))
        return False
    return True


def _line(text: str) -> str:
    return " ".join(text.splitlines())  # a newline would start another KEY=value


def ready(status: str = "", env: Mapping[str, str] = os.environ) -> bool:
    """READY=1 (start-up finished, or a reload did), with an optional STATUS= line."""
    return notify("READY=1" + (f"\nSTATUS={_line(status)}" if status else ""), env)


def stopping(env: Mapping[str, str] = os.environ) -> bool:
    """STOPPING=1: shutting down."""
    return notify("STOPPING=1", env)


def reloading(env: Mapping[str, str] = os.environ) -> bool:
    """RELOADING=1 with MONOTONIC_USEC (CLOCK_MONOTONIC in microseconds), which systemd >= 253
    (Type=notify-reload) uses to match the reload; send ready() when the reload is done."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}", env)


def status(text: str, env: Mapping[str, str] = os.environ) -> bool:
    """STATUS=<text>: the line `systemctl status` shows."""
    return notify(f"STATUS={_line(text)}", env)
