"""A TCP relay that adds a fixed delay to each direction, in user space: this kernel has no
netem, so a long link is a relay in front of a peer port (kvstreamd/lab/netns.py gives the
bandwidth limit, tbf; this gives the round trip). Each accepted connection is dialled through
to `target`; every byte read is stamped and written `delay_s` later, in order.

It must not cap throughput: two threads per direction (a reader that stamps what it reads
into a queue, a writer that sleeps only until the oldest bytes are due, then writes every
piece due by then in one go), large reads, and up to `max_queue` bytes held per direction
(the bytes "on the long wire": 1 Gbit/s x 50 ms is 6.25 MB; past it the reader stops and TCP
pushes back). Blocking sockets release the GIL, so the four threads of a connection run
alongside each other.

A user-space relay splits the TCP connection in two: each half has a short round trip, so it
reproduces what the peer protocol sees (an ACK comes back 2 x delay_s after its chunk left)
but not TCP's own behaviour on a long path (slow start and socket buffers sized to the
bandwidth-delay product; docs/benchmarks.md says what a real WAN link needs).

    python -m kvstreamd.lab.relay --listen 192.0.2.1:9421 --to 127.0.0.1:9420 --delay-ms 50
prints "ready" once listening and runs until killed."""
from __future__ import annotations

import argparse
import collections
import socket
import sys
import threading
import time

READ_BYTES = 1 << 20  # per recv: few wake-ups at 1 Gbit/s
MAX_QUEUE = 256 << 20  # bytes held per direction before the reader stops reading
SLACK_S = 0.0005  # pieces due this close together go out in one write


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


class _Direction:
    """Bytes from `src` to `dst`, each piece written `delay_s` after it was read."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, max_queue: int,
                 on_done) -> None:
        self.src, self.dst, self.delay_s, self.max_queue = src, dst, delay_s, max_queue
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()  # (due, bytes); b"" = EOF
        self.queued = 0
        self.moved = 0  # bytes written to dst
        self.cond = threading.Condition()
        self.failed = False
        self._on_done = on_done
        self.threads = [threading.Thread(target=self._read, daemon=True),
                        threading.Thread(target=self._write, daemon=True)]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(READ_BYTES)
                with self.cond:
                    self.queue.append((time.monotonic() + self.delay_s, data))
                    self.queued += len(data)
                    self.cond.notify_all()
                    if not data:
                        return
                    while self.queued > self.max_queue and not self.failed:
                        self.cond.wait()
                    if self.failed:
                        return
        except OSError:
            self._fail()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.failed:
                        self.cond.wait()
                    if self.failed:
                        return
                    due = self.queue[0][0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with self.cond:  # everything due by now (and just after), oldest first
                    now = time.monotonic() + SLACK_S
                    pieces = []
                    while self.queue and self.queue[0][0] <= now:
                        pieces.append(self.queue.popleft()[1])
                    self.queued -= sum(map(len, pieces))
                    self.cond.notify_all()
                eof = bool(pieces) and pieces[-1] == b""
                data = b"".join(pieces)
                if data:
                    self.dst.sendall(data)
                    self.moved += len(data)
                if eof:
                    self.dst.shutdown(socket.SHUT_WR)
                    self._on_done(self, clean=True)
                    return
        except OSError:
            self._fail()

    def _fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()
        self._on_done(self, clean=False)


class Relay:
    """Listens on `listen` (host, port); each connection goes on to `target` with `delay_s`
    added to each direction. start() binds and serves in a thread; close() stops it."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float,
                 max_queue: int = MAX_QUEUE) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.target, self.delay_s, self.max_queue = target, delay_s, max_queue
        self._listener = socket.create_server(listen, backlog=64)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closing = False
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket]] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> Relay:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._closing:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target)
            except OSError:
                down.close()
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames (ACKs) at once
            with self._lock:
                self._open.append((down, up))
            self._pair(down, up)

    def _pair(self, a: socket.socket, b: socket.socket) -> None:
        finished: set[int] = set()
        lock = threading.Lock()

        def done(direction: _Direction, clean: bool) -> None:
            with lock:
                finished.add(id(direction))
                last = len(finished) == 2
            if not clean or last:  # one side failed, or both have ended: the pair is over
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    s.close()
                with self._lock:
                    if (a, b) in self._open:
                        self._open.remove((a, b))

        _Direction(a, b, self.delay_s, self.max_queue, done)
        _Direction(b, a, self.delay_s, self.max_queue, done)

    def close(self) -> None:
        self._closing = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            pairs, self._open = self._open, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstreamd.lab.relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="host:port to accept on")
    p.add_argument("--to", required=True, help="host:port each connection is relayed to")
    p.add_argument("--delay-ms", type=float, required=True, help="added to each direction")
    p.add_argument("--max-queue-mib", type=int, default=MAX_QUEUE >> 20, help="bytes held per direction, MiB")
    args = p.parse_args(argv)
    relay = Relay(_address(args.listen), _address(args.to), args.delay_ms / 1000,
                  max_queue=args.max_queue_mib << 20).start()
    print("ready", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
