"""The systemd unit (checked by systemd-analyze verify) and sd_notify over a real socket."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstreamd.ops import sdnotify

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "kvstreamd.service"
DROPIN = REPO / "systemd" / "kvstreamd.conf.d-example.conf"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")


def kvstreamd_bin() -> str:
    """The installed console script (the package is installed into this interpreter's prefix)."""
    path = Path(sys.prefix) / "bin" / "kvstreamd"
    if path.exists():
        return str(path)
    found = shutil.which("kvstreamd")
    assert found, "the kvstreamd console script is not installed"
    return found


def verify(unit_dir: Path, name: str = "kvstreamd.service") -> list[str]:
    """Run `systemd-analyze verify` on unit_dir/name; return its output lines about kvstreamd
    (other lines, if any, concern the host's own units), led by "exit status N" unless N is 0.

    The unit search path is unit_dir (so its drop-ins are read) and the distribution's unit
    directories (for the targets it names), not /etc or /run, whose drop-ins for an installed
    kvstreamd would leak in."""
    search = ":".join([str(unit_dir), "/usr/lib/systemd/system", "/lib/systemd/system"])
    env = {**os.environ, "SYSTEMD_UNIT_PATH": search, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    proc = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(unit_dir / name)],
                          capture_output=True, text=True, env=env, timeout=60)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "kvstreamd" in ln]
    return [f"exit status {proc.returncode}"] + lines if proc.returncode else lines


def installed_copy(tmp_path: Path, unit_text: str | None = None) -> Path:
    """The unit as it would be installed here: ExecStart pointing at the real console script."""
    text = UNIT.read_text() if unit_text is None else unit_text
    text = text.replace("/usr/local/bin/kvstreamd", kvstreamd_bin())
    (tmp_path / "kvstreamd.service").write_text(text)
    return tmp_path


@pytest.mark.system  # systemd-analyze
@needs_analyze
def test_unit_verifies(tmp_path):
    assert verify(installed_copy(tmp_path)) == []


@pytest.mark.system  # systemd-analyze
@needs_analyze
def test_verify_catches_mistakes(tmp_path):
    """The check above is not vacuous: systemd-analyze reports a bad key, a missing binary."""
    out = verify(installed_copy(tmp_path, UNIT.read_text().replace("[Service]\n", "[Service]\nNoSuchKey=1\n")))
    assert any("Unknown key" in ln and "NoSuchKey" in ln for ln in out), out
    (tmp_path / "kvstreamd.service").write_text(UNIT.read_text())  # /usr/local/bin/kvstreamd: absent here
    if not Path("/usr/local/bin/kvstreamd").exists():
        out = verify(tmp_path)
        assert out and out[0] == "exit status 1" and any("not executable" in ln for ln in out), out


@pytest.mark.system  # systemd-analyze
@needs_analyze
def test_dropin_example_verifies(tmp_path):
    """The sample drop-in, with its commented-out settings switched on, over the unit."""
    installed_copy(tmp_path)
    text = DROPIN.read_text().replace("/opt/kvstreamd/.venv/bin/kvstreamd", kvstreamd_bin())
    text = re.sub(r"^#([A-Z][A-Za-z]+=)", r"\1", text, flags=re.M)
    assert "PrivateDevices=no" in text.splitlines()
    (tmp_path / "kvstreamd.service.d").mkdir()
    (tmp_path / "kvstreamd.service.d" / "override.conf").write_text(text)
    assert verify(tmp_path) == []
    # ... and systemd read it: a bad key in it is reported against the drop-in, and an
    # ExecStart= that clears the command without a new one is an error.
    (tmp_path / "kvstreamd.service.d" / "override.conf").write_text(text + "NoSuchKey=1\n")
    assert any("override.conf" in ln and "NoSuchKey" in ln for ln in verify(tmp_path))
    (tmp_path / "kvstreamd.service.d" / "override.conf").write_text("[Service]\nExecStart=\n")
    out = verify(tmp_path)
    assert out and out[0] == "exit status 1" and any("ExecStart" in ln for ln in out), out


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key, []).append(value)
    return sections


def test_unit_settings():
    s = unit_settings(UNIT.read_text())
    service = {k: v[-1] for k, v in s["Service"].items()}
    expected = {
        "Type": "notify", "NotifyAccess": "main",
        "ExecStart": "/usr/local/bin/kvstreamd run --config /etc/kvstreamd/config.toml",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "User": "kvstreamd", "Group": "kvstreamd",
        "RuntimeDirectory": "kvstreamd", "RuntimeDirectoryMode": "0750", "StateDirectory": "kvstreamd",
        "KillSignal": "SIGTERM", "TimeoutStopSec": "30", "Restart": "on-failure",
        "UMask": "0007", "LimitNOFILE": "65536",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes", "LockPersonality": "yes", "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
    }
    assert {k: service.get(k) for k in expected} == expected
    # /dev/shm must stay the host's: nothing may hide or replace it.
    for key in ("DynamicUser", "InaccessiblePaths", "TemporaryFileSystem", "ReadOnlyPaths",
                "MemoryDenyWriteExecute"):
        assert key not in service, key
    assert s["Install"] == {"WantedBy": ["multi-user.target"]}


# ---------------------------------------------------------------------------------------------
# sd_notify

@pytest.fixture
def notify_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify"
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, {"NOTIFY_SOCKET": str(path)}
    sock.close()


def test_notify_sends_one_datagram(notify_socket):
    sock, env = notify_socket
    assert sdnotify.notify("READY=1\nSTATUS=serving", env) is True
    data, _ = sock.recvfrom(4096)
    assert data == b"READY=1\nSTATUS=serving"


def test_helpers(notify_socket):
    sock, env = notify_socket
    assert sdnotify.ready(env=env)
    assert sock.recv(4096) == b"READY=1"
    assert sdnotify.ready("serving 3 peers", env=env)
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving 3 peers"
    assert sdnotify.status("two\nlines", env=env)
    assert sock.recv(4096) == b"STATUS=two lines"
    assert sdnotify.stopping(env=env)
    assert sock.recv(4096) == b"STOPPING=1"
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading(env=env)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    m = re.fullmatch(rb"RELOADING=1\nMONOTONIC_USEC=(\d+)", sock.recv(4096))
    assert m and before <= int(m.group(1)) <= after


def test_notify_abstract_namespace():
    name = f"kvstreamd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(4096) == b"READY=1"


def test_notify_outside_systemd_and_failures(tmp_path, caplog):
    assert sdnotify.notify("READY=1", {}) is False
    assert sdnotify.ready(env={"NOTIFY_SOCKET": ""}) is False
    with caplog.at_level("WARNING", logger="kvstreamd.ops.sdnotify"):
        assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")}) is False
        assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert len(caplog.records) == 2
