"""The profiles this process knows, by id (what a chunk names) and by model (what its new
chunks are coded with): the shipped ones, codec/profiles/, and any registered."""
from __future__ import annotations

from pathlib import Path

from .errors import CodecError
from .profile import Profile

SHIPPED_DIR = Path(__file__).parent / "profiles"
RETIRED_DIR = SHIPPED_DIR / "retired"

_registry: dict[bytes, Profile] = {}
_retired: set[bytes] = set()  # registered to decode what was stored with them, never to encode


def register(profile: Profile) -> Profile:
    _registry[profile.id] = profile
    return profile


def shipped() -> list[Profile]:
    """The profiles that ship with kvstreamd, registered: codec/profiles/*.kvprofile, the one
    each model encodes with (returned), and codec/profiles/retired/*.kvprofile, the ones its
    models encoded with before, kept only so that the chunks stored with them still decode."""
    current = [register(Profile.load(p)) for p in sorted(SHIPPED_DIR.glob("*.kvprofile"))]
    for p in sorted(RETIRED_DIR.glob("*.kvprofile")):
        _retired.add(register(Profile.load(p)).id)
    return current


def find(profile_id: bytes) -> Profile:
    if profile_id not in _registry:
        shipped()
    try:
        return _registry[profile_id]
    except KeyError:
        raise CodecError(f"bitstream was coded with profile {profile_id.hex()}, which is not known here") from None


def for_model(model_id: str) -> Profile:
    """The shipped (or registered) profile for model_id."""
    if not any(p.model_id == model_id and p.id not in _retired for p in _registry.values()):
        shipped()
    for p in _registry.values():
        if p.model_id == model_id and p.id not in _retired:
            return p
    raise CodecError(f"no codec profile for model {model_id!r}; make one with `kvstreamd profile calibrate`")
