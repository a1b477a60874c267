"""Daemons as real processes on one machine, each with its own config, store, socket and port
(optionally inside a network namespace of netns.Link): what the tests, `make demo` and
`kvstreamd bench e2e` stand a cluster up with."""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..client import Client, ClientError


_HANDED_OUT: set[int] = set()
# Ports handed out are claimed across processes too (two test runs side by side, pytest-xdist's
# workers): a file per port in this folder holds the claiming pid; a dead pid's claim is taken over.
CLAIMS = Path(tempfile.gettempdir()) / "kvstreamd-lab-ports"


def _claim(port: int) -> bool:
    CLAIMS.mkdir(exist_ok=True)
    path = CLAIMS / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text())
            except (OSError, ValueError):  # gone, or its claimer has not written its pid yet
                return False
            if owner == os.getpid() or _alive(owner):
                return False
            path.unlink(missing_ok=True)  # its process is gone: the claim is stale
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _release_claims() -> None:
    for port in _HANDED_OUT:
        path = CLAIMS / str(port)
        try:
            if path.read_text() == str(os.getpid()):
                path.unlink()
        except (OSError, ValueError):
            pass


def free_port() -> int:
    """A loopback port nothing listens on now and that no live process has had from here before:
    the kernel may give a port it just gave (and that was closed at once) again, and two daemons
    of one test were once handed the same one ("peers[1] ... is listed twice"); two test processes
    side by side would hand out one port twice the same way (a claim file each, CLAIMS)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT and _claim(port):
            _HANDED_OUT.add(port)
            return port


@dataclass
class DaemonProcess:
    name: str
    root: Path  # this node's folder: config, store, socket, log
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"  # the address it listens on and peers reach it at
    peers: list[str] = field(default_factory=list)  # "host:port"
    secret: str = "cluster-test-secret"
    netns: list[str] | None = None  # argv prefix that runs a command inside its namespace
    extra: dict[str, dict] = field(default_factory=dict)  # more config: {"codec": {"chunk_tokens": 256}}
    proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def socket(self) -> Path:
        return self.root / "api.sock"

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    @property
    def log_path(self) -> Path:
        return self.root / "daemon.log"

    def config_text(self) -> str:
        sections: dict[str, dict] = {
            "node": {"id": self.name},
            "api": {"socket": str(self.socket)},
            "peer": {"listen": self.addr, "peers": self.peers, "secret": self.secret, "retry_min_s": 0.2,
                     "retry_max_s": 1.0},
            "store": {"dir": str(self.root / "store")},
        }
        for sec, kv in self.extra.items():
            sections.setdefault(sec, {}).update(kv)
        lines = []
        for sec, kv in sections.items():
            lines.append(f"[{sec}]")
            lines += [f"{k} = {_toml(v)}" for k, v in kv.items()]
        return "\n".join(lines) + "\n"

    def start(self, wait: float = 90.0) -> "DaemonProcess":
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text())
        argv = [sys.executable, "-m", "kvstreamd.cli", "run", "--config", str(self.config_path)]
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([*(self.netns or []), *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        if wait:
            self.wait_healthy(wait)
        return self

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.client(timeout=5).health()["status"] == "ok":
                    return
            except (ClientError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"daemon {self.name} not healthy after {timeout} s:\n{self.log()[-3000:]}")

    def client(self, timeout: float | None = 600.0) -> Client:
        return Client(self.socket, timeout=timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM; returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def counter(self, name: str, **labels: str) -> float:
        """The sum of its /metrics counter `name` over the series with these labels."""
        total = 0.0
        for line in self.client().metrics().splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def account(self, chars: int = 4000) -> str:
        """What a failed test shows of this daemon: its first warnings and errors, then its last
        lines (a stop's own warnings can fill the tail and hide why a fetch went wrong)."""
        text = self.log()
        worse = [ln for ln in text.splitlines() if "level=warning" in ln or "level=error" in ln]
        first = "\n".join(worse)[:chars]
        return f"--- daemon {self.name}: warnings and errors, first ones ---\n{first}\n" \
               f"--- daemon {self.name}'s log, last lines ---\n{text[-chars:]}"


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not met within {timeout} s")


def seconds_until(predicate, timeout: float = 30.0, interval: float = 0.02, what: str = "condition",
                  since: float | None = None) -> float:
    """Seconds from `since` (a time.monotonic(); default now) until predicate() held, polled every
    `interval`; TimeoutError once `timeout` has passed since then."""
    t0 = time.monotonic() if since is None else since
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what} not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0
