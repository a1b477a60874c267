"""The config's value parsers: (TOML value, where, ctx) -> Python value, each raising
ConfigError("<file>: [section] key: ...") for a value it cannot use. config.py's schema names one
per key; these know nothing of sections or reload rules."""
from __future__ import annotations

import ipaddress
import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Mapping

_SUN_PATH_MAX = 107  # AF_UNIX path bytes (sun_path is 108 with the terminating NUL)

KiB, MiB, GiB = 2**10, 2**20, 2**30


class ConfigError(Exception):
    """A configuration that cannot be used; the message names the file and the key."""


# ---------------------------------------------------------------------------------------------
# Parsers: (TOML value, where, ctx) -> Python value, raising ConfigError("<where>: ...").
# `where` is "<file>: [section] key".

@dataclass(frozen=True)
class _Ctx:
    file: str                 # the file name as shown in messages
    base: Path                # relative paths resolve against this directory
    env: Mapping[str, str]


Parser = Callable[[Any, str, _Ctx], Any]


def _show(value: Any) -> str:
    """A value as it would be written in TOML (near enough for messages)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    return type(value).__name__  # dates and times


def _wrong_type(value: Any, where: str, expected: str) -> ConfigError:
    return ConfigError(f"{where}: expected {expected}, got {_toml_type(value)} {_show(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range(lo=None, hi=None) -> str:
    if hi is None:
        return f">= {lo}"
    return f"{lo}..{hi}"


def _int(lo: int | None = None, hi: int | None = None) -> Parser:
    def parse(value, where, ctx):
        if not _is_int(value):
            raise _wrong_type(value, where, "an integer")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ConfigError(f"{where}: {value} is out of range ({_range(lo, hi)})")
        return value
    return parse


def _float(gt: float | None = None) -> Parser:
    def parse(value, where, ctx):
        if not (_is_int(value) or isinstance(value, float)):
            raise _wrong_type(value, where, "a number")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {_show(value)} is not a finite number")
        if gt is not None and not value > gt:
            raise ConfigError(f"{where}: {_show(value)} must be > {gt:g}")
        return float(value)
    return parse


def _choice(*choices: str) -> Parser:
    def parse(value, where, ctx):
        if not isinstance(value, str):
            raise _wrong_type(value, where, "a string")
        if value.lower() not in choices:
            raise ConfigError(f"{where}: {_show(value)} is not one of {', '.join(choices)}")
        return value.lower()
    return parse


def _device(value, where, ctx) -> str:
    if not isinstance(value, str):
        raise _wrong_type(value, where, "a string")
    v = value.strip().lower()
    if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
        return v
    raise ConfigError(f'{where}: {_show(value)} is not "auto", "cpu", "cuda" or "cuda:N"')


def _bool(value, where, ctx) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(value, where, "true or false")
    return value


def _string(value, where, ctx) -> str:
    if not isinstance(value, str):
        raise _wrong_type(value, where, "a string")
    return value


MIN_SECRET_BYTES = 16
MAKE_SECRET = "head -c 32 /dev/urandom | base64"


def check_secret(secret: bytes, where: str) -> bytes:
    """A cluster secret long enough to resist guessing (the HMAC handshake is only as strong)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: the secret is {len(secret)} bytes; a cluster secret is at least "
                          f"{MIN_SECRET_BYTES} (make one with: {MAKE_SECRET})")
    return secret


def _secret(value, where, ctx) -> str:
    value = _string(value, where, ctx)
    if value:  # "" means none is set
        check_secret(value.encode("utf-8", "surrogatepass"), where)
    return value


def _node_id(value, where, ctx) -> str:
    value = _string(value, where, ctx)
    n = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= n <= 255:
        raise ConfigError(f"{where}: {_show(value)} is {n} bytes of UTF-8; a node id is 1..255")
    return value


def _path(value, where, ctx) -> Path | None:
    """A path; "" means None (or, for computed keys, never reaches here)."""
    value = _string(value, where, ctx)
    if value == "":
        return None
    if "\0" in value:
        raise ConfigError(f"{where}: {_show(value)} contains a NUL byte")
    p = Path(value)
    return p if p.is_absolute() else ctx.base / p


def _mode(value, where, ctx) -> int:
    """A file mode: an integer (write it 0o660 in TOML) or an octal string "0660"/"660"."""
    if isinstance(value, str) and re.fullmatch(r"(0o?)?[0-7]{1,4}", value):
        value = int(value.removeprefix("0o") or "0", 8)
    elif not _is_int(value):
        raise _wrong_type(value, where, 'a file mode (e.g. 0o660 or "0660")')
    if not 0 <= value <= 0o777:
        raise ConfigError(f"{where}: {value:#o} is not a permission mode (0o000..0o777)")
    return value


# Sizes ----------------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", re.ASCII)


def parse_size(value: int | str, where: str) -> int:
    """Bytes from an integer or a string with a unit: "512MiB", "2GiB", "1.5GB", "100kB", "4096".

    Units are case-insensitive; kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024.
    A fractional result is rounded down to whole bytes. `where` prefixes the error message."""
    if _is_int(value):
        if value < 0:
            raise ConfigError(f"{where}: {value} is negative; a size is >= 0")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and m.group(2).lower() in _UNITS:
            try:
                n = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
            except InvalidOperation:  # pragma: no cover - the regex admits only decimals
                pass
            else:
                return int(n)  # truncates toward zero; n >= 0
    elif not isinstance(value, float):
        raise _wrong_type(value, where, 'a size (bytes, or a string such as "512MiB")')
    raise ConfigError(f'{where}: {_show(value)} is not a size (use bytes or e.g. "512MiB", "2GiB")')


def format_size(n: int) -> str:
    """An exact size string in the largest unit that divides n: 1073741824 -> "1GiB",
    1500000000 -> "1500MB", 1000 -> "1kB", 1001 -> "1001B". parse_size inverts it."""
    if n > 0:
        for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "kB"):
            if n % _UNITS[unit.lower()] == 0:
                return f"{n // _UNITS[unit.lower()]}{unit}"
    return f"{n}B"


def _size(lo: int = 0, below: int | None = None) -> Parser:
    def parse(value, where, ctx):
        n = parse_size(value, where)
        if n < lo or (below is not None and n >= below):
            span = f">= {format_size(lo)}" + (f" and < {format_size(below)}" if below else "")
            raise ConfigError(f"{where}: {_show(value)} is out of range ({span})")
        return n
    return parse


# Host:port ------------------------------------------------------------------------------------

_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?")


def parse_hostport(value: str, where: str) -> tuple[str, int]:
    """("host", port) from "host:port", "10.0.0.7:9400" or "[fe80::1%eth0]:9400" (IPv6 in
    brackets, returned without them). Port 0..65535; `where` prefixes the error message."""
    if not isinstance(value, str):
        raise _wrong_type(value, where, 'a string "host:port"')
    bad = f"{where}: {_show(value)} is not host:port"
    if value.startswith("["):
        m = re.fullmatch(r"\[([^\]]+)\]:([0-9]+)", value)
        if not m:
            raise ConfigError(f'{bad} (IPv6 is written "[::1]:9400")')
        host, port = m.group(1), m.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{bad}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            raise ConfigError(f'{bad} (e.g. "127.0.0.1:9400")')
        if ":" in host:
            raise ConfigError(f'{bad} (an IPv6 address goes in brackets: "[{host}]:{port}")')
        if not host:
            raise ConfigError(f'{bad}: no host (all interfaces is "0.0.0.0:{port}" or "[::]:{port}")')
        if not _HOST_RE.fullmatch(host):
            raise ConfigError(f"{bad}: {host!r} is not a host name or address")
    if not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise ConfigError(f"{where}: {_show(value)}: port {port!r} is not 0..65535")
    return host, int(port)


def _hostport(value, where, ctx) -> tuple[str, int]:
    return parse_hostport(value, where)


def _listen_or_none(value, where, ctx) -> tuple[str, int] | None:
    """"host:port", or "" for none."""
    return None if value == "" else parse_hostport(value, where)


def _peers(value, where, ctx) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, list):
        raise _wrong_type(value, where, 'an array of "host:port" strings')
    out: list[tuple[str, int]] = []
    for i, item in enumerate(value):
        hp = parse_hostport(item, f"{where}[{i}]")
        if hp[1] == 0:
            raise ConfigError(f"{where}[{i}]: {_show(item)}: a peer needs a port (1..65535)")
        if hp in out:
            raise ConfigError(f"{where}[{i}]: {_show(item)} is listed twice")
        out.append(hp)
    return tuple(out)


def _levels(value, where, ctx) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _wrong_type(value, where, "an array of level names")
    from codec.tuning import catalog  # lazily: codec imports torch

    known = catalog.names()
    if not value:
        raise ConfigError(f"{where}: [] is empty; at least one level is needed (e.g. [\"balanced\"])")
    for name in value:
        if name == catalog.TEXT:
            raise ConfigError(f'{where}: "{catalog.TEXT}" is always available; do not list it')
        if name not in known:
            raise ConfigError(f"{where}: {_show(name)} is not a level (known: {', '.join(known)})")
    dup = sorted({n for n in value if value.count(n) > 1})
    if dup:
        raise ConfigError(f"{where}: {_show(dup[0])} is listed twice")
    return tuple(value)


# Computed defaults ----------------------------------------------------------------------------
