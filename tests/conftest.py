"""Shared fixtures: an empty user profile folder for the session, a small synthetic codec profile
(fast, for property tests), the real model (loaded once per session), daemons in the test's event
loop, and a really small disk."""
from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from codec import profile as profiles
from codec.tuning import registry
from tests.fixtures import MODEL_THREADS, SMALL, SYNTHETIC_CODEC, is_system_fixture, synthetic_kv, system_fixture

# What makes a test a `system` test (pyproject.toml's markers) is what it uses, not where it lives:
# - a fixture that starts or loads something, marked so with `system_fixture` (tests/fixtures.py):
#   the real model (`lm`), a redis-server (`redis_server`), root (`small_disk`), and the module
#   fixtures that start daemon processes or run the CLI; a test using one, directly or through
#   another fixture, is marked here;
# - what a test's body does itself (a daemon process, a network namespace, a subprocess of the
#   CLI or of Python, codec workers of its own that it kills, promtool, systemd-analyze, vLLM):
#   an explicit `@pytest.mark.system`, or
#   `pytestmark` where the whole file does.
# A daemon in the test's loop (`inprocess`) is not one: it takes a fraction of a second on the
# session's codec pool. tests/system/ holds files of system tests only: a test there that is not
# marked is a collection error (it belongs in its room's folder, where `make test-fast` runs it).
SYSTEM_DIR = Path(__file__).resolve().parent / "system"
STOP_TIMEOUT_S = 60  # an in-process daemon stops in well under a second


def _uses_system_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(is_system_fixture(d.func) for defs in info.name2fixturedefs.values() for d in defs)


def pytest_collection_modifyitems(config, items):
    unmarked = []
    for item in items:
        if item.get_closest_marker("system") is None and _uses_system_fixture(item):
            item.add_marker(pytest.mark.system)
        if SYSTEM_DIR in item.path.parents and item.get_closest_marker("system") is None:
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError("tests/system/ holds system tests only; these use no daemon process, model, "
                                "server, namespace or subprocess (move them to their room's folder, or mark "
                                "what they use):\n  " + "\n  ".join(unmarked))
    # Files holding system tests go first (their order within a file kept). pytest-xdist (`make
    # test`) hands out the files with the most tests first and keeps this order among files with
    # as many tests, so a long system file starts before short pure files with the same count.
    slow = {item.path for item in items if item.get_closest_marker("system") is not None}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session", autouse=True)
def user_profile_folder(tmp_path_factory) -> Path:
    """The session's user profile folder (codec.tuning.registry), empty: profiles a developer calibrated
    for themselves do not change what the tests code with. In os.environ, so codec workers and
    daemon processes inherit it; a test points it elsewhere with monkeypatch."""
    path = tmp_path_factory.mktemp("user-profiles")
    before = os.environ.get(registry.PROFILE_DIR_ENV)
    os.environ[registry.PROFILE_DIR_ENV] = str(path)
    yield path
    if before is None:
        del os.environ[registry.PROFILE_DIR_ENV]
    else:
        os.environ[registry.PROFILE_DIR_ENV] = before


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A pinned environment for kvstreamd.config.load(path, env): computed defaults follow it, no
    /etc file is consulted."""
    from kvstreamd import config

    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "etc-kvstreamd-config.toml")
    return {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "HOME": str(tmp_path / "home")}


@pytest.fixture(scope="session")
def small_profile(tmp_path_factory) -> profiles.Profile:
    samples = [(synthetic_kv(400, seed=1), 0), (synthetic_kv(300, seed=2), 400)]
    sens = np.linspace(0.5, 2.0, SMALL["layers"] * 2).reshape(SMALL["layers"], 2)
    C = SMALL["heads"] * SMALL["head_dim"]
    weights = np.random.default_rng(0).uniform(0.1, 10.0, (SMALL["layers"], 2, C))  # uneven component steps
    prof = profiles.fit(samples, model_id="synthetic-test-model", rope_theta=10000.0, sensitivity=sens,
                        channel_weight=weights, kl_budget=1e-2)
    path = tmp_path_factory.mktemp("profile") / "synthetic.kvprofile"
    prof.save(path)
    prof = profiles.Profile.load(path)
    registry.register(prof)
    return prof


@pytest.fixture(scope="session")
@system_fixture
def lm():
    from kvstreamd import models

    torch.set_num_threads(MODEL_THREADS)
    return models.load()


@pytest.fixture(scope="session")
def codec_pool():
    """One codec pool of one worker for every in-process daemon of the session (Daemon's
    codec_pool): its worker imports torch once, not once a test; each daemon teaches it its
    profile (CodecPool.add_profile) and leaves it running when it stops."""
    from codec.pool.parallel import CodecPool

    pool = CodecPool(1)
    yield pool
    pool.close()


@pytest.fixture
async def inprocess(tmp_path, small_profile, codec_pool):
    """Daemons in this test's event loop (no subprocess, no root): `await inprocess(["a", "b"],
    codec={...})` starts one per name, each with its own store, API socket and peer port on
    loopback, peered with the others (not with `peered=False`: a Redis directory finds them),
    with `per_node={name: {section: {...}}}` config of its own,
    coding with the small synthetic profile (or the one given as `profile=`) on the session's
    codec pool, or with `own_pool=True` (or other than one codec worker) on a pool of their own,
    for tests that kill or count the workers. All are stopped at the end."""
    from kvstreamd import config as config_mod
    from kvstreamd.node.daemon import Daemon
    from kvstreamd.lab.daemons import DaemonProcess

    profile_path = tmp_path / "synthetic.kvprofile"
    small_profile.save(profile_path)
    started: list[Daemon] = []

    async def start(names: list[str], profile: profiles.Profile | None = None, peered: bool = True,
                    per_node: dict[str, dict] | None = None, own_pool: bool = False, **extra: dict) -> list[Daemon]:
        path = profile_path
        if profile is not None:
            path = tmp_path / f"{profile.id.hex()}.kvprofile"
            profile.save(path)
        codec_cfg = {**SYNTHETIC_CODEC, "profile": str(path), **extra.pop("codec", {})}
        nodes = [DaemonProcess(n, tmp_path / n, extra={"codec": codec_cfg, **extra, **(per_node or {}).get(n, {})})
                 for n in names]
        daemons = []
        for n in nodes:
            n.peers = [m.addr for m in nodes if m is not n] if peered else []
            n.root.mkdir(parents=True, exist_ok=True)
            n.config_path.write_text(n.config_text())
            cfg = config_mod.load(n.config_path)
            shared = not own_pool and cfg.workers() == codec_pool.workers
            d = Daemon(cfg, codec_pool=codec_pool if shared else None)
            await d.start()
            started.append(d)
            daemons.append(d)
        return daemons

    yield start
    for d in reversed(started):
        stop = asyncio.ensure_future(d.stop())
        await asyncio.wait({stop}, timeout=STOP_TIMEOUT_S)
        if not stop.done():  # a hang is a failure that says where, not a run that never ends
            stacks = "\n".join(f"{t.get_name()}:\n{_awaiting(t.get_coro())}" for t in asyncio.all_tasks())
            stop.cancel()
            raise AssertionError(f"daemon {d.node_id} did not stop within {STOP_TIMEOUT_S} s; tasks:\n{stacks}")
        stop.result()


def _awaiting(coro) -> str:
    """Where a coroutine waits, down its chain of awaits."""
    lines = []
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        lines.append(f"  {coro.cr_frame.f_code.co_filename}:{coro.cr_frame.f_lineno} {coro.cr_frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None)
    if coro is not None:
        lines.append(f"  awaiting {coro!r}"[:300])
    return "\n".join(lines)


@pytest.fixture
@system_fixture
def redis_server(tmp_path):
    """A real redis-server on a free port (kvstreamd/lab/redisserver.py), stopped at the end."""
    from kvstreamd.lab.redisserver import RedisServer

    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


@pytest.fixture
@system_fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root): writes really fail with ENOSPC."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=30)
        why = r.stderr.strip() or f"exit {r.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        r, why = None, str(e)
    if r is None or r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (needs root): {why}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
