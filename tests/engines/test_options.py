"""The connector's settings from kv_connector_extra_config: defaults that work with no keys but
the model id, a clear error naming the key for a bad value or an unknown key, and the model id
read from the folder `kvstreamd model-folder` makes (engine_folder, tested here on a tiny real
model folder)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvstreamd.engines.options import LOOKUP_TIMEOUT_MS, MODEL_META, ConnectorOptions, OptionsError
from kvstreamd.models import model_id
from kvstreamd.models.engine_folder import engine_folder


def test_no_keys_but_the_model_id_give_the_defaults():
    got = ConnectorOptions.parse({"model_id": "m:0123"})
    assert got == ConnectorOptions(model_id="m:0123")
    assert (got.socket, got.lookup_timeout_ms, got.deadline_ms, got.levels, got.recompute_tokens_per_s,
            got.save, got.speedup) == (None, LOOKUP_TIMEOUT_MS, None, None, None, True, None)
    assert got.deadline_for(4096) is None  # the daemon's


def test_each_key_takes_its_kind_of_value():
    got = ConnectorOptions.parse({"socket": "/run/k.sock", "model_id": "m:1", "lookup_timeout_ms": 50,
                                  "deadline_ms": 2000, "levels": ["high", "fast"], "recompute_tokens_per_s": 900,
                                  "save": False})
    assert got == ConnectorOptions("/run/k.sock", "m:1", 50, 2000, ("high", "fast"), 900.0, False)
    assert got.deadline_for(4096) == 2000


def test_a_speedup_gives_each_fetch_the_engines_own_prefill_time_over_it():
    got = ConnectorOptions.parse({"model_id": "m:1", "recompute_tokens_per_s": 250, "speedup": 3})
    assert got.speedup == 3.0
    assert got.deadline_for(3000) == 4000 and got.deadline_for(1500) == 2000  # 12 s of prefill / 3
    assert got.deadline_for(0) == 1 and got.deadline_for(10**9) == 3_600_000  # within the daemon's bounds
    with pytest.raises(OptionsError, match="speedup needs recompute_tokens_per_s"):
        ConnectorOptions.parse({"model_id": "m:1", "speedup": 3})
    with pytest.raises(OptionsError, match="deadline_ms and speedup both set"):
        ConnectorOptions.parse({"model_id": "m:1", "recompute_tokens_per_s": 250, "speedup": 3, "deadline_ms": 2000})


BAD = [
    ("socket", ""), ("socket", 3),
    ("model_id", ""), ("model_id", ["m"]),
    ("lookup_timeout_ms", 0), ("lookup_timeout_ms", -5), ("lookup_timeout_ms", 1.5), ("lookup_timeout_ms", True),
    ("lookup_timeout_ms", None), ("lookup_timeout_ms", "200"),
    ("deadline_ms", 0), ("deadline_ms", "1s"), ("deadline_ms", False),
    ("levels", []), ("levels", "l1"), ("levels", ["l1", ""]), ("levels", ["l1", 2]),
    ("recompute_tokens_per_s", 0), ("recompute_tokens_per_s", -1.0), ("recompute_tokens_per_s", True),
    ("recompute_tokens_per_s", "fast"),
    ("save", "yes"), ("save", 1), ("save", None),
    ("speedup", 1), ("speedup", 0.5), ("speedup", True), ("speedup", "3x"),
    ("recompute_tokens_per_s", float("nan")), ("recompute_tokens_per_s", float("inf")),
    ("speedup", float("nan")), ("speedup", float("inf")),
]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_a_bad_value_is_an_error_naming_its_key(key, value):
    with pytest.raises(OptionsError, match=f"kv_connector_extra_config: {key}="):
        ConnectorOptions.parse({"model_id": "m:1", key: value})


# Values each key's own check takes but the daemon refuses in every fetch's body (issue 49, item 6):
# refused at the engine's start, by the daemon's own rules (kvstreamd.requests).
REFUSED = [
    ({"deadline_ms": 3_600_001}, "field 'deadline_ms' must be 1..3600000"),
    ({"levels": ["nope"]}, "levels must be a non-empty list of"),
    ({"levels": ["max", "max"]}, "levels names a level twice"),
    ({"levels": ["text"]}, "levels must be a non-empty list of"),
    ({"recompute_tokens_per_s": 0.5}, "field 'recompute_tokens_per_s' must be 1..1000000000"),
    ({"model_id": "m" * 1000}, "field 'model_id' is 1000 characters; a model id is 1..512"),
]


@pytest.mark.parametrize("extra,why", REFUSED, ids=[next(iter(e)) + "=" + repr(next(iter(e.values())))[:20]
                                                     for e, _ in REFUSED])
def test_a_value_the_daemon_would_refuse_in_every_fetch_is_an_error_at_start(extra, why):
    with pytest.raises(OptionsError) as e:
        ConnectorOptions.parse({"model_id": "m:1", **extra})
    assert str(e.value).startswith(f"kv_connector_extra_config: {why}") and "the daemon would refuse" in str(e.value)


def test_an_unknown_key_is_an_error_naming_the_known_ones():
    with pytest.raises(OptionsError) as e:
        ConnectorOptions.parse({"model_id": "m:1", "sokcet": "/run/k.sock"})
    assert "'sokcet'" in str(e.value)
    for key in ("socket", "model_id", "lookup_timeout_ms", "deadline_ms", "levels", "recompute_tokens_per_s", "save", "speedup"):
        assert f"'{key}'" in str(e.value)


def test_the_model_id_comes_from_the_model_folder(tmp_path):
    (tmp_path / MODEL_META).write_text(json.dumps({"model_id": "tiny:00ff", "source": "tiny"}))
    assert ConnectorOptions.parse({}, tmp_path).model_id == "tiny:00ff"
    assert ConnectorOptions.parse({"model_id": "other:1"}, tmp_path).model_id == "other:1"


@pytest.mark.parametrize("meta", [None, "not json", json.dumps({"source": "x"}), json.dumps({"model_id": ""}),
                                  json.dumps(["tiny:1"])], ids=["none", "not-json", "no-id", "empty-id", "a-list"])
def test_a_folder_without_a_model_id_is_a_clear_error(tmp_path, meta):
    if meta is not None:
        (tmp_path / MODEL_META).write_text(meta)
    with pytest.raises(OptionsError, match="no model_id: set kv_connector_extra_config.model_id"):
        ConnectorOptions.parse({}, tmp_path)
    with pytest.raises(OptionsError, match="no model_id"):
        ConnectorOptions.parse({"save": True})  # no folder at all


def _tokenizer_json(path: Path) -> None:
    """A real tokenizer.json: a shipped model's, when its plain copy is in the cache, else a tiny
    word-level one built with `tokenizers`."""
    found = sorted((Path.home() / ".cache" / "kvstreamd" / "models").glob("*/tokenizer.json"),
                   key=lambda p: p.stat().st_size)
    if found:
        shutil.copyfile(found[0], path)
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    """A plain model folder: a llama config without `architectures`, safetensors weights, a tokenizer."""
    from safetensors.torch import save_file
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 3, "max_position_embeddings": 64}))
    save_file({"model.embed_tokens.weight": torch.randn(3, 8),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8)}, str(folder / "model.safetensors"))
    _tokenizer_json(folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("tokenizer_config", [True, False], ids=["with-tokenizer-config", "without"])
def test_a_model_folder_serves_the_weights_under_the_hf_sides_model_id(tiny_model, tmp_path, tokenizer_config):
    if tokenizer_config:
        (tiny_model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    cache = tmp_path / "cache"
    out = engine_folder(tiny_model, tmp_path / "served", cache_dir=cache)
    mid = model_id(tiny_model, cache)

    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).is_symlink() and (out / name).resolve() == (tiny_model / name).resolve()
    tc = json.loads((out / "tokenizer_config.json").read_text())
    if tokenizer_config:
        assert tc == {"bos_token": "<s>", "add_bos_token": True}
    else:
        assert tc["bos_token"] is None and tc["add_bos_token"] is False
    assert json.loads((out / MODEL_META).read_text())["model_id"] == mid
    assert ConnectorOptions.parse({}, out).model_id == mid


def test_making_a_model_folder_again_refreshes_its_links(tiny_model, tmp_path):
    cache, served = tmp_path / "cache", tmp_path / "served"
    engine_folder(tiny_model, served, cache_dir=cache)
    stray = tmp_path / "stray.safetensors"
    stray.write_bytes(b"not these weights")
    (served / "model.safetensors").unlink()
    (served / "model.safetensors").symlink_to(stray)
    (served / "tokenizer.json").unlink()  # and one link gone

    out = engine_folder(tiny_model, served, cache_dir=cache)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).resolve() == (tiny_model / name).resolve()
    assert ConnectorOptions.parse({}, out).model_id == model_id(tiny_model, cache)
