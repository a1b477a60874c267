"""Where profiles come from (codec.tuning.registry): explicit ones, then the user profile folder, then
the shipped one; the user folder searched by every process, codec workers included; a file
there that does not load named in one warning, the others still coding.

The registry is the process's: each test codes a model id of its own, so what one test put in
the registry chooses nothing for another."""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec import profile as profiles
from codec.tuning import registry
from codec.pool.parallel import CodecPool
from tests.fixtures import synthetic_kv


def _model() -> str:
    return f"user-model-{uuid.uuid4().hex[:8]}:{uuid.uuid4().hex[:16]}"


def _profile_of(small_profile: profiles.Profile, model_id: str, note: str = "") -> profiles.Profile:
    """The small synthetic profile's tables as model_id's own profile (a new id)."""
    return profiles.Profile(dict(small_profile.meta, model_id=model_id, source=note), dict(small_profile.tensors))


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    folder = tmp_path / "user-profiles"
    folder.mkdir()
    monkeypatch.setenv(registry.PROFILE_DIR_ENV, str(folder))
    return folder


def test_the_user_folder_follows_the_environment(tmp_path):
    assert registry.user_dir({registry.PROFILE_DIR_ENV: str(tmp_path), "XDG_DATA_HOME": "/x"}) == tmp_path
    assert registry.user_dir({"XDG_DATA_HOME": "/data", "HOME": "/home/u"}) == Path("/data/kvstreamd/profiles")
    for env in ({"HOME": "/home/u"}, {"XDG_DATA_HOME": "relative/ignored", "HOME": "/home/u"},
                {registry.PROFILE_DIR_ENV: "", "HOME": "/home/u"}):
        assert str(registry.user_dir(env)) == "/home/u/.local/share/kvstreamd/profiles", env
    assert [f.name for f in registry.folders()] == ["user", "shipped"]


def test_calibrate_names_its_file_in_the_user_folder_by_model_and_id(user_folder, small_profile):
    prof = _profile_of(small_profile, "My Model/v2_Q4:0123456789abcdef")
    path = registry.user_file(prof)
    assert path.parent == user_folder
    assert path.name == f"my-model-v2_q4-{prof.id.hex()[:8]}.kvprofile"


def test_a_user_folder_profile_codes_here_and_in_a_codec_worker(user_folder, small_profile, caplog):
    """A profile saved to the user folder is what for_model gives its model, find knows it by
    id, and a codec worker (handed no profile file) codes with it: the parent decodes its chunk."""
    model = _model()
    prof = _profile_of(small_profile, model)
    path = prof.save(user_folder / "mine.kvprofile")
    (user_folder / "damaged.kvprofile").write_bytes(b"\x00" * 40)  # beside it: skipped, not fatal
    with caplog.at_level(logging.WARNING, logger="codec.tuning.registry"):
        chosen = registry.for_model(model)
    assert chosen.id == prof.id and chosen.path == path
    assert registry.find(prof.id) is chosen and registry.source(chosen) == "user"
    kv = synthetic_kv(70, seed=3).half()
    with CodecPool(1, warm_levels=()) as pool:
        data = pool.encode(kv, "balanced", chosen, start=5)
        from_worker = pool.decode(data).clone()
    assert torch.equal(from_worker, codec.decode(data))
    assert data == codec.encode(kv, "balanced", chosen, start=5)
    assert torch.equal(codec.decode(data), codec.decode(codec.encode(kv, "balanced", prof, start=5)))
    warned = [r.getMessage() for r in caplog.records if r.name == "codec.tuning.registry"]
    assert [w.split(": ")[1] for w in warned] == [str(user_folder / "damaged.kvprofile")]


def test_a_damaged_file_in_the_user_folder_is_one_warning_naming_it(user_folder, small_profile, caplog):
    model = _model()
    good = _profile_of(small_profile, model)
    good.save(user_folder / "good.kvprofile")
    bad = user_folder / "bad.kvprofile"
    bad.write_bytes(b"not a profile at all")
    empty = user_folder / "empty.kvprofile"
    empty.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="codec.tuning.registry"):
        assert registry.for_model(model).id == good.id
        kv = synthetic_kv(40, seed=4)
        assert codec.decode(codec.encode(kv, "fast", good, start=0)).shape == kv.shape  # others decode
        with pytest.raises(codec.CodecError) as unknown:
            registry.find(b"\x01" * 16)  # a miss reads the folder again: the files are not warned of twice
        with pytest.raises(codec.CodecError) as none:
            registry.for_model(_model())
    warned = [r.getMessage() for r in caplog.records if r.name == "codec.tuning.registry"]
    assert len(warned) == 2, warned
    assert all("\n" not in w and w.startswith("profile file skipped: ") for w in warned)
    assert any(w.startswith(f"profile file skipped: {bad}: not a readable profile file") for w in warned)
    assert any(w.startswith(f"profile file skipped: {empty}: ") for w in warned)
    for e in (unknown.value, none.value):
        assert f"skipped: {bad}: not a readable profile file" in str(e) and str(user_folder) in str(e)


def test_user_folder_before_shipped_and_newest_file_first(user_folder, small_profile):
    shipped = profiles.Profile.load(registry.SHIPPED_DIR / "smollm2-135m-instruct.kvprofile")
    mine = _profile_of(small_profile, shipped.model_id, "the user's own")
    mine.save(user_folder / "smollm2-mine.kvprofile")
    assert registry.for_model(shipped.model_id).id == mine.id  # the user folder before the shipped one

    model = _model()
    older, newer = (_profile_of(small_profile, model, n) for n in ("older", "newer"))
    older_path, newer_path = older.save(user_folder / "b-older.kvprofile"), newer.save(user_folder / "z-newer.kvprofile")
    os.utime(older_path, ns=(2_000_000_000_000_000_000,) * 2)
    os.utime(newer_path, ns=(2_000_000_001_000_000_000,) * 2)
    assert registry.for_model(model).id == newer.id
    assert registry.find(older.id).id == older.id  # the one not chosen still decodes

    tied = _model()
    first, second = (_profile_of(small_profile, tied, n) for n in ("first", "second"))
    for name, prof in (("a.kvprofile", first), ("b.kvprofile", second)):
        os.utime(prof.save(user_folder / name), ns=(2_000_000_000_000_000_000,) * 2)
    assert registry.for_model(tied).id == first.id  # equal times: the name first in order


def test_explicit_before_the_user_folder(user_folder, small_profile, tmp_path):
    model = _model()
    in_folder = _profile_of(small_profile, model, "in the folder")
    in_folder.save(user_folder / "in-folder.kvprofile")
    named = _profile_of(small_profile, model, "named")
    path = named.save(tmp_path / "named.kvprofile")
    assert registry.for_model(model).id == in_folder.id
    chosen = registry.for_model(model, path)
    assert chosen.id == named.id and registry.source(chosen) == "explicit"
    assert registry.for_model(model).id == named.id  # named once, it codes the model in this process
    with pytest.raises(codec.CodecError, match="not of 'another-model'"):
        registry.for_model("another-model", path)
    with pytest.raises(codec.CodecError, match="no-such.kvprofile"):
        registry.for_model(model, tmp_path / "no-such.kvprofile")


def test_a_retired_profile_in_the_user_folder_only_decodes(user_folder, small_profile):
    model = _model()
    old = _profile_of(small_profile, model, "retired")
    (user_folder / "retired").mkdir()
    old.save(user_folder / "retired" / "old.kvprofile")
    data = codec.encode(synthetic_kv(30, seed=6), "high", old, start=0)
    assert codec.decode(data).shape[2] == 30  # found by the id the chunk names
    with pytest.raises(codec.CodecError, match="no codec profile for model"):
        registry.for_model(model)


# -- hostile files: each one file skipped, with one warning naming it, and nothing read past a bound --

def _container(header: bytes, length: int | None = None) -> bytes:
    """A safetensors container: u64 header length (`length`, else the header's own), the header."""
    return (len(header) if length is None else length).to_bytes(8, "little") + header


def hostile_files(folder: Path, small_profile: profiles.Profile, model_id: str) -> dict[str, str]:
    """Files a careless or hostile hand may leave in a profile folder: {name: what its warning says}."""
    (folder / "overflow.kvprofile").write_bytes(_container(
        b'{"pca_mean": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}'))
    (folder / "deep.kvprofile").write_bytes(_container(b"[" * 100_000 + b"]" * 100_000))
    os.mkfifo(folder / "fifo.kvprofile")
    with open(folder / "huge.kvprofile", "wb") as f:  # a 192 MiB header, sparse: refused by its length
        f.write((192 << 20).to_bytes(8, "little"))
        f.truncate(8 + (192 << 20))
    tensors = {k: np.array(v) for k, v in small_profile.tensors.items()}
    tensors["pca_sigma"].flat[3] = np.nan
    profiles.Profile(dict(small_profile.meta, model_id=model_id, source="nan"), tensors).save(folder / "nan.kvprofile")
    later = os.stat(folder / "nan.kvprofile").st_mtime_ns + 10**9
    os.utime(folder / "nan.kvprofile", ns=(later, later))  # the newest of its model's
    return {"overflow.kvprofile": "the number 1e999 is not finite", "deep.kvprofile": "RecursionError",
            "fifo.kvprofile": "not a regular file", "huge.kvprofile": f"a header of {192 << 20} bytes",
            "nan.kvprofile": "profile tensors ['pca_sigma'] hold NaN or infinite values"}


def test_hostile_files_in_the_user_folder_are_each_one_warning_and_the_model_codes_with_the_good_one(
        user_folder, small_profile, caplog):
    model = _model()
    good = _profile_of(small_profile, model)
    good.save(user_folder / "good.kvprofile")
    why = hostile_files(user_folder, small_profile, model)
    with caplog.at_level(logging.WARNING, logger="codec.tuning.registry"):
        assert registry.for_model(model).id == good.id
    warned = [r.getMessage() for r in caplog.records if r.name == "codec.tuning.registry"]
    assert len(warned) == len(why), warned
    for name, says in why.items():
        [w] = [w for w in warned if w.startswith(f"profile file skipped: {user_folder / name}: ")]
        assert says in w and "\n" not in w, w


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_profile_whose_metadata_holds_a_number_that_is_not_finite_does_not_load(small_profile, value):
    data = profiles.Profile(dict(small_profile.meta, level_scales={"high": value}), dict(small_profile.tensors)).to_bytes()
    with pytest.raises(codec.CodecError, match=r"^x: not a readable profile file \(ValueError: -?(Infinity|NaN) is not a number a profile holds\)$"):
        profiles.Profile.from_bytes(data, "x")
