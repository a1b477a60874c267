"""kvstreamd.config: real files in tmp_path, every error naming the file and the key."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from kvstreamd import config
from kvstreamd.config import ConfigError, load, parse_hostport, parse_size

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "kvstreamd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults(env, tmp_path):
    cfg = load(None, env)
    assert cfg.source is None
    assert cfg.node == config.NodeConfig(id=socket.gethostname(), log_level="info")
    assert cfg.api == config.ApiConfig(socket=tmp_path / "run" / "kvstreamd" / "api.sock",
                                       socket_mode=0o660, max_fetches=16, buffer_lease_s=300.0)
    assert cfg.peer.listen == ("127.0.0.1", 9400) and cfg.peer.peers == ()
    assert cfg.peer.secret == "" and cfg.peer.secret_file is None
    assert cfg.peer.max_frame_bytes == 128 * 2**20
    assert (cfg.peer.handshake_timeout_s, cfg.peer.retry_min_s, cfg.peer.retry_max_s) == (5.0, 0.5, 30.0)
    assert cfg.peer.write_stall_s == 10.0
    assert cfg.store == config.StoreConfig(dir=tmp_path / "state" / "kvstreamd",
                                           memory_budget=2**30, disk_budget=8 * 2**30)
    assert cfg.codec == config.CodecConfig(chunk_tokens=1024, levels=("high", "balanced", "fast"),
                                           profile=None, workers=0)
    assert cfg.fetch == config.FetchConfig(deadline_ms=2000, recompute_tokens_per_s=250.0)
    assert cfg.secret() is None
    assert cfg.workers() == len(os.sched_getaffinity(0))
    # Built directly, the dataclasses have the same defaults (computed from os.environ).
    assert config.CodecConfig() == cfg.codec and config.FetchConfig() == cfg.fetch


def test_empty_file_is_the_defaults(env, tmp_path):
    path = write(tmp_path, "")
    cfg = load(path, env)
    assert cfg.source == path
    assert dataclasses.replace(cfg, source=None) == load(None, env)


def test_repo_config_toml_is_the_defaults(env):
    cfg = load(REPO / "config.toml", env)
    assert dataclasses.replace(cfg, source=None) == load(None, env)


def test_repo_config_toml_documents_every_key():
    import tomllib

    data = tomllib.loads((REPO / "config.toml").read_text())
    assert [(s, k) for s, t in data.items() for k in t] == config.keys()


def test_default_path_and_env_var(env, tmp_path, monkeypatch):
    etc = write(tmp_path, "[node]\nid = \"from-etc\"\n", "etc.toml")
    monkeypatch.setattr(config, "DEFAULT_PATH", etc)
    assert load(None, env).node.id == "from-etc"
    assert load(None, env).source == etc
    other = write(tmp_path, "[node]\nid = \"from-env\"\n", "other.toml")
    assert load(None, {**env, "KVSTREAMD_CONFIG": str(other)}).node.id == "from-env"
    with pytest.raises(ConfigError, match="missing.toml: no such file"):
        load(None, {**env, "KVSTREAMD_CONFIG": str(tmp_path / "missing.toml")})
    with pytest.raises(ConfigError, match="nope.toml: no such file"):
        load(tmp_path / "nope.toml", env)


def test_a_full_file(env, tmp_path):
    (tmp_path / "secret").write_text("  s3cret-s3cret-s3cret\n\n")
    path = write(tmp_path, """
[node]
id = "gpu-7"
log_level = "DEBUG"
[api]
socket = "/run/x/api.sock"
socket_mode = "0640"
max_fetches = 4
buffer_lease_s = 60
[peer]
listen = "[::]:0"
peers = ["10.0.0.7:9400", "[fd00::8]:9401", "gpu-8.example:9400"]
secret_file = "secret"
max_frame_bytes = "128MiB"
handshake_timeout_s = 1
retry_min_s = 1.5
retry_max_s = 1.5
[store]
dir = "store"
memory_budget = 0
disk_budget = "1.5GB"
[codec]
chunk_tokens = 2048
levels = ["balanced", "int8", "cachegen-paper"]
profile = "/opt/p.kvprofile"
workers = 3
[fetch]
deadline_ms = 500
recompute_tokens_per_s = 12000
""")
    cfg = load(path, env)
    assert cfg.node == config.NodeConfig(id="gpu-7", log_level="debug")
    assert cfg.api == config.ApiConfig(socket=Path("/run/x/api.sock"), socket_mode=0o640,
                                       max_fetches=4, buffer_lease_s=60.0)
    assert cfg.peer.listen == ("::", 0)
    assert cfg.peer.peers == (("10.0.0.7", 9400), ("fd00::8", 9401), ("gpu-8.example", 9400))
    assert cfg.peer.secret_file == tmp_path / "secret"  # relative to the file
    assert cfg.peer.max_frame_bytes == 128 * 2**20
    assert cfg.store.dir == tmp_path / "store"
    assert (cfg.store.memory_budget, cfg.store.disk_budget) == (0, 1_500_000_000)
    assert cfg.codec == config.CodecConfig(2048, ("balanced", "int8", "cachegen-paper"),
                                           Path("/opt/p.kvprofile"), 3)
    assert cfg.fetch == config.FetchConfig(500, 12000.0)
    assert isinstance(cfg.fetch.recompute_tokens_per_s, float)
    assert cfg.secret() == b"s3cret-s3cret-s3cret"
    assert cfg.workers() == 3
    assert "s3cret" not in repr(load(write(tmp_path, '[peer]\nsecret = "s3cret-s3cret-s3cret"\n', "s.toml"), env))


def test_secret_inline(env, tmp_path):
    cfg = load(write(tmp_path, '[peer]\nsecret = "häsh-häsh-häsh-häsh"\npeers = ["a:1"]\n'), env)
    assert cfg.secret() == "häsh-häsh-häsh-häsh".encode()


def test_secret_file_is_read_on_each_call(env, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"one-one-one-one-one\n")
    cfg = load(write(tmp_path, f'[peer]\nsecret_file = "{secret}"\n'), env)
    assert cfg.secret() == b"one-one-one-one-one"
    secret.write_bytes(b"\ttwo-two-two-two-two  \r\n")
    assert cfg.secret() == b"two-two-two-two-two"
    secret.write_bytes(b" \n")
    with pytest.raises(ConfigError, match=r"kvstreamd.toml: \[peer\] secret_file: .* is empty"):
        cfg.secret()


# ---------------------------------------------------------------------------------------------
# Errors: (file text, the key the message must name, a fragment it must contain).

ERRORS = [
    ("[nosuch]\n", "unknown section [nosuch]", ""),
    ("[codc]\nchunk_tokens = 1\n", "unknown section [codc]", "did you mean codec?"),
    ("codec = 3\n", "codec: expected a table [codec]", "got integer 3"),
    ("[codec]\nchunk_size = 1024\n", "[codec] chunk_size: unknown key", "did you mean chunk_tokens?"),
    ("[codec]\nchunk_tokens = 100\n", "[codec] chunk_tokens", "100 is out of range (256..4096)"),
    ("[codec]\nchunk_tokens = 5000\n", "[codec] chunk_tokens", "out of range"),
    ('[codec]\ndevice = "gpu"\n', "[codec] device", '"auto", "cpu", "cuda" or "cuda:N"'),
    ('[codec]\ndevice = "cuda:x"\n', "[codec] device", "is not"),
    ('[codec]\nchunk_tokens = "1024"\n', "[codec] chunk_tokens", 'expected an integer, got string "1024"'),
    ("[codec]\nchunk_tokens = 1024.0\n", "[codec] chunk_tokens", "expected an integer, got float"),
    ("[codec]\nchunk_tokens = true\n", "[codec] chunk_tokens", "expected an integer, got boolean"),
    ('[codec]\nlevels = ["ultra"]\n', "[codec] levels", '"ultra" is not a level'),
    ("[codec]\nlevels = []\n", "[codec] levels", "empty"),
    ('[codec]\nlevels = ["fast", "fast"]\n', "[codec] levels", '"fast" is listed twice'),
    ('[codec]\nlevels = ["high", "text"]\n', "[codec] levels", '"text" is always available'),
    ('[codec]\nlevels = "fast"\n', "[codec] levels", "expected an array"),
    ("[codec]\nworkers = -1\n", "[codec] workers", "out of range (>= 0)"),
    ("[codec]\nprofile = 3\n", "[codec] profile", "expected a string"),
    ('[store]\nmemory_budget = "12 parsecs"\n', "[store] memory_budget",
     '"12 parsecs" is not a size (use bytes or e.g. "512MiB", "2GiB")'),
    ("[store]\ndisk_budget = -1\n", "[store] disk_budget", "negative"),
    ("[store]\ndisk_budget = 1.5\n", "[store] disk_budget", "1.5 is not a size"),
    ("[store]\nmemory_budget = inf\n", "[store] memory_budget", "inf is not a size"),
    ('[peer]\nlisten = "nohost"\n', "[peer] listen", '"nohost" is not host:port'),
    ('[peer]\nlisten = "h:99999"\n', "[peer] listen", "port '99999' is not 0..65535"),
    ('[peer]\nlisten = "::1:9400"\n', "[peer] listen", "brackets"),
    ('[peer]\nlisten = "[zz::1]:9400"\n', "[peer] listen", "not an IPv6 address"),
    ('[peer]\nlisten = ":9400"\n', "[peer] listen", "no host"),
    ('[peer]\nsecret = "sixteen-byte-secret"\npeers = ["a:1", "b"]\n', "[peer] peers[1]", '"b" is not host:port'),
    ('[peer]\nsecret = "sixteen-byte-secret"\npeers = ["a:0"]\n', "[peer] peers[0]", "a peer needs a port"),
    ('[peer]\nsecret = "sixteen-byte-secret"\npeers = ["a:1", "a:1"]\n', "[peer] peers[1]", "listed twice"),
    ('[peer]\npeers = ["10.0.0.7:9400"]\n', "[peer] secret",
     "peers are configured but no secret: set [peer] secret or [peer] secret_file"),
    ('[peer]\nsecret = "sixteen-byte-secret"\nsecret_file = "/etc/x"\n', "[peer] secret", "not both"),
    ("[peer]\nretry_min_s = 5\nretry_max_s = 1\n", "[peer] retry_max_s", "less than [peer] retry_min_s"),
    ("[peer]\nhandshake_timeout_s = 0\n", "[peer] handshake_timeout_s", ": 0 must be > 0"),
    ("[peer]\nhandshake_timeout_s = nan\n", "[peer] handshake_timeout_s", "not a finite number"),
    ("[peer]\nwrite_stall_s = 0\n", "[peer] write_stall_s", ": 0 must be > 0"),
    ('[peer]\nmax_frame_bytes = "1kB"\n', "[peer] max_frame_bytes", "out of range (>= 64KiB and < 4GiB)"),
    ('[peer]\nmax_frame_bytes = "4GiB"\n', "[peer] max_frame_bytes", "out of range"),
    ('[node]\nlog_level = "loud"\n', "[node] log_level", '"loud" is not one of debug, info, warning, error'),
    ('[codec]\nwarm_tables = "never"\n', "[codec] warm_tables", '"never" is not one of first_use, start, lazy'),
    ('[node]\nid = "' + "é" * 128 + '"\n', "[node] id", "256 bytes of UTF-8"),
    ("[api]\nmax_fetches = 0\n", "[api] max_fetches", "0 is out of range (>= 1)"),
    ("[api]\nbuffer_lease_s = -5\n", "[api] buffer_lease_s", "must be > 0"),
    ("[api]\nsocket_mode = 0o1777\n", "[api] socket_mode", "not a permission mode"),
    ('[api]\nsocket_mode = "rw"\n', "[api] socket_mode", "expected a file mode"),
    ('[api]\nsocket = "/' + "s" * 120 + '"\n', "[api] socket", "at most 107"),
    ("[fetch]\ndeadline_ms = 0\n", "[fetch] deadline_ms", "out of range (1..3600000)"),
    ("[fetch]\nrecompute_tokens_per_s = 0\n", "[fetch] recompute_tokens_per_s", "must be > 0"),
    ("[codec\nchunk_tokens = 1\n", "invalid TOML", "line 1"),
    ("[codec]\nchunk_tokens = 1024\nchunk_tokens = 2048\n", "invalid TOML", ""),
]


@pytest.mark.parametrize("text,key,fragment", ERRORS, ids=[e[1] + ":" + e[2][:20] for e in ERRORS])
def test_errors_name_the_file_and_key(env, tmp_path, text, key, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load(path, env)
    msg = str(err.value)
    assert msg.startswith(f"{path}: {key}"), msg
    assert fragment in msg, msg


def test_error_message_exactly(env, tmp_path):
    path = write(tmp_path, '[store]\nmemory_budget = "12 parsecs"\n', "config.toml")
    with pytest.raises(ConfigError) as err:
        load(path, env)
    assert str(err.value) == (f'{path}: [store] memory_budget: "12 parsecs" is not a size '
                              '(use bytes or e.g. "512MiB", "2GiB")')


def test_unreadable_and_not_utf8(env, tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path, env)  # a directory
    path = tmp_path / "bin.toml"
    path.write_bytes(b'[node]\nid = "\xff"\n')
    with pytest.raises(ConfigError, match=f"^{path}: "):
        load(path, env)


def test_a_secret_under_16_bytes_is_refused_saying_how_to_make_one(env, tmp_path):
    for short in ("s", "fifteen-bytes!!"):
        with pytest.raises(ConfigError) as err:
            load(write(tmp_path, f'[peer]\nsecret = "{short}"\n'), env)
        msg = str(err.value)
        assert "[peer] secret" in msg and f"{len(short)} bytes" in msg and "/dev/urandom" in msg, msg
    load(write(tmp_path, '[peer]\nsecret = "sixteen-bytes!!!"\n'), env)  # 16 is enough


def test_a_secret_file_holding_under_16_bytes_is_refused_saying_how_to_make_one(env, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x\n")
    cfg = load(write(tmp_path, f'[peer]\nsecret_file = "{secret}"\n'), env)
    with pytest.raises(ConfigError) as err:
        cfg.secret()
    msg = str(err.value)
    assert "[peer] secret_file" in msg and "1 bytes" in msg and "/dev/urandom" in msg, msg


def test_a_deadline_over_an_hour_is_out_of_range(env, tmp_path):
    with pytest.raises(ConfigError, match=r"\[fetch\] deadline_ms: 3600001 is out of range"):
        load(write(tmp_path, "[fetch]\ndeadline_ms = 3600001\n"), env)


def test_secret_file_missing_at_secret_time(env, tmp_path):
    path = write(tmp_path, '[peer]\nsecret_file = "gone"\npeers = ["10.0.0.7:9400"]\n')
    cfg = load(path, env)  # the file is read when the secret is needed, not at load time
    with pytest.raises(ConfigError) as err:
        cfg.secret()
    msg = str(err.value)
    assert msg.startswith(f"{path}: [peer] secret_file: cannot read ") and "gone" in msg, msg


# ---------------------------------------------------------------------------------------------
# Sizes and addresses

@pytest.mark.parametrize("text,n", [
    (0, 0), (4096, 4096), ("4096", 4096), ("4096B", 4096), ("100kB", 100_000), ("100KB", 100_000),
    ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("2 GiB", 2 * 2**30), ("2gib", 2 * 2**30),
    ("1.5GB", 1_500_000_000), ("1.5GiB", 3 * 2**29), ("0.5KiB", 512), ("1.3KiB", 1331),
    ("1TiB", 2**40), ("3TB", 3 * 10**12), (".5MB", 500_000),
])
def test_parse_size(text, n):
    assert parse_size(text, "w") == n


@pytest.mark.parametrize("bad", ["", "GiB", "12 parsecs", "-1GiB", "1e9", "1,5GB", "2 Gi", "0x10", "４GiB", True, 1.5, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match=r"^where: "):
        parse_size(bad, "where")


UNITS = ["", "B", "kB", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"]


@given(n=st.integers(0, 10**6), unit=st.sampled_from(UNITS), space=st.booleans())
def test_parse_size_units(n, unit, space):
    mult = config._UNITS[unit.lower()]
    assert parse_size(f"{n}{' ' if space else ''}{unit}", "w") == n * mult


@given(n=st.integers(0, 2**50))
def test_format_size_round_trip(n):
    s = config.format_size(n)
    assert parse_size(s, "w") == n
    assert len(s) <= len(str(n)) + 1


@pytest.mark.parametrize("text,hp", [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)), ("gpu-7.lab.example:1", ("gpu-7.lab.example", 1)),
    ("localhost:0", ("localhost", 0)), ("h:65535", ("h", 65535)), ("[::1]:9400", ("::1", 9400)),
    ("[::]:0", ("::", 0)), ("[fe80::1%eth0]:9400", ("fe80::1%eth0", 9400)),
    ("[2001:db8::7]:443", ("2001:db8::7", 443)),
])
def test_parse_hostport(text, hp):
    assert parse_hostport(text, "w") == hp


@pytest.mark.parametrize("bad", ["nohost", "h:99999", "h:", "h:-1", "h:+80", "h:９４", ":80", "::1:80",
                                 "[::1]", "[::1]80", "[nope]:80", "a b:80", "h/x:80", "-h:80", 9400, ""])
def test_parse_hostport_rejects(bad):
    with pytest.raises(ConfigError, match=r"^where: "):
        parse_hostport(bad, "where")


# ---------------------------------------------------------------------------------------------
# Computed defaults

def test_default_socket(monkeypatch):
    monkeypatch.setattr(config, "_is_root", lambda: False)
    assert config.default_socket({"RUNTIME_DIRECTORY": "/run/kvstreamd", "XDG_RUNTIME_DIR": "/x"}) \
        == Path("/run/kvstreamd/api.sock")
    assert config.default_socket({"RUNTIME_DIRECTORY": "/run/a:/run/b"}) == Path("/run/a/api.sock")
    assert config.default_socket({"XDG_RUNTIME_DIR": "/run/user/1000"}) \
        == Path("/run/user/1000/kvstreamd/api.sock")
    assert config.default_socket({"XDG_RUNTIME_DIR": "relative"}) == Path(f"/tmp/kvstreamd-{os.getuid()}/api.sock")
    assert config.default_socket({}) == Path(f"/tmp/kvstreamd-{os.getuid()}/api.sock")
    monkeypatch.setattr(config, "_is_root", lambda: True)
    assert config.default_socket({}) == Path("/run/kvstreamd/api.sock")
    assert config.default_socket({"XDG_RUNTIME_DIR": "/run/user/0"}) == Path("/run/user/0/kvstreamd/api.sock")


def test_default_store_dir(monkeypatch):
    monkeypatch.setattr(config, "_is_root", lambda: False)
    assert config.default_store_dir({"STATE_DIRECTORY": "/var/lib/kvstreamd", "XDG_STATE_HOME": "/x"}) \
        == Path("/var/lib/kvstreamd")
    assert config.default_store_dir({"XDG_STATE_HOME": "/home/u/.st"}) == Path("/home/u/.st/kvstreamd")
    assert config.default_store_dir({"HOME": "/home/u"}) == Path("/home/u/.local/state/kvstreamd")
    monkeypatch.setattr(config, "_is_root", lambda: True)
    assert config.default_store_dir({"HOME": "/root"}) == Path("/var/lib/kvstreamd")


def test_systemd_directories_reach_the_config(env, tmp_path):
    sd = {**env, "RUNTIME_DIRECTORY": "/run/kvstreamd", "STATE_DIRECTORY": "/var/lib/kvstreamd"}
    cfg = load(REPO / "config.toml", sd)
    assert cfg.api.socket == Path("/run/kvstreamd/api.sock")
    assert cfg.store.dir == Path("/var/lib/kvstreamd")


def test_too_long_computed_socket_is_an_error(env):
    with pytest.raises(ConfigError, match=r"^\(built-in defaults\): \[api\] socket: .* at most 107"):
        load(None, {"RUNTIME_DIRECTORY": "/" + "r" * 110})


# ---------------------------------------------------------------------------------------------
# Reload

def test_reloadable_changes(env, tmp_path):
    old = load(None, env)
    assert config.reloadable_changes(old, old) == ([], [])
    assert config.reloadable_changes(old, load(REPO / "config.toml", env)) == ([], [])  # source differs only
    new = load(write(tmp_path, """
[node]
id = "other"
log_level = "debug"
[api]
max_fetches = 2
buffer_lease_s = 10
socket_mode = 0o600
[peer]
peers = ["a:1"]
secret = "sixteen-byte-secret"
retry_min_s = 1
retry_max_s = 2
listen = "127.0.0.1:9500"
max_frame_bytes = "32MiB"
[store]
memory_budget = "2GiB"
disk_budget = 0
dir = "/srv/kv"
[codec]
levels = ["fast"]
chunk_tokens = 2048
workers = 2
[fetch]
deadline_ms = 100
recompute_tokens_per_s = 1
"""), env)
    runtime, restart = config.reloadable_changes(old, new)
    assert runtime == ["[node] log_level", "[api] max_fetches", "[api] buffer_lease_s",
                       "[peer] peers", "[peer] secret", "[peer] retry_min_s", "[peer] retry_max_s",
                       "[store] memory_budget", "[store] disk_budget", "[codec] levels",
                       "[fetch] deadline_ms", "[fetch] recompute_tokens_per_s"]
    assert restart == ["[node] id", "[api] socket_mode", "[peer] listen", "[peer] max_frame_bytes",
                       "[store] dir", "[codec] chunk_tokens", "[codec] workers"]
    r2, s2 = config.reloadable_changes(old, load(write(tmp_path, '[peer]\nsecret_file = "/s"\n', "f.toml"), env))
    assert (r2, s2) == (["[peer] secret_file"], [])
    r3, s3 = config.reloadable_changes(old, load(write(tmp_path, '[codec]\nprofile = "/p"\n'
                                                       '[api]\nsocket = "/run/k.sock"\n'
                                                       '[peer]\nhandshake_timeout_s = 2\n', "g.toml"), env))
    assert (r3, s3) == ([], ["[api] socket", "[peer] handshake_timeout_s", "[codec] profile"])


def test_the_old_stream_section_still_loads_as_fetch(tmp_path, caplog):
    p = tmp_path / "old.toml"
    p.write_text("[stream]\ndeadline_ms = 1234\n")
    cfg = config.load(p, env={})
    assert cfg.fetch.deadline_ms == 1234
    assert "[stream] is now called [fetch]" in caplog.text


def test_old_and_new_names_of_one_section_together_are_refused(tmp_path):
    p = tmp_path / "both.toml"
    p.write_text("[stream]\ndeadline_ms = 1\n[fetch]\ndeadline_ms = 2\n")
    with pytest.raises(config.ConfigError, match=r"\[stream\] is the old name of \[fetch\]"):
        config.load(p, env={})


# -- [store] preload and pin_budget -------------------------------------------------------------

@pytest.mark.parametrize("text,key,fragment", [
    ("[store]\npreload = 5\n", "[store] preload", "expected an array of paths to text files or folders"),
    ('[store]\npreload = ["a.txt", 3]\n', "[store] preload", "got array"),
    ('[store]\npreload = ["a.txt", ""]\n', "[store] preload[1]", '"" is not a path'),
    ("[store]\npreload_model = 1\n", "[store] preload_model", "expected a string"),
    ('[store]\npin_budget = "lots"\n', "[store] pin_budget", "is not a size"),
])
def test_a_bad_preload_or_pin_budget_is_refused_naming_the_key(env, tmp_path, text, key, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load(path, env)
    assert str(err.value).startswith(f"{path}: {key}: ") and fragment in str(err.value), str(err.value)


def test_preload_paths_are_relative_to_the_file_and_one_path_may_be_a_string(env, tmp_path):
    cfg = load(write(tmp_path, '[store]\npreload = "docs"\npreload_model = "gemma3-270m"\npin_budget = "2GiB"\n'), env)
    assert (cfg.store.preload, cfg.store.preload_model, cfg.store.pin_budget) == ((tmp_path / "docs",),
                                                                                  "gemma3-270m", 2 * 2**30)
    assert load(write(tmp_path, '[store]\npreload = ["/a.txt", "b"]\n'), env).store.preload == (
        Path("/a.txt"), tmp_path / "b")


@pytest.mark.parametrize("url", ["redis://10.0.0.5:6379/0", "redis://redis.local", "rediss://:pw@10.0.0.5:6380/3",
                                 "unix:///run/redis/redis.sock"])
def test_a_redis_url_redis_py_can_use_is_taken(env, tmp_path, url):
    assert load(write(tmp_path, f'[directory]\nurl = "{url}"\n'), env).directory.url == url


@pytest.mark.parametrize("url, why", [
    ("redis://10.0.0.5:notaport/0", "Port could not be cast to integer value as 'notaport'"),
    ("redis://10.0.0.5:99999/0", "Port out of range 0-65535"),
    ("redis://10.0.0.5:0/0", "port 0 is not a port Redis listens on"),
    ("redis://:6379/0", "names no host"),
    ("redis://10.0.0.5:6379/zero", 'the database after the last / is a number (e.g. /0), not "zero"'),
    ("unix://", "names no socket path"),
    ("http://10.0.0.5:6379", "is not a Redis URL"),
])
def test_a_redis_url_that_cannot_be_used_is_refused_at_load_saying_why(env, tmp_path, url, why):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, f'[directory]\nurl = "{url}"\n'), env)
    assert f"[directory] url: {json.dumps(url)}" in str(err.value) and why in str(err.value), str(err.value)


def test_a_redis_url_refused_never_shows_its_password(env, tmp_path):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, '[directory]\nurl = "rediss://user:hunter2@10.0.0.5:notaport/0"\n'), env)
    assert "hunter2" not in str(err.value) and '"rediss://user:***@10.0.0.5:notaport/0"' in str(err.value)
