"""The daemon's configuration: `config.toml` -> frozen dataclasses.

Every key has a default, so an empty file (or no file) is a valid configuration. The schema is
the dataclasses below: each field carries, in its metadata, the parser that turns the TOML value
into the Python value (and checks it), and whether a change can be applied at run time (SIGHUP)
or needs a restart. Unknown sections and keys, wrong types and bad values raise `ConfigError`
naming the file and the key, e.g.

    /etc/kvstreamd/config.toml: [store] memory_budget: "12 parsecs" is not a size (use bytes or e.g. "512MiB", "2GiB")

Relative paths in a file are taken relative to that file's directory. Three keys are computed
when absent or "": [node] id (the host name), [api] socket (`default_socket`) and [store] dir
(`default_store_dir`); both of the latter follow the directories systemd creates for the unit.

The file is long (~500 lines) on purpose: it is the whole schema, every key with its parser,
default and reload rule in one place, so that the keys config.toml documents and the keys the
daemon accepts cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import socket as _socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from kvstreamd.config_values import (  # the parsers, and the names callers import from here
    _SUN_PATH_MAX,
    KiB,
    MiB,
    GiB,
    ConfigError,
    _Ctx,
    Parser,
    _show,
    _toml_type,
    _wrong_type,
    _is_int,
    _int,
    _float,
    _choice,
    _device,
    _bool,
    _string,
    check_secret,
    _secret,
    _node_id,
    _path,
    _mode,
    _size,
    parse_hostport,
    _hostport,
    _listen_or_none,
    _peers,
    _levels,
    _UNITS,
    format_size,
    parse_size,
)
from .experiment import Experiment
from .limits import MAX_DEADLINE_MS

# parse_size, format_size and _UNITS are imported above for config's callers too (config.parse_size)

log = logging.getLogger(__name__)

DEFAULT_PATH = Path("/etc/kvstreamd/config.toml")
ENV_CONFIG = "KVSTREAMD_CONFIG"
_NO_FILE = "(built-in defaults)"  # stands for the file name in messages when there is no file
def _is_root() -> bool:
    return os.geteuid() == 0


def _abs_dir(value: str | None) -> Path | None:
    """The first entry of a (systemd: colon-separated) directory variable, if absolute."""
    if not value:
        return None
    first = value.split(":")[0]
    return Path(first) if os.path.isabs(first) else None  # XDG: relative values are ignored


def default_socket(env: Mapping[str, str] | None = None) -> Path:
    """$RUNTIME_DIRECTORY/api.sock (systemd's RuntimeDirectory=), else
    $XDG_RUNTIME_DIR/kvstreamd/api.sock, else /run/kvstreamd/api.sock as root, else
    /tmp/kvstreamd-<uid>/api.sock."""
    env = os.environ if env is None else env
    if d := _abs_dir(env.get("RUNTIME_DIRECTORY")):
        return d / "api.sock"
    if d := _abs_dir(env.get("XDG_RUNTIME_DIR")):
        return d / "kvstreamd" / "api.sock"
    if _is_root():
        return Path("/run/kvstreamd/api.sock")
    return Path(f"/tmp/kvstreamd-{os.getuid()}/api.sock")


def default_store_dir(env: Mapping[str, str] | None = None) -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=), else $XDG_STATE_HOME/kvstreamd, else
    /var/lib/kvstreamd as root, else ~/.local/state/kvstreamd."""
    env = os.environ if env is None else env
    if d := _abs_dir(env.get("STATE_DIRECTORY")):
        return d
    if d := _abs_dir(env.get("XDG_STATE_HOME")):
        return d / "kvstreamd"
    if _is_root():
        return Path("/var/lib/kvstreamd")
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "state" / "kvstreamd"


# ---------------------------------------------------------------------------------------------
# The schema. One field per key: default, parser, and whether SIGHUP may change it.


def _key(default: Any = dataclasses.MISSING, *, parse: Parser, reload: bool = False,
         computed: Callable[[Mapping[str, str]], Any] | None = None, **kw) -> Any:
    meta = {"parse": parse, "reload": reload, "computed": computed}
    if computed is not None:  # built directly (not via load): compute from os.environ
        return field(default_factory=lambda: computed(os.environ), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class NodeConfig:
    id: str = _key(parse=_node_id, computed=lambda env: _socket.gethostname())
    log_level: str = _key("info", parse=_choice("debug", "info", "warning", "error"), reload=True)
    zone: str = _key("", parse=_string)


@dataclass(frozen=True)
class ApiConfig:
    socket: Path = _key(parse=_path, computed=default_socket)
    socket_mode: int = _key(0o660, parse=_mode)
    max_fetches: int = _key(16, parse=_int(1), reload=True)
    buffer_lease_s: float = _key(300.0, parse=_float(gt=0), reload=True)
    spare_buffer_bytes: int = _key(512 * MiB, parse=_size(0), reload=True)
    metrics_listen: tuple[str, int] | None = _key(None, parse=_listen_or_none)  # GET /metrics over TCP


@dataclass(frozen=True)
class PeerConfig:
    listen: tuple[str, int] = _key(("127.0.0.1", 9400), parse=_hostport)
    peers: tuple[tuple[str, int], ...] = _key((), parse=_peers, reload=True)
    secret: str = _key("", parse=_secret, reload=True, repr=False)  # never in logs
    secret_file: Path | None = _key(None, parse=_path, reload=True)
    tls_cert: Path | None = _key(None, parse=_path)  # all three or none: see Config.tls()
    tls_key: Path | None = _key(None, parse=_path)
    tls_ca: Path | None = _key(None, parse=_path)
    max_frame_bytes: int = _key(128 * MiB, parse=_size(64 * KiB, 4 * GiB))
    handshake_timeout_s: float = _key(5.0, parse=_float(gt=0))
    write_stall_s: float = _key(10.0, parse=_float(gt=0))  # transport.aio.DEFAULT_WRITE_STALL_S
    max_keys_per_peer: int = _key(1_000_000, parse=_int(1))
    retry_min_s: float = _key(0.5, parse=_float(gt=0), reload=True)
    retry_max_s: float = _key(30.0, parse=_float(gt=0), reload=True)


def _preload_paths(value, where, ctx) -> tuple[Path, ...]:
    """[store] preload: text files and folders of them, as an array of paths or one path."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise _wrong_type(value, where, "an array of paths to text files or folders (or one path)")
    paths = []
    for i, item in enumerate(items):
        path = _path(item, f"{where}[{i}]" if isinstance(value, list) else where, ctx)
        if path is None and isinstance(value, list):
            raise ConfigError(f"{where}[{i}]: \"\" is not a path")
        if path is not None:
            paths.append(path)
    return tuple(paths)


@dataclass(frozen=True)
class StoreConfig:
    dir: Path = _key(parse=_path, computed=default_store_dir)
    memory_budget: int = _key(1 * GiB, parse=_size(0), reload=True)
    disk_budget: int = _key(8 * GiB, parse=_size(0), reload=True)
    keep_fetched: bool = _key(True, parse=_bool, reload=True)
    pin_budget: int = _key(1 * GiB, parse=_size(0), reload=True)
    preload: tuple[Path, ...] = _key((), parse=_preload_paths)
    preload_model: str = _key("", parse=_string)


def _share(value, where, ctx) -> float:
    value = _float(gt=0)(value, where, ctx)
    if value > 1:
        raise ConfigError(f"{where}: {_show(value)} is a share of the budget: at most 1")
    return value


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool = _key(False, parse=_bool, reload=True)
    max_successors: int = _key(2, parse=_int(1, 16), reload=True)
    min_count: int = _key(2, parse=_int(1), reload=True)
    window_s: float = _key(300.0, parse=_float(gt=0), reload=True)
    memory_share: float = _key(0.25, parse=_share, reload=True)
    max_contexts: int = _key(256, parse=_int(1, 1_000_000))
    deadline_ms: int = _key(30_000, parse=_int(1, MAX_DEADLINE_MS), reload=True)


@dataclass(frozen=True)
class CodecConfig:
    chunk_tokens: int = _key(1024, parse=_int(256, 4096))
    levels: tuple[str, ...] = _key(("high", "balanced", "fast"), parse=_levels, reload=True)
    profile: Path | None = _key(None, parse=_path)
    workers: int = _key(0, parse=_int(0))
    device: str = _key("auto", parse=_device)
    warm_tables: str = _key("first_use", parse=_choice("first_use", "start", "lazy"))


@dataclass(frozen=True)
class FetchConfig:
    deadline_ms: int = _key(2000, parse=_int(1, MAX_DEADLINE_MS), reload=True)
    recompute_tokens_per_s: float = _key(250.0, parse=_float(gt=0), reload=True)
    stall_s: float = _key(2.0, parse=_float(gt=0), reload=True)


def _experiment(value, where, ctx) -> Experiment:
    """[policy] experiment = {fraction, rule, levels}: see config.toml."""
    if not isinstance(value, dict):
        raise _wrong_type(value, where, "a table {fraction = 0.01, rule = \"cachegen\", levels = [...]}")
    from transport.policy import RULES  # lazily, as codec: numpy

    known = {"fraction": None, "rule": None, "levels": None}
    for key in value:
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown key ({_did_you_mean(key, known)})")
    fraction = value.get("fraction", 0.0)
    if not (_is_int(fraction) or isinstance(fraction, float)) or not 0 <= fraction <= 1:
        raise ConfigError(f"{where}.fraction: {_show(fraction)} is not a share of fetches (a number 0..1)")
    rule = _string(value.get("rule", ""), f"{where}.rule", ctx)
    if rule and rule not in RULES:
        raise ConfigError(f"{where}.rule: {_show(rule)} is not a rule (known: {', '.join(RULES)})")
    levels = _levels(value["levels"], f"{where}.levels", ctx) if value.get("levels") else ()
    if fraction > 0 and not rule and not levels:
        raise ConfigError(f"{where}: fraction {_show(fraction)} but neither rule nor levels: the candidate "
                          "arm would be the control arm (name a rule, a level ladder or both)")
    return Experiment(float(fraction), rule, levels)


def _without_password(url: str) -> str:
    """A Redis URL as an error message may show it: any password replaced by ***."""
    return re.sub(r"(//[^/@]*?:)[^/@]*@", r"\1***@", url)


def _redis_url(value, where, ctx) -> str:
    if not isinstance(value, str):
        raise _wrong_type(value, where, 'a string "redis://host:port/db"')
    shown = _show(_without_password(value))
    if not re.match(r"(redis|rediss|unix)://", value):
        raise ConfigError(f'{where}: {shown} is not a Redis URL (e.g. "redis://10.0.0.5:6379/0", '
                          f'"rediss://..." for TLS, "unix:///run/redis/redis.sock")')
    url = urlsplit(value)
    if url.scheme == "unix":
        if not url.path:
            raise ConfigError(f"{where}: {shown} names no socket path")
        return value
    try:
        port = url.port  # (a port that is not a number, or past 65535, raises here, as in redis-py)
    except ValueError as e:
        raise ConfigError(f"{where}: {shown}: {e}") from None
    if not url.hostname:
        raise ConfigError(f"{where}: {shown} names no host")
    if port == 0:
        raise ConfigError(f"{where}: {shown}: port 0 is not a port Redis listens on")
    db = url.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"{where}: {shown}: the database after the last / is a number (e.g. /0), "
                          f"not {_show(db)}")
    return value


def _address(value, where, ctx) -> str:
    if value:
        parse_hostport(value, where)
    return value


@dataclass(frozen=True)
class DirectoryConfig:
    backend: str = _key("peers", parse=_choice("peers", "redis"))
    url: str = _key("redis://127.0.0.1:6379/0", parse=_redis_url)
    prefix: str = _key("kvstreamd:", parse=_string)
    address: str = _key("", parse=_address)
    lease_s: float = _key(10.0, parse=_float(gt=0))
    idle_s: float = _key(30.0, parse=_float(gt=0), reload=True)


@dataclass(frozen=True)
class PolicyConfig:
    experiment: Experiment = _key(Experiment(), parse=_experiment, reload=True)


_SECTIONS: dict[str, type] = {
    "node": NodeConfig, "api": ApiConfig, "peer": PeerConfig, "directory": DirectoryConfig,
    "prefetch": PrefetchConfig,
    "store": StoreConfig, "codec": CodecConfig, "fetch": FetchConfig,
    "policy": PolicyConfig,
}


@dataclass(frozen=True)
class Config:
    node: NodeConfig = field(default_factory=NodeConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    directory: DirectoryConfig = field(default_factory=DirectoryConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    source: Path | None = None  # the file it came from; None for built-in defaults

    def secret(self) -> bytes | None:
        """The cluster secret: [peer] secret (UTF-8), or the stripped contents of [peer]
        secret_file, read now (so a reload picks up a new file); None when neither is set."""
        if self.peer.secret:
            return self.peer.secret.encode()
        path = self.peer.secret_file
        if path is None:
            return None
        where = self.where("[peer] secret_file")
        try:
            data = path.read_bytes().strip()
            mode = path.stat().st_mode
        except OSError as e:
            raise ConfigError(f"{where}: cannot read {str(path)!r}: {e.strerror or e}") from None
        if not data:
            raise ConfigError(f"{where}: {str(path)!r} is empty")
        check_secret(data, f"{where} {str(path)!r}")
        if mode & 0o004:
            log.warning("%s: %s is world-readable; chmod o-r it", where, path)
        return data

    def tls(self):
        """The peer links' TLS (a transport.tls.PeerTLS) from [peer] tls_cert, tls_key and
        tls_ca, the files read now; None when they are not set (plaintext links). A file that
        does not load is a ConfigError naming the key and the file."""
        p = self.peer
        if p.tls_cert is None:
            return None
        from transport import tls

        try:
            return tls.contexts(p.tls_cert, p.tls_key, p.tls_ca)
        except tls.TLSFileError as e:
            raise ConfigError(f"{self.where(f'[peer] tls_{e.which}')}: {str(e.path)!r}: {e.why}") from None

    def where(self, key: str) -> str:
        """Where a key was set, as error messages name it: "<file>: [section] key"."""
        return f"{self.source or _NO_FILE}: {key}"

    def workers(self) -> int:
        """Codec worker processes: [codec] workers, or 0 -> one per CPU this process may use."""
        if self.codec.workers:
            return self.codec.workers
        try:
            return len(os.sched_getaffinity(0)) or 1
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            return os.cpu_count() or 1


def keys() -> list[tuple[str, str]]:
    """Every (section, key) in schema order."""
    return [(s, f.name) for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


# ---------------------------------------------------------------------------------------------
# Loading

def load(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read and check a configuration file.

    path None: $KVSTREAMD_CONFIG if set, else /etc/kvstreamd/config.toml if it exists, else the
    built-in defaults (source None). A path given (or named by $KVSTREAMD_CONFIG) must exist.
    env (default os.environ) supplies the variables the computed defaults follow."""
    env = os.environ if env is None else env
    if path is None:
        if env.get(ENV_CONFIG):
            path = env[ENV_CONFIG]
        elif DEFAULT_PATH.exists():
            path = DEFAULT_PATH
    if path is None:
        return _build({}, _Ctx(_NO_FILE, Path.cwd(), env), None)
    path = Path(path)
    ctx = _Ctx(str(path), Path(os.path.abspath(path)).parent, env)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None
    return _build(data, ctx, path)


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"


RENAMED = {"stream": "fetch"}  # old section name -> new; a file with the old name still loads


def _build(data: dict, ctx: _Ctx, source: Path | None) -> Config:
    f = ctx.file
    data = dict(data)
    for old, new in RENAMED.items():
        if old in data:
            if new in data:
                raise ConfigError(f"{f}: [{old}] is the old name of [{new}]; keep only [{new}]")
            log.warning("%s: [%s] is now called [%s]; it is read as [%s]", f, old, new, new)
            data[new] = data.pop(old)
    for name, value in data.items():
        if name not in _SECTIONS:
            raise ConfigError(f"{f}: unknown section [{name}] ({_did_you_mean(name, _SECTIONS)})")
        if not isinstance(value, dict):
            raise ConfigError(f"{f}: {name}: expected a table [{name}], got {_toml_type(value)} {_show(value)}")
    sections = {}
    for name, cls in _SECTIONS.items():
        table = data.get(name, {})
        fields = {fl.name: fl for fl in dataclasses.fields(cls)}
        for key in table:
            if key not in fields:
                raise ConfigError(f"{f}: [{name}] {key}: unknown key ({_did_you_mean(key, fields)})")
        values = {}
        for key, fl in fields.items():
            where = f"{f}: [{name}] {key}"
            computed = fl.metadata["computed"]
            if key in table and not (computed is not None and table[key] == ""):
                values[key] = fl.metadata["parse"](table[key], where, ctx)
            elif computed is not None:
                values[key] = computed(ctx.env)
            # else: the dataclass default
        sections[name] = cls(**values)
    cfg = Config(**sections, source=source)
    _check(cfg, f)
    return cfg


def _check(cfg: Config, f: str) -> None:
    """Rules across keys, and on computed values."""
    p = cfg.peer
    if p.secret and p.secret_file is not None:
        raise ConfigError(f"{f}: [peer] secret: set either [peer] secret or [peer] secret_file, not both")
    if p.peers and not p.secret and p.secret_file is None:
        raise ConfigError(f"{f}: [peer] secret: peers are configured but no secret: "
                          "set [peer] secret or [peer] secret_file")
    if cfg.directory.backend == "redis" and not p.secret and p.secret_file is None:
        raise ConfigError(f"{f}: [peer] secret: [directory] backend = \"redis\" finds peers but there is no "
                          "secret to join them with: set [peer] secret or [peer] secret_file")
    tls = {k: getattr(p, k) for k in ("tls_cert", "tls_key", "tls_ca")}
    if any(v is not None for v in tls.values()):
        unset = [k for k, v in tls.items() if v is None]
        if unset:
            given = ", ".join(f"[peer] {k}" for k, v in tls.items() if v is not None)
            raise ConfigError(f"{f}: [peer] {unset[0]}: not set, but {given} is: TLS needs all three of "
                              "[peer] tls_cert, tls_key and tls_ca (or none of them, for plaintext)")
    if p.retry_max_s < p.retry_min_s:
        raise ConfigError(f"{f}: [peer] retry_max_s: {p.retry_max_s:g} is less than "
                          f"[peer] retry_min_s = {p.retry_min_s:g}")
    n = len(os.fsencode(cfg.api.socket))
    if n > _SUN_PATH_MAX:
        raise ConfigError(f"{f}: [api] socket: {str(cfg.api.socket)!r} is {n} bytes; a Unix socket "
                          f"path is at most {_SUN_PATH_MAX}: set a shorter one")


def reloadable_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """The keys that differ between two configurations, as "[section] key": (those a running
    daemon applies on SIGHUP, those that need a restart). Equal configurations give ([], [])."""
    runtime: list[str] = []
    restart: list[str] = []
    for name, cls in _SECTIONS.items():
        a, b = getattr(old, name), getattr(new, name)
        for fl in dataclasses.fields(cls):
            if getattr(a, fl.name) != getattr(b, fl.name):
                (runtime if fl.metadata["reload"] else restart).append(f"[{name}] {fl.name}")
    return runtime, restart


def reloaded(old: Config, new: Config) -> Config:
    """What a running daemon on `old` runs on once it has reloaded `new`: `new`, except that the
    keys that need a restart keep their running values."""
    sections = {}
    for name in _SECTIONS:
        a, b = getattr(old, name), getattr(new, name)
        keep = {k.name: getattr(a, k.name) for k in dataclasses.fields(a) if not k.metadata["reload"]}
        sections[name] = dataclasses.replace(b, **keep)
    return Config(**sections, source=new.source)
