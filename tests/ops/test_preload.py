"""What `[store] preload` reads before any daemon runs (kvstreamd/ops/preload.py): the documents a
list of paths names, and the preload child's environment under systemd. A daemon preloading them is
tests/system/test_preload.py's."""
from __future__ import annotations

from kvstreamd.ops import preload
from kvstreamd.ops.preload_child import child_env


def test_documents_are_files_and_the_txt_files_of_folders_and_each_bad_path_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("b.txt", "a.txt", "notes.md"):
        (tmp_path / "d" / name).write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "one.text").write_text("x")
    docs, bad = preload.documents([tmp_path / "one.text", tmp_path / "d", tmp_path / "empty", tmp_path / "gone.txt"])
    assert docs == [tmp_path / "one.text", tmp_path / "d" / "a.txt", tmp_path / "d" / "b.txt"]
    assert [o.error for o in bad] == [f"{tmp_path / 'empty'}: a folder with no *.txt files",
                                      f"{tmp_path / 'gone.txt'}: no such file or folder"]


def test_under_systemd_the_preload_child_keeps_the_model_in_the_units_cache_directory():
    env = child_env({"CACHE_DIRECTORY": "/var/cache/kvstreamd", "HOME": "/nonexistent"})
    assert env["XDG_CACHE_HOME"] == "/var/cache/kvstreamd" and env["TQDM_DISABLE"] == "1"
    assert child_env({"XDG_CACHE_HOME": "/c", "CACHE_DIRECTORY": "/v"})["XDG_CACHE_HOME"] == "/c"
