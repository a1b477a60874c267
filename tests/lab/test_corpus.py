"""The benchmark and calibration texts: every kind ships inside the package (a fresh clone has
them, nothing beside it needed), each file is the one its README names by sha256, and each
kind's splits cut into the windows the benchmarks and the calibration ask for. A kind held out
from tuning (`manual`) has its test split only, and nothing tunes on it."""
from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from kvstreamd.bench import codec as bench_codec
from kvstreamd.lab import calibrate, corpus

PACKAGE = Path(corpus.__file__).resolve().parent
REPO = PACKAGE.parents[1]


def readme_files(folder: Path) -> dict[str, tuple[int, str]]:
    """name -> (bytes, sha256) for each row of the README's tables that names a file in the folder."""
    rows = re.findall(r"^\|\s*([^|]+?)\s*\|\s*(\d+)\s*\|\s*([0-9a-f]{64})\s*\|$", (folder / "README.md").read_text(), re.M)
    return {name: (int(size), sha) for name, size, sha in rows if (folder / name).is_file()}


# (kind, split) for every split each kind has: a kind held out from tuning has only test.txt
KIND_SPLITS = [(k.name, split) for k in sorted(corpus.KINDS.values(), key=lambda k: k.name) for split in k.splits]
HELD_OUT = sorted(k.name for k in corpus.KINDS.values() if not k.tuned)


@pytest.mark.parametrize("kind", sorted(corpus.KINDS))
def test_each_kind_ships_in_the_package_with_its_splits(kind):
    k = corpus.get(kind)
    folder = k.folder
    assert folder.parent == PACKAGE  # inside kvstreamd/lab, not ../shared or a download
    assert k.splits == (corpus.SPLITS if k.tuned else ("test",))
    for split in corpus.SPLITS:
        assert (folder / f"{split}.txt").is_file() == (split in k.splits), split  # held out: no valid.txt at all
    assert (folder / "README.md").is_file()


@pytest.mark.parametrize("kind", sorted(corpus.KINDS))
def test_each_file_matches_the_sha256_in_its_readme(kind):
    folder = corpus.get(kind).folder
    listed = readme_files(folder)
    assert set(listed) >= {f"{split}.txt" for split in corpus.get(kind).splits}
    assert set(listed) >= {p.name for p in folder.iterdir() if p.name != "README.md"}  # every file it ships
    for name, (size, sha) in listed.items():
        data = (folder / name).read_bytes()
        assert len(data) == size, name
        assert hashlib.sha256(data).hexdigest() == sha, name


def test_the_texts_are_tracked_and_packaged():
    # What a fresh clone has is what git tracks; what a wheel has is what package-data names.
    tracked = subprocess.run(["git", "ls-files", str(PACKAGE)], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    files = set(tracked.stdout.split())
    pyproject = (REPO / "pyproject.toml").read_text()
    for kind in corpus.KINDS.values():
        rel = kind.folder.relative_to(REPO)
        for name in ("README.md", *(f"{split}.txt" for split in kind.splits)):
            assert str(rel / name) in files
        for p in kind.folder.iterdir():  # a licence file too, and nothing untracked beside them
            assert str(rel / p.name) in files, p
        assert f'"{kind.folder.name}/*"' in pyproject


def test_kvstreamd_data_overrides_wikitext_only(monkeypatch, tmp_path):
    (tmp_path / "test.txt").write_text("an override's test split\n")
    (tmp_path / "valid.txt").write_text("an override's valid split\n")
    monkeypatch.setenv("KVSTREAMD_DATA", str(tmp_path))
    assert corpus.text("test") == "an override's test split\n"
    assert corpus.text("test", "legal") == (corpus.get("legal").folder / "test.txt").read_text()
    monkeypatch.setenv("KVSTREAMD_DATA", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="KVSTREAMD_DATA"):
        corpus.windows(None, "test", 1, 10)
    assert corpus.text("valid", "code").startswith('"""Text wrapping and filling.')


def test_unknown_kinds_and_splits_are_refused():
    with pytest.raises(ValueError, match="unknown text kind 'medical'"):
        corpus.windows(None, "test", 1, 10, kind="medical")
    with pytest.raises(ValueError, match="unknown split 'train'"):
        corpus.text("train", "legal")


@pytest.fixture(scope="module")
def tokenizer(lm):
    return lm.tokenizer


def test_a_kind_held_out_from_tuning_has_no_tuning_split():
    assert HELD_OUT == ["manual"]
    assert corpus.TUNED == ("wikitext", "legal", "code")
    for kind in HELD_OUT:
        assert corpus.text("test", kind) == (corpus.get(kind).folder / "test.txt").read_text()
        refused = f"text kind '{kind}' is held out from tuning: it has no valid split, only test"
        for ask in (lambda: corpus.path("valid", kind), lambda: corpus.text("valid", kind),
                    lambda: corpus.tokens(None, "valid", kind), lambda: corpus.fit(None, "valid", 10, kind),
                    lambda: corpus.windows(None, "valid", 1, 10, kind=kind)):
            with pytest.raises(ValueError, match=refused):
                ask()


def test_calibration_tunes_on_every_kind_but_the_held_out_one():
    # One definition: the kinds calibration tunes on are corpus's kinds marked tuned.
    assert calibrate.TUNING_TEXTS == corpus.TUNED == tuple(k for k in corpus.KINDS if corpus.get(k).tuned)
    assert set(calibrate.TUNING_TEXTS) == set(corpus.KINDS) - set(HELD_OUT)
    for kind in HELD_OUT:
        assert kind not in calibrate.TUNING_TEXTS
        # asked to tune on it anyway, calibration refuses before it loads or prefills anything
        # (no model here: the refusal comes first)
        with pytest.raises(ValueError, match=f"'{kind}' is held out from tuning"):
            calibrate.tuning_cases(None, texts=("wikitext", kind))
        with pytest.raises(ValueError, match=f"'{kind}' is held out from tuning"):
            calibrate.calibrate(None, texts=iter(("legal", kind)))


@pytest.mark.parametrize("kind,split", KIND_SPLITS)
def test_windows_are_spread_over_each_kinds_split(tokenizer, kind, split):
    ids = corpus.tokens(tokenizer, split, kind)
    ws = corpus.windows(tokenizer, split, 3, 1000, kind=kind)
    assert [len(w) for w in ws] == [1000] * 3
    stride = (len(ids) - 1000) // 2
    assert [ids.index(w[0], i * stride) for i, w in enumerate(ws)] == [0, stride, 2 * stride]
    assert ws == [ids[i * stride:i * stride + 1000] for i in range(3)]
    assert len(ids) - (2 * stride + 1000) <= 1  # the first and the last part of the file
    with pytest.raises(ValueError, match=f"{kind} {split}.txt has {len(ids)} tokens"):
        corpus.windows(tokenizer, split, 2, len(ids) // 2 + 1, kind=kind)


@pytest.mark.parametrize("kind", sorted(corpus.KINDS))
def test_each_kind_holds_what_the_benchmark_and_the_tuning_take(tokenizer, kind):
    # bench codec's default: 3 held-out contexts of 3072 tokens + 256 continuation (+1)
    assert corpus.fit(tokenizer, "test", 3072 + 256 + 1, kind) >= (3 if corpus.get(kind).tuned else 4)
    n, length = calibrate.TUNING_CONTEXTS, calibrate.TUNING_TOKENS + calibrate.TUNING_CONTINUATION
    if corpus.get(kind).tuned:
        assert corpus.fit(tokenizer, "valid", length, kind) >= n


def test_the_splits_of_a_kind_are_different_documents():
    # Held out means held out: the splits share no document. Licences share some boilerplate
    # (the GNU texts' header, "How to Apply These Terms"), no more than that.
    for kind, most in (("legal", 0.02), ("code", 0.0)):
        valid, test = corpus.text("valid", kind), corpus.text("test", kind)
        stretches = [test[i:i + 200] for i in range(0, len(test) - 200, 50)]
        shared = sum(s in valid for s in stretches)
        assert shared <= most * len(stretches), (kind, shared, len(stretches))


def test_no_tuning_text_reappears_in_the_held_out_kind():
    # The manual's own appendix holds the GFDL, which legal/valid.txt holds: it is left out.
    tuning = [corpus.text("valid", kind) for kind in corpus.TUNED]
    for kind in HELD_OUT:
        test = corpus.text("test", kind)
        stretches = [test[i:i + 200] for i in range(0, len(test) - 200, 50)]
        assert len(stretches) > 1000
        assert not [s for s in stretches if any(s in t for t in tuning)], kind


def test_bench_codec_knows_every_kind():
    with pytest.raises(ValueError, match="unknown text kind"):
        bench_codec.run(texts=["wikitext", "nonesuch"])
