"""The daemon: builds the store, the peer manager, the codec pool, the node's features (one line
each in `features()`) and the node (node.py: the work local clients ask for), serves the local
API, and owns the life cycle (start-up, SIGHUP reload: each part's reconfigure(cfg) in turn,
SIGTERM shutdown, and systemd's READY/STOPPING notifications)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import stat
import time
from concurrent.futures import BrokenExecutor
from pathlib import Path

import torch
from aiohttp import web

from codec.errors import CodecError
from codec.pool.parallel import CodecPool
from codec.pool.segments import SEG_PREFIX as CODEC_SEG_PREFIX

from kvstreamd import __version__, config as config_mod
from kvstreamd.cluster.directory import Directory, PeerDirectory
from kvstreamd.cluster.peers import PeerManager
from kvstreamd.cluster.prefetch import Prefetcher
from kvstreamd.coder import Coder
from kvstreamd.config import Config, ConfigError
from kvstreamd.features import Feature
from kvstreamd.handoff.shm import sweep_stale
from kvstreamd.metrics import Metrics, set_level, setup_logging
from kvstreamd.node import api
from kvstreamd.node.api import make_app
from kvstreamd.node.node import Node
from kvstreamd.ops import sdnotify
from kvstreamd.ops.certificates import CertificateWatch
from kvstreamd.ops.health import HealthWatch
from kvstreamd.ops.loop_watch import LoopWatch
from kvstreamd.ops.outcomes import OutcomeLog
from kvstreamd.ops.preload_child import PreloadChild
from kvstreamd.store.store import Store

log = logging.getLogger(__name__)


class StartupError(Exception):
    """The daemon cannot start (socket in use, store not writable, ...); the message says why."""


def resolve_device(setting: str) -> tuple[torch.device | None, str]:
    """[codec] device -> the GPU that fetches asking for device "cuda" decode on, or None and
    why not. "auto" falls back to the CPU quietly; "cuda" that cannot be had is a start error."""
    if setting == "cpu":
        return None, '[codec] device = "cpu"'
    from codec import gpu
    ok, why = gpu.available()
    if ok and setting.startswith("cuda:") and int(setting[5:]) >= torch.cuda.device_count():
        ok, why = False, f"there are {torch.cuda.device_count()} CUDA devices"
    if not ok:
        if setting == "auto":
            return None, why
        raise StartupError(f'[codec] device = "{setting}": {why}')
    dev = torch.device(setting if setting != "auto" else "cuda")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device()), ""


def make_directory(cfg: Config, metrics: Metrics) -> Directory:
    """The [directory] backend."""
    if cfg.directory.backend == "redis":
        from kvstreamd.cluster.redis_directory import RedisDirectory  # redis-py only where it is used
        return RedisDirectory(cfg.directory, metrics)
    return PeerDirectory(cfg.peer.max_keys_per_peer,
                         on_refused=lambda n: metrics.error("peer_keys_over_cap", n))


def features(cfg: Config, store: Store, directory: Directory, peers: PeerManager, coder: Coder,
             metrics: Metrics) -> list[Feature]:
    """The node's features (kvstreamd/features.py), one line each."""
    return [
        HealthWatch(metrics),
        OutcomeLog(cfg),
        Prefetcher(cfg, store, directory, peers, coder, metrics),
        PreloadChild(cfg.store.preload, cfg.store.preload_model, cfg.api.socket),
        CertificateWatch(cfg, metrics),
        LoopWatch(metrics),
    ]


def advertised_address(cfg: Config, port: int) -> str:
    """The "host:port" this node's peers dial it at: [directory] address, else the [peer]
    listen host (the host name where that is every interface) and the port it listens on."""
    if cfg.directory.address:
        return cfg.directory.address
    host = cfg.peer.listen[0]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Daemon:
    def __init__(self, cfg: Config, codec_pool: CodecPool | None = None) -> None:
        """codec_pool: a running pool to code with (Coder's `pool`: not closed at stop) rather than
        one of its own; the tests' in-process daemons share one."""
        self.cfg = cfg
        self._codec_pool = codec_pool
        self.node_id = cfg.node.id
        self.metrics = Metrics()
        self.directory = make_directory(cfg, self.metrics)
        self.store: Store | None = None
        self.coder: Coder | None = None
        self.peers: PeerManager | None = None
        self.node: Node | None = None  # once the parts it works with are up
        self.stopping = False
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.BaseRunner | None = None  # [api] metrics_listen
        self.metrics_address: tuple[str, int] | None = None  # where it listens (the port once bound)
        self._reaper: asyncio.Task | None = None
        self._stop = asyncio.Event()

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        secret = cfg.secret()  # first: a secret file that cannot be read stops start-up before anything runs
        tls = cfg.tls()  # and so do TLS files that do not load
        gpu, gpu_why = resolve_device(cfg.codec.device)
        swept = sweep_stale() + sweep_stale(CODEC_SEG_PREFIX)  # fetch buffers; the codec pool's segments
        if swept:
            log.info("removed %d shared-memory segments left by dead processes", len(swept))
        self.store = Store(cfg.store.dir, cfg.store.memory_budget, cfg.store.disk_budget,
                           on_add=lambda keys: self._keys_changed(True, keys),
                           on_remove=lambda keys: self._keys_changed(False, keys), pin_budget=cfg.store.pin_budget)
        try:
            report = await asyncio.to_thread(self.store.open)
        except OSError as e:
            raise StartupError(f"[store] dir {cfg.store.dir}: {e}") from None
        log.info("store %s: %d chunks (%d bytes) on disk, %d corrupt files skipped", cfg.store.dir,
                 report.loaded, report.bytes, len(report.corrupt))
        for path, why in report.corrupt:
            log.warning("store: skipped corrupt file %s: %s", path, why)
            self.metrics.error("store_corrupt")
        try:
            warm = () if cfg.codec.warm_tables == "lazy" else cfg.codec.levels  # the levels' tables, at start
            self.coder = await asyncio.to_thread(Coder, cfg.workers(), cfg.codec.profile, warm, self._codec_pool)
        except CodecError as e:  # the profile file does not load: a bad configuration, as a bad secret file
            raise ConfigError(f"{cfg.where('[codec] profile')}: {e}") from None
        except (OSError, BrokenExecutor) as e:  # no processes, file descriptors or memory to start them
            raise StartupError(f"[codec] workers: {cfg.workers()} codec worker processes could not start: "
                               f"{type(e).__name__}: {e}") from None
        if cfg.codec.warm_tables == "start":
            self.coder.warm_all()
        log.info("fetched chunks decode on %s", f"{gpu} (CUDA streams, IPC hand-off)" if gpu else f"the CPU ({gpu_why})")
        if secret is None:
            log.warning("no [peer] secret configured: using a random one, so no peer can join this node")
            secret = secrets.token_bytes(32)
        caps = {"levels": list(cfg.codec.levels), "decode_mbps": self.coder.decode_mbps,
                "recompute_tokens_per_s": cfg.fetch.recompute_tokens_per_s, "version": __version__,
                "zone": cfg.node.zone}
        self.peers = PeerManager(self.node_id, secret, cfg.peer, self.store, self.directory, self.metrics, caps,
                                 cfg.fetch.recompute_tokens_per_s, lambda mid: self.coder.profile_for(mid),
                                 idle_s=cfg.directory.idle_s, tls=tls)
        try:
            await self.peers.start()
        except OSError as e:
            raise StartupError(f"[peer] listen {cfg.peer.listen[0]}:{cfg.peer.listen[1]}: {e.strerror or e}") from None
        await self.directory.start(self.node_id, advertised_address(cfg, self.peers.port), self.store.held_levels,
                                   cfg.node.zone)
        self.node = Node(cfg, self.store, self.directory, self.coder, self.peers, self.metrics, gpu, gpu_why,
                         features(cfg, self.store, self.directory, self.peers, self.coder, self.metrics))
        await self._start_api()
        if cfg.api.metrics_listen is not None:
            await self._start_metrics_listener(*cfg.api.metrics_listen)
        self._reaper = asyncio.ensure_future(self._reap_buffers())
        await self.node.start_features()  # after the API: [store] preload's child stores through it
        log.info("kvstreamd %s node %s: peers on %s:%d, API on %s", __version__, self.node_id, cfg.peer.listen[0],
                 self.peers.port, cfg.api.socket)
        sdnotify.ready(f"serving; peers on port {self.peers.port}")

    def _keys_changed(self, added: bool, keys: list[bytes]) -> None:
        """The store took (with their levels) or dropped chunks (from any thread): the directory
        hears (and tells whoever its backend tells). (A chunk dropped again before this ran is
        left to its drop.)"""
        held = self.store.held_levels(keys) if added else dict.fromkeys(keys, frozenset())
        self.directory.changed(added, held)

    async def _start_api(self) -> None:
        path = Path(self.cfg.api.socket)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where a directory must be, a read-only file system, ...
            raise ConfigError(f"{self.cfg.source or '(built-in defaults)'}: [api] socket {path}: cannot make "
                              f"its directory {path.parent}: {e.strerror or e}") from None
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise StartupError(f"[api] socket {path}: exists and is not a socket")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(str(path))
                except OSError:
                    path.unlink()  # left by a daemon that died
                else:
                    raise StartupError(f"[api] socket {path}: another daemon is listening there")
        self._runner = web.AppRunner(make_app(self.node), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.UnixSite(self._runner, str(path))
        try:
            await site.start()
        except OSError as e:
            raise StartupError(f"[api] socket {path}: {e}") from None
        os.chmod(path, self.cfg.api.socket_mode)

    async def _start_metrics_listener(self, host: str, port: int) -> None:
        try:
            self._metrics_runner = await api.start_metrics_listener(self.node, host, port)
        except OSError as e:
            raise StartupError(f"[api] metrics_listen {host}:{port}: {e.strerror or e}") from None
        self.metrics_address = self._metrics_runner.addresses[0][:2]
        log.info("metrics on http://%s:%d/metrics", host, self.metrics_address[1])

    async def stop(self) -> None:
        """Stop accepting, cancel transfers, flush the store index, release every buffer."""
        if self.stopping:
            return
        self.stopping = True
        sdnotify.stopping()
        if self.node is not None:
            self.node.stopping = True  # new fetches are refused from here on
        if self.peers is not None:
            await self.peers.stop()
        await self.directory.stop()
        if self.node is not None:
            await self.node.cancel_fetches()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self._runner is not None:
            await self._runner.cleanup()
            with contextlib.suppress(FileNotFoundError):
                Path(self.cfg.api.socket).unlink()
        if self._reaper is not None:
            self._reaper.cancel()
        if self.node is not None:
            self.node.release_all()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
        if self.coder is not None:
            await asyncio.to_thread(self.coder.close)
        log.info("stopped")

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        try:
            await self._stop.wait()
        finally:
            await self.stop()

    async def reload(self) -> None:
        """SIGHUP: re-read the config file; apply what can change at run time."""
        sdnotify.reloading()
        try:
            new = config_mod.load(self.cfg.source) if self.cfg.source else self.cfg
            changed, restart = config_mod.reloadable_changes(self.cfg, new)
            new.secret()  # read now: a secret file that cannot be read refuses the reload
        except ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            self.metrics.error("reload")
            sdnotify.ready("serving (last reload failed)")
            return
        for key in restart:
            log.warning("reload: %s changed but needs a restart; keeping the running value", key)
        self.cfg = config_mod.reloaded(self.cfg, new)
        await asyncio.to_thread(self.store.reconfigure, self.cfg)
        for part in (self.peers, self.node):
            part.reconfigure(self.cfg)
        set_level(self.cfg.node.log_level)
        log.info("reloaded %s: %s", self.cfg.source, ", ".join(changed) or "nothing changed")
        sdnotify.ready("serving")

    async def _reap_buffers(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.node.expire_buffers(time.monotonic())


async def _main(cfg: Config) -> int:
    daemon = Daemon(cfg)
    try:
        await daemon.start()
    except (StartupError, ConfigError) as e:
        log.error("cannot start: %s", e)
        await daemon.stop()
        return 2 if isinstance(e, ConfigError) else 1
    await daemon.serve_forever()
    return 0


def run(config_path: str | None) -> int:
    """`kvstreamd run`: 0 after a clean SIGTERM, 1 if it cannot start, 2 for a bad config (one
    that does not load, or names a secret file or socket directory that cannot be had)."""
    setup_logging("info")
    try:
        cfg = config_mod.load(config_path)
    except ConfigError as e:
        log.error("cannot start: bad configuration: %s", e)
        return 2
    setup_logging(cfg.node.log_level)
    torch.set_num_threads(1)  # the event loop's process only copies; the pool's workers decode
    from transport import aio
    return aio.run(_main(cfg))
