"""Shared fixtures: a small synthetic codec profile (fast, for property tests), the real model
(loaded once per session), daemons in the test's event loop, and a really small disk."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from codec import profile as profiles

SMALL = dict(layers=3, heads=2, head_dim=8)

# What makes a test a `system` test (pyproject.toml's markers): a fixture that starts a daemon in
# the test's loop (its codec pool spawns a worker that imports torch) or loads the real model, or
# a file whose tests start daemon processes, network namespaces or real servers.
SYSTEM_FIXTURES = {"lm", "inprocess"}
SYSTEM_FILES = {
    "test_ab.py", "test_alert_rules.py", "test_bench_directory.py", "test_bench_gpu.py", "test_bench_scale.py",
    "test_codec_model.py", "test_corpus.py", "test_daemon.py", "test_daemon_netns.py", "test_directory_redis.py",
    "test_doctor.py", "test_e2e.py", "test_fanout.py", "test_faults_bounds.py", "test_faults_client.py",
    "test_faults_peer.py", "test_faults_resources.py", "test_gemma.py", "test_metrics_listen.py",
    "test_model_folder.py", "test_models.py", "test_netns.py", "test_prefetch.py", "test_preload.py",
    "test_stream_bench.py", "test_systemd.py", "test_tls.py", "test_window.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SYSTEM_FILES or SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.system)


def synthetic_kv(tokens: int, seed: int = 0, layers=SMALL["layers"], heads=SMALL["heads"],
                 head_dim=SMALL["head_dim"]) -> torch.Tensor:
    """KV-like data: channels of very different scales, keys with a per-channel offset."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1.5, 0.7, heads * head_dim).view(heads, head_dim)
    kv = torch.randn(layers, 2, tokens, heads, head_dim, generator=g) * scale
    kv[:, 0] += torch.linspace(-2, 2, heads * head_dim).view(heads, head_dim)
    return kv


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
    profiles.register(prof)
    return prof


@pytest.fixture(scope="session")
def lm():
    from kvstreamd import models

    torch.set_num_threads(2)
    return models.load()


def synthetic_daemon(root, name: str, profile: profiles.Profile, codec: dict | None = None, **extra: dict):
    """A real daemon process (kvstreamd.lab.daemons.DaemonProcess, not started) under root/name,
    coding with `profile` (the small synthetic one), 256-token chunks and one codec worker
    unless `codec` says otherwise; `extra` adds config sections."""
    from kvstreamd.lab.daemons import DaemonProcess

    path = root / f"{name}.kvprofile"
    profile.save(path)
    codec_cfg = {"chunk_tokens": 256, "workers": 1, "profile": str(path), **(codec or {})}
    return DaemonProcess(name, root / name, extra={"codec": codec_cfg, **extra})


@pytest.fixture
async def inprocess(tmp_path, small_profile):
    """Daemons in this test's event loop (no subprocess, no root): `await inprocess(["a", "b"],
    codec={...})` starts one per name, each with its own store, API socket and peer port on
    loopback, peered with the others (not with `peered=False`: a Redis directory finds them),
    with `per_node={name: {section: {...}}}` config of its own,
    coding with the small synthetic profile (or the one given as `profile=`). All are stopped
    at the end."""
    from kvstreamd import config as config_mod
    from kvstreamd.node.daemon import Daemon
    from kvstreamd.lab.daemons import DaemonProcess

    profile_path = tmp_path / "synthetic.kvprofile"
    small_profile.save(profile_path)
    started: list[Daemon] = []

    async def start(names: list[str], profile: profiles.Profile | None = None, peered: bool = True,
                    per_node: dict[str, dict] | None = None, **extra: dict) -> list[Daemon]:
        path = profile_path
        if profile is not None:
            path = tmp_path / f"{profile.id.hex()}.kvprofile"
            profile.save(path)
        codec_cfg = {"chunk_tokens": 256, "workers": 1, "profile": str(path), **extra.pop("codec", {})}
        nodes = [DaemonProcess(n, tmp_path / n, extra={"codec": codec_cfg, **extra, **(per_node or {}).get(n, {})})
                 for n in names]
        daemons = []
        for n in nodes:
            n.peers = [m.addr for m in nodes if m is not n] if peered else []
            n.root.mkdir(parents=True, exist_ok=True)
            n.config_path.write_text(n.config_text())
            d = Daemon(config_mod.load(n.config_path))
            await d.start()
            started.append(d)
            daemons.append(d)
        return daemons

    yield start
    for d in reversed(started):
        await d.stop()


@pytest.fixture
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
