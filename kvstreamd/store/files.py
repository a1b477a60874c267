"""The store's directory: one chunk file per key, written crash-safe, the scan that indexes the
files at open, and the quarantine bad files are moved to.

Layout: `<dir>/chunks/<first 2 hex digits of key>/<64 hex digits of key>.kvc`
(kvstreamd.store.chunkfile is the file format) and `<dir>/quarantine/`. A file is written to a
temp file in its directory (`.<hex key>.<random>.tmp`), flushed, fsynced, renamed over the final
name with os.replace, then the directory is fsynced, so a crash leaves either no file or a whole
one (plus maybe a temp file, which the next scan removes). Bad files are moved to quarantine/:
never served, never counted in budgets, left for the operator; the reason is logged at WARNING.
Nothing here takes a lock: the store orders calls for one key.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvstreamd.store import chunkfile
from kvstreamd.store.chunkfile import ChunkFileError, ChunkRecord, Header

log = logging.getLogger(__name__)

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
_NAME = re.compile(r"[0-9a-f]{64}\.kvc")
_SUBDIR = re.compile(r"[0-9a-f]{2}")


@dataclass(frozen=True)
class Found:
    """A chunk file the scan accepted."""
    key: bytes
    mtime_ns: int
    header: Header


@dataclass(frozen=True)
class Scan:
    found: list[Found]  # oldest mtime first (ties by key)
    corrupt: list[tuple[Path, str]]  # (path as found, reason) for every entry skipped


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ChunkDir:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.chunks = self.root / "chunks"
        self.quarantine_dir = self.root / "quarantine"

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.chunks / h[:2] / (h + SUFFIX)

    def create(self) -> None:
        self.chunks.mkdir(parents=True, exist_ok=True)
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)

    def write(self, rec: ChunkRecord) -> None:
        """Write one chunk file atomically (temp, fsync, rename, fsync dir). Raises OSError, leaving
        neither the temp nor the final file behind."""
        final = self.path(rec.key)
        sub = final.parent
        if not sub.is_dir():
            sub.mkdir(parents=True, exist_ok=True)
            fsync_dir(sub.parent)
        tmp = sub / f".{rec.key.hex()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        replaced = False
        try:
            with open(tmp, "xb") as f:
                chunkfile.write(f, rec)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            replaced = True
            fsync_dir(sub)
        except BaseException:
            for p in ([final] if replaced else [tmp]):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            raise

    def read(self, key: bytes) -> ChunkRecord:
        """The chunk, every field and the CRC checked. Raises ChunkFileError or OSError."""
        with open(self.path(key), "rb") as f:
            return chunkfile.decode(f.read(), key)

    def read_header(self, key: bytes) -> chunkfile.Header:
        """The chunk's header alone (its payloads not read, so not CRC-checked). Raises
        ChunkFileError or OSError."""
        with open(self.path(key), "rb") as f:
            return chunkfile.read_header(f, os.fstat(f.fileno()).st_size, key)

    def unlink(self, key: bytes) -> None:
        """Remove a chunk's file; a missing file is not an error. Raises OSError."""
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def touch(self, key: bytes) -> None:
        """Bump the file's mtime (best effort): the disk LRU order roughly survives a restart."""
        try:
            os.utime(self.path(key))
        except OSError:
            pass

    def fsync(self) -> None:
        if self.chunks.is_dir():
            fsync_dir(self.chunks)
            fsync_dir(self.root)

    def quarantine(self, path: Path, reason: str) -> None:
        dest = self.quarantine_dir / path.name
        n = 0
        while dest.exists():
            n += 1
            dest = self.quarantine_dir / f"{path.name}.{n}"
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
            log.warning("%s: %s; moved to %s", path, reason, dest)
        except OSError as e:
            log.error("%s: %s; could not quarantine it (%s), leaving it in place", path, reason, e)

    def scan(self, verify: bool = False) -> Scan:
        """Check every entry under chunks/: its name, and its file's header, size and key
        (verify=True: every byte, CRC included). Leftover temp files are removed, other bad
        entries quarantined; both are reported."""
        found: list[Found] = []
        corrupt: list[tuple[Path, str]] = []

        def bad(path: Path, reason: str) -> None:
            corrupt.append((path, reason))
            self.quarantine(path, reason)

        for top in sorted(os.scandir(self.chunks), key=lambda e: e.name):
            path = Path(top.path)
            if not (_SUBDIR.fullmatch(top.name) and top.is_dir(follow_symlinks=False)):
                bad(path, "unexpected entry in chunks/")
                continue
            for ent in sorted(os.scandir(path), key=lambda e: e.name):
                fpath = Path(ent.path)
                if ent.name.endswith(TMP_SUFFIX) and ent.is_file(follow_symlinks=False):
                    reason = "leftover temp file (removed)"
                    try:
                        os.unlink(fpath)
                    except OSError as e:
                        reason = f"leftover temp file (could not remove: {e})"
                    log.warning("%s: %s", fpath, reason)
                    corrupt.append((fpath, reason))
                    continue
                if not (_NAME.fullmatch(ent.name) and ent.name.startswith(top.name)
                        and ent.is_file(follow_symlinks=False)):
                    bad(fpath, "unexpected file name or type")
                    continue
                key = bytes.fromhex(ent.name[:-len(SUFFIX)])
                try:
                    st = ent.stat(follow_symlinks=False)
                    with open(fpath, "rb") as f:
                        if verify:
                            header = chunkfile.check(f.read(), key)
                        else:
                            header = chunkfile.read_header(f, st.st_size, key)
                except ChunkFileError as e:
                    bad(fpath, str(e))
                    continue
                except OSError as e:
                    bad(fpath, f"unreadable: {e}")
                    continue
                found.append(Found(key, st.st_mtime_ns, header))
        found.sort(key=lambda x: (x.mtime_ns, x.key))
        return Scan(found, corrupt)

