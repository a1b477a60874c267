"""The profiles this process knows: by id, what a chunk names (`find`), and by model, the one
its new chunks are coded with (`for_model`).

Where profiles come from, highest precedence first:

1. explicit: a file the caller names (`for_model(model_id, path)`: a command's `--profile`;
   the daemon's `[codec] profile`; a codec pool's profile_paths), or a profile `register()`ed;
2. the search folders, in order (`folders()`): the user folder, `$KVSTREAMD_PROFILE_DIR`, else
   `$XDG_DATA_HOME/kvstreamd/profiles` (`~/.local/share/kvstreamd/profiles`), where `kvstreamd
   profile calibrate` writes; then the shipped one, codec/profiles/.

In each folder `*.kvprofile` may encode and `retired/*.kvprofile` only decode (chunks stored
with them). Of several profiles for one model at one precedence, the one registered last wins,
and in a folder the file modified last (on equal times, the name first in sort order); the
others still decode. Every process reads the same folders (codec workers inherit the
environment), so a chunk a pool's worker codes with a folder's profile decodes in its parent.

A folder is read when first needed and again when a lookup misses (an id or a model not
known): a profile added beside the one a model already codes with is taken at the next start.
A file that does not load is skipped, with a warning that names it (once per version of the
file), and named again in the error of a lookup that fails.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import CodecError, ProfileError
from ..profile import Profile

log = logging.getLogger(__name__)

PROFILE_DIR_ENV = "KVSTREAMD_PROFILE_DIR"
SHIPPED_DIR = Path(__file__).parents[1] / "profiles"  # codec/profiles/
SUFFIX = ".kvprofile"
RETIRED = "retired"  # a folder's subfolder of profiles that only decode


def user_dir(env: dict[str, str] | None = None) -> Path:
    """The user's profile folder: $KVSTREAMD_PROFILE_DIR, else $XDG_DATA_HOME/kvstreamd/profiles
    (XDG: a relative value is ignored), else ~/.local/share/kvstreamd/profiles."""
    env = os.environ if env is None else env
    if env.get(PROFILE_DIR_ENV):
        return Path(env[PROFILE_DIR_ENV]).expanduser().absolute()
    data = env.get("XDG_DATA_HOME", "")
    if os.path.isabs(data):
        return Path(data) / "kvstreamd" / "profiles"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "kvstreamd" / "profiles"


@dataclass(frozen=True)
class Folder:
    name: str  # what a profile found there is called: "user", "shipped"
    path: Path

    def files(self) -> list[tuple[Path, bool]]:
        """(file, whether its profile may encode) for each profile file in the folder (none
        where it does not exist)."""
        return ([(p, True) for p in sorted(self.path.glob("*" + SUFFIX))]
                + [(p, False) for p in sorted((self.path / RETIRED).glob("*" + SUFFIX))])


def folders() -> list[Folder]:
    """The search folders, highest precedence first."""
    return [Folder("user", user_dir()), Folder("shipped", SHIPPED_DIR)]


def user_file(profile: Profile) -> Path:
    """Where `kvstreamd profile calibrate` saves a profile unless told: the user folder, named
    for its model and its id (a new calibration never replaces a profile stored chunks name)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", profile.model_id.rpartition(":")[0].lower() or profile.model_id.lower())
    return user_dir() / f"{name.strip('-.') or 'model'}-{profile.id.hex()[:8]}{SUFFIX}"


@dataclass(frozen=True)
class _File:
    """A profile file as it was when read."""
    folder: Folder
    encodes: bool  # False: in the folder's retired/
    stamp: tuple[int, int]  # (mtime_ns, size): read again when it changes
    profile_id: bytes | None  # None: it does not load
    error: str | None = None  # why not, naming the file


_lock = threading.RLock()  # the daemon looks profiles up from several threads
_profiles: dict[bytes, Profile] = {}  # every profile this process has read or been given
_explicit: dict[bytes, int] = {}  # register()ed profile ids -> when (the later wins)
_order = itertools.count()
_files: dict[Path, _File] = {}  # the search folders' profile files, as last read
_read_from: list[Folder] | None = None  # the folders _files were read from


def register(profile: Profile) -> Profile:
    """Know `profile`, as an explicit one: its model codes with it unless another of that
    model's is registered after it."""
    with _lock:
        _profiles[profile.id] = profile
        _explicit[profile.id] = next(_order)
    return profile


def find(profile_id: bytes) -> Profile:
    """The profile a chunk names; CodecError if it is not known here."""
    with _lock:
        if profile_id not in _profiles:
            _read()
        prof = _profiles.get(profile_id)
        if prof is None:
            raise CodecError(f"bitstream was coded with profile {profile_id.hex()}, which is not known here "
                             f"({_searched()})")
        return prof


def for_model(model_id: str, path: str | Path | None = None) -> Profile:
    """The profile model_id's chunks are coded with: the file `path` where one is named (it must
    be model_id's), else the first by precedence (the module's docstring). ProfileError if none."""
    if path is not None:
        try:
            prof = Profile.load(path)
        except CodecError as e:  # its message starts with the file
            raise ProfileError(str(e)) from None
        except OSError as e:
            raise ProfileError(f"{path}: {e.strerror or e}") from None
        if prof.model_id != model_id:
            raise ProfileError(f"{path}: the profile of model {prof.model_id!r}, not of {model_id!r}")
        return register(prof)
    with _lock:
        if _read_from != folders():
            _read()
        prof = _choose(model_id)
        if prof is None:
            _read()
            prof = _choose(model_id)
        if prof is None:
            raise ProfileError(f"no codec profile for model {model_id!r} ({_searched()}); make one with "
                               "`kvstreamd profile calibrate`")
        return prof


def current() -> list[Profile]:
    """The profile each known model codes with (for_model's choice), the folders read."""
    with _lock:
        if _read_from != folders():
            _read()
        models = {_profiles[i].model_id for i in _explicit}
        models |= {_profiles[f.profile_id].model_id for f in _files.values() if f.encodes and f.profile_id}
        return [_choose(m) for m in sorted(models)]


def source(profile: Profile) -> str:
    """Where `profile` comes from: "explicit", or the name of the search folder it was read
    from ("user", "shipped"), or "" where it is none of these."""
    with _lock:
        if profile.id in _explicit:
            return "explicit"
        return next((f.folder.name for f in _files.values() if f.profile_id == profile.id), "")


def _choose(model_id: str) -> Profile | None:
    explicit = [(when, pid) for pid, when in _explicit.items() if _profiles[pid].model_id == model_id]
    if explicit:
        return _profiles[max(explicit)[1]]
    for folder in _read_from or ():
        found = [(-f.stamp[0], path.name, f.profile_id) for path, f in _files.items()
                 if f.folder == folder and f.encodes and f.profile_id and _profiles[f.profile_id].model_id == model_id]
        if found:
            return _profiles[min(found)[2]]
    return None


def _read() -> None:
    """Read the search folders' profile files that are new or changed since they were read,
    and forget those no longer there (their profiles still decode)."""
    global _read_from
    now = folders()
    seen = set()
    for folder in now:
        for path, encodes in folder.files():
            if path in seen:  # one folder inside another's list (the user folder set to the shipped one)
                continue
            seen.add(path)
            try:
                st = path.stat()
                stamp = (st.st_mtime_ns, st.st_size)
            except OSError:  # gone since it was listed
                continue
            old = _files.get(path)
            if old is not None and (old.folder, old.encodes, old.stamp) == (folder, encodes, stamp):
                continue
            _files[path] = _load(path, folder, encodes, stamp)
    for path in [p for p in _files if p not in seen]:
        del _files[path]
    _read_from = now


def _load(path: Path, folder: Folder, encodes: bool, stamp: tuple[int, int]) -> _File:
    try:
        prof = Profile.load(path)
    except CodecError as e:  # its message starts with the file
        error = str(e)
    except OSError as e:
        error = f"{path}: {e.strerror or e}"
    except Exception as e:  # noqa: BLE001 -- whatever a file makes the loader raise, it is one file skipped
        error = f"{path}: {type(e).__name__}: {e}"
    else:
        _profiles.setdefault(prof.id, prof)
        return _File(folder, encodes, stamp, prof.id)
    log.warning("profile file skipped: %s", error)
    return _File(folder, encodes, stamp, None, error)


def _searched() -> str:
    """The folders searched, and the files there that did not load."""
    text = "searched: " + ", ".join(f"{f.name} {f.path}" for f in _read_from or folders())
    bad = [f.error for f in _files.values() if f.error]
    return text + ("; skipped: " + "; ".join(bad) if bad else "")
