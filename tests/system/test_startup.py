"""A daemon that cannot start says why in one line ("cannot start: ..."), with no traceback,
and exits 2 for a configuration that cannot work (a file it names that cannot be had, a value
that cannot be) or 1 for a host that cannot run it now (no processes or file descriptors for
the codec workers): systemd's journal shows the one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codec.profile import Profile
from codec.tuning import registry
from kvstreamd.lab.daemons import DaemonProcess
from tests.codec.test_registry import hostile_files

pytestmark = pytest.mark.system  # subprocesses of the CLI, every test


def start_up(tmp_path: Path, toml: str, prefix: tuple[str, ...] = (), socket: str = "api.sock"
             ) -> subprocess.CompletedProcess:
    """`kvstreamd run` on `toml` (its [api] socket and [store] dir in tmp_path), under `prefix`."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[api]\nsocket = "{tmp_path}/{socket}"\n[store]\ndir = "{tmp_path}/store"\n' + toml)
    return subprocess.run([*prefix, sys.executable, "-m", "kvstreamd.cli", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120)


def assert_one_line_refusal(out: subprocess.CompletedProcess, *words: str, code: int = 2) -> None:
    assert out.returncode == code, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [ln for ln in out.stderr.splitlines() if "cannot start: " in ln]
    assert all(w in line for w in words), line


def test_a_missing_secret_file_stops_start_up_in_one_line_with_exit_2(tmp_path):
    out = start_up(tmp_path, f'[peer]\nlisten = "127.0.0.1:0"\nsecret_file = "{tmp_path}/gone"\n')
    assert_one_line_refusal(out, "[peer] secret_file", "gone")


def test_a_socket_whose_parent_is_a_file_stops_start_up_in_one_line_with_exit_2(tmp_path):
    (tmp_path / "file").write_text("")
    out = start_up(tmp_path, '[peer]\nlisten = "127.0.0.1:0"\n', socket="file/api.sock")
    assert_one_line_refusal(out, "[api] socket", f"{tmp_path}/file")


@pytest.mark.parametrize("url, why", [
    ("redis://127.0.0.1:notaport/0", "Port could not be cast to integer"),
    ("redis://127.0.0.1:99999/0", "Port out of range"),
    ("redis://127.0.0.1:6379/zero", "the database after the last / is a number"),
])
def test_a_redis_url_with_a_bad_port_or_database_stops_start_up_in_one_line_with_exit_2(tmp_path, url, why):
    out = start_up(tmp_path, f'[peer]\nlisten = "127.0.0.1:0"\nsecret = "a-cluster-secret-of-32-characters"\n'
                             f'[directory]\nbackend = "redis"\nurl = "{url}"\n')
    assert_one_line_refusal(out, "[directory] url", url, why)


def test_a_redis_url_in_an_error_never_shows_its_password(tmp_path):
    out = start_up(tmp_path, '[peer]\nlisten = "127.0.0.1:0"\nsecret = "a-cluster-secret-of-32-characters"\n'
                             '[directory]\nbackend = "redis"\nurl = "redis://:hunter2@127.0.0.1:notaport/0"\n')
    assert_one_line_refusal(out, "[directory] url", "redis://:***@127.0.0.1:notaport/0")
    assert "hunter2" not in out.stderr + out.stdout


def test_a_codec_profile_that_does_not_load_stops_start_up_in_one_line_with_exit_2(tmp_path):
    (tmp_path / "bad.kvprofile").write_bytes(b"not a profile")
    out = start_up(tmp_path, f'[peer]\nlisten = "127.0.0.1:0"\n[codec]\nprofile = "{tmp_path}/bad.kvprofile"\n')
    assert_one_line_refusal(out, "[codec] profile", "bad.kvprofile", "not a readable profile file")


def test_codec_workers_that_cannot_start_stop_start_up_in_one_line_with_exit_1(tmp_path):
    """24 file descriptors let the daemon open its store, not start two workers (each needs pipes)."""
    out = start_up(tmp_path, '[peer]\nlisten = "127.0.0.1:0"\n[codec]\nworkers = 2\n', prefix=("prlimit", "--nofile=24"))
    assert_one_line_refusal(out, "[codec] workers", "could not start", "Too many open files", code=1)


@pytest.mark.parametrize("make, why", [
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.write_bytes((200_000).to_bytes(8, "little") + b"[" * 100_000 + b"]" * 100_000), "RecursionError"),
])
def test_a_codec_profile_that_is_a_fifo_or_too_deep_stops_start_up_in_one_line_with_exit_2(tmp_path, make, why):
    make(tmp_path / "bad.kvprofile")
    out = start_up(tmp_path, f'[peer]\nlisten = "127.0.0.1:0"\n[codec]\nprofile = "{tmp_path}/bad.kvprofile"\n')
    assert_one_line_refusal(out, "[codec] profile", "bad.kvprofile", why)


def test_hostile_files_in_the_profile_folder_are_skipped_one_warning_each_and_the_daemon_codes(tmp_path, monkeypatch):
    """A FIFO, a 100,000-deep header, a 1e999 shape, a 192 MiB header and a NaN copy of the model's
    own profile, newest, in the user profile folder: the daemon starts, each is named in a warning
    (no traceback), and its chunks are coded with the shipped profile."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    shipped = Profile.load(registry.SHIPPED_DIR / "smollm2-135m-instruct.kvprofile")
    why = hostile_files(folder, shipped, shipped.model_id)
    monkeypatch.setenv(registry.PROFILE_DIR_ENV, str(folder))
    d = DaemonProcess("a", tmp_path / "a", extra={"codec": {"workers": 1, "warm_tables": "lazy", "levels": ["fast"]}})
    try:
        d.start(wait=60)
        kv = torch.randn(shipped.layers, 2, 256, shipped.heads, shipped.head_dim).to(torch.float16)
        tokens = list(range(1000, 1256))
        d.client().put(shipped.model_id, tokens, kv)
        assert d.client().lookup(shipped.model_id, tokens)["local_tokens"] == 256
        assert d.client().health()["status"] == "ok"
    finally:
        d.stop()
    log = d.log()
    assert "Traceback" not in log, log[-3000:]
    for name, says in why.items():
        lines = [ln for ln in log.splitlines() if f"profile file skipped: {folder / name}: " in ln]
        assert lines and all(says in ln for ln in lines), (name, lines or log[-3000:])
