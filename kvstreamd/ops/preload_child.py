"""The daemon's side of [store] preload: once its API is up, it runs `kvstreamd preload` (the
documents, the model, this daemon's socket) as a child process, so that the daemon itself never
loads a model; it logs each document's outcome as the child reports it, and neither waits for
the child nor fails with it (`kvstreamd status` shows how it went, under "preload")."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from kvstreamd.features import Feature

log = logging.getLogger(__name__)

KEPT_ERRORS = 20  # errors status keeps (the log has them all)
STOP_WAIT_S = 5.0  # how long a stopping daemon gives the child after SIGTERM


def child_env(env: dict[str, str]) -> dict[str, str]:
    """The child's environment: no progress bars (they would fill the log), and under systemd
    (ProtectHome=, no writable ~/.cache) the model's converted copy kept in the unit's
    CacheDirectory= ($CACHE_DIRECTORY), where the daemon may write."""
    out = {**env, "TQDM_DISABLE": "1"}
    if env.get("CACHE_DIRECTORY") and not env.get("XDG_CACHE_HOME"):
        out["XDG_CACHE_HOME"] = env["CACHE_DIRECTORY"].split(":")[0]
    return out


LINE_LIMIT = 1 << 20  # the longest line read from the child (a traceback's, say); asyncio's default is 64 KiB


class PreloadChild(Feature):
    """[store] preload: `kvstreamd preload` run as a child once the API is up (none without
    documents); /v1/status "preload" says how it went."""

    name = "preload"

    def __init__(self, paths: tuple[Path, ...], model: str, socket: Path) -> None:
        self.paths = paths
        self.argv = [sys.executable, "-m", "kvstreamd.cli", "preload", *map(str, paths), "--socket", str(socket),
                     "--quiet", *(["--model", model] if model else [])]
        self.state = "starting"  # then "running", "done" (every document pinned) or "failed"
        self.counts = {"stored": 0, "held": 0, "failed": 0}
        self.errors: list[str] = []
        self.returncode: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.paths:  # after the API is up: the child stores through it
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=child_env(os.environ), limit=LINE_LIMIT)
        except OSError as e:
            self._error(f"cannot run {self.argv[0]}: {e}")
            self.state = "failed"
            return
        self.state = "running"
        log.info("preload: started (pid %d): %s", self._proc.pid, " ".join(self.argv[3:]))
        await asyncio.gather(self._outcomes(self._proc.stdout), self._stderr(self._proc.stderr))
        self.returncode = await self._proc.wait()
        ok = self.returncode == 0 and not self.counts["failed"]
        self.state = "done" if ok else "failed"
        (log.info if ok else log.error)("preload: %s (exit %d): %d documents stored, %d held already, %d failed",
                                        self.state, self.returncode, *self.counts.values())

    async def _outcomes(self, stream: asyncio.StreamReader) -> None:
        """One JSON line per document (kvstreamd.ops.preload.Outcome)."""
        async for line in stream:
            try:
                o = json.loads(line)
                outcome = o["outcome"]
            except (ValueError, KeyError, TypeError):
                log.info("preload: %s", line.decode(errors="replace").rstrip())
                continue
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            if outcome == "failed":
                self._error(o.get("error") or o.get("path"))
            else:
                log.info("preload: %s %s: %d tokens, %d chunks, %d bytes newly pinned, %.2f s", outcome, o["path"],
                         o["tokens"], o["chunks"], o["pinned"], o["seconds"])

    async def _stderr(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            text = line.decode(errors="replace").rstrip()
            if text.startswith("kvstreamd"):  # the command's own error (daemon unreachable, say)
                self._error(text)
            elif text:
                log.info("preload: %s", text)

    def _error(self, message: str) -> None:
        log.error("preload: %s", message)
        self.errors = (self.errors + [message])[-KEPT_ERRORS:]

    def status(self) -> dict | None:
        if not self.paths:
            return None
        return {"state": self.state, **self.counts, "errors": self.errors, "returncode": self.returncode}

    async def stop(self) -> None:
        """A stopping daemon ends the child (SIGTERM, then SIGKILL) and its task."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
            try:
                await asyncio.wait_for(self._proc.wait(), STOP_WAIT_S)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
