"""A real redis-server (Debian's package; `make install` puts it there) on a free port in a
folder of its own, with nothing saved to disk: what the tests and benchmarks of the Redis
directory start and stop. `stop()` then `start()` again is a Redis restart on the same port."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from .daemons import free_port


def available() -> tuple[bool, str]:
    path = shutil.which("redis-server")
    return (True, path) if path else (False, "redis-server is not installed (apt-get install redis-server)")


class RedisServer:
    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, wait: float = 10.0) -> "RedisServer":
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "redis.log", "ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()[-2000:]}")
            if self.ping():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} not answering after {wait} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def holds(self, prefix: str, node: str, keys: list[str]) -> bool:
        """Whether the directory under `prefix` lists `node` as a holder of every chunk key (hex)."""
        r = redis.Redis(port=self.port)
        try:
            return all(node.encode() in r.smembers(f"{prefix}chunk:{k}") for k in keys)
        finally:
            r.close()

    def calls(self, command: str) -> int:
        """How many times this server has run `command` (e.g. "evalsha") since it started."""
        r = redis.Redis(port=self.port)
        try:
            return int(r.info("commandstats").get(f"cmdstat_{command.lower()}", {}).get("calls", 0))
        finally:
            r.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        path = self.root / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
