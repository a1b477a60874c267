"""--profile on the benchmarks that code the model's KV themselves (`bench codec`, `bench
stream`): parsed, and handed to the codec pool's workers, which code with it although it lies
in no folder the registry searches. (The whole command, on the real model, is
tests/system/test_codec_model.py's.)"""
from __future__ import annotations

import pytest
import torch

import codec
from codec import profile as profiles
from codec.tuning import registry
from kvstreamd import cli
from kvstreamd.bench import profile_and_pool
from tests.fixtures import synthetic_kv

MODEL = "bench-profile-model:00112233445566ff"


@pytest.mark.parametrize("command", [["bench", "codec"], ["bench", "stream"]])
def test_profile_option_reaches_the_codec_workers(command, small_profile, tmp_path):
    mine = profiles.Profile(dict(small_profile.meta, model_id=MODEL, source=" ".join(command)),
                            dict(small_profile.tensors))
    path = mine.save(tmp_path / "mine.kvprofile")
    args = cli.parser().parse_args([*command, "--model", "some-model", "--profile", str(path)])
    assert args.profile == str(path)
    prof, pool = profile_and_pool(MODEL, args.profile, workers=2)
    kv = synthetic_kv(50, seed=8).half()
    with pool:
        assert prof.id == mine.id and registry.source(prof) == "explicit"
        data = pool.encode(kv, "fast", prof, start=0)  # each worker codes its streams with the file it was handed
    assert data == codec.encode(kv, "fast", mine, start=0)
    assert torch.equal(codec.decode(data), codec.decode(codec.encode(kv, "fast", mine, start=0)))


def test_a_profile_of_another_model_is_refused_before_any_pool_starts(small_profile, tmp_path):
    path = small_profile.save(tmp_path / "synthetic.kvprofile")
    with pytest.raises(codec.CodecError, match=f"not of {MODEL!r}"):
        profile_and_pool(MODEL, path)
