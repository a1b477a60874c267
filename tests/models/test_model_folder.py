"""A model kvstreamd has never seen, from a local folder (config.json + safetensors +
tokenizer.json), through every command a user runs with --model PATH: profile calibrate, put,
fetch and generate, against a real daemon process. Tiny random-weight models (quality is not
the point here, the path is): a Llama-shaped one, and a Gemma-3-shaped hybrid one whose
sliding layers hold a short window, where generate on fetched KV must equal generate without."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.fixtures import synthetic_daemon

TEXT = ("The committee reviewed the annual report and the contract terms in detail. " * 40
        + "Revenue grew while costs held steady; the auditors found no material weakness. " * 40)


def _tokenizer(folder) -> None:
    """A small byte-level BPE trained on TEXT, saved as the folder's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<bos>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                              "add_bos_token": True}))


def _save(model, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)  # config.json + model.safetensors
    _tokenizer(folder)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rope_theta=50_000.0, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    _save(LlamaForCausalLM(cfg).eval(), folder)
    return folder


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=40,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma"
    _save(Gemma3ForCausalLM(cfg).eval(), folder)
    return folder


def _cli(*args: str, timeout: float = 600) -> dict | str:
    r = subprocess.run([sys.executable, "-m", "kvstreamd.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    start = out.find("{")
    return json.loads(out[start:]) if start >= 0 and args[0] in ("put", "fetch", "generate") else out


def test_a_local_folder_model_loads_with_what_its_config_says(llama_folder, gemma_folder):
    from kvstreamd import models

    lm = models.load(llama_folder)
    assert lm.model_id.startswith("tiny-llama:") and len(lm.model_id.split(":")[1]) == 16
    assert (lm.num_layers, lm.num_kv_heads, lm.head_dim) == (2, 2, 16) and lm.layout.is_dense
    assert lm.rotary.invertible and lm.rotary.inv_freq.shape == (2, 8)
    assert lm.tokenizer.document("The committee")[0] == lm.tokenizer.bos_id
    hybrid = models.load(gemma_folder)
    assert hybrid.layout.windows == (40, None, 40, None)
    assert [i["rope_type"] for i in hybrid.rotary.info] == ["default", "default"]
    assert not (hybrid.rotary.inv_freq[0] == hybrid.rotary.inv_freq[1]).all()  # 10K and 1M bases


def test_prefill_holds_every_layers_every_token_and_a_window_cache_continues_exactly(gemma_folder):
    from codec.layout import PrefixKV
    from kvstreamd import models

    lm = models.load(gemma_folder)
    ids = lm.tokenizer.document(TEXT)[:300]
    _, kv = models.prefill(lm, ids[:250], all_logits=False)
    assert kv.shape == (4, 2, 250, 1, 32)
    ref = models.continuation_logits(lm, None, ids)[250:]
    for chunk in (None, 16, 64):
        prefix = PrefixKV.from_dense(kv, lm.layout, chunk)
        assert prefix.parts[1].start == (211 if chunk is None else 211 - 211 % chunk)  # 250 - 40 + 1
        got = models.continuation_logits(lm, prefix, ids[250:])
        assert torch.allclose(got, ref, atol=1e-4), (chunk, (got - ref).abs().max())


def test_a_cache_that_holds_a_heads_first_copy_as_it_is_continues_like_one_that_copies(gemma_folder):
    """cache_from_kv(copy=False) on PrefixKV.copy_heads_first: the layers hold the very tensors
    (no copy), continue to the logits a copying cache gives, and running the model leaves them
    as they were."""
    from codec.layout import PrefixKV
    from kvstreamd import models

    lm = models.load(gemma_folder)
    ids = lm.tokenizer.document(TEXT)[:300]
    _, kv = models.prefill(lm, ids[:250], all_logits=False)
    prefix = PrefixKV.from_dense(kv.half(), lm.layout, 16)
    own = prefix.copy_heads_first(dtype=torch.float32)
    assert own.parts[0].kv.permute(0, 1, 3, 2, 4).is_contiguous() and torch.equal(own.parts[0].kv, prefix.parts[0].kv.float())
    before = [p.kv.clone() for p in own.parts]
    held = models.cache_from_kv(own, torch.float32, lm.model.config, copy=False)
    copied = models.cache_from_kv(prefix, torch.float32, lm.model.config)
    for layer, (a, b) in enumerate(zip(held.layers, copied.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert getattr(a, "cumulative_length", None) == getattr(b, "cumulative_length", None)
    part = next(p for p in own.parts if p.window is None)  # full-attention layers, tokens from 0
    assert held.layers[part.layers[0]].keys.data_ptr() == part.kv[0, 0].data_ptr()  # held without a copy
    rest = torch.tensor(ids[250:])
    got, _ = models.adapter.run(lm.model, rest, held, all_logits=True, keep_kv=False)
    ref, _ = models.adapter.run(lm.model, rest, copied, all_logits=True, keep_kv=False)
    assert torch.equal(got, ref)
    assert all(torch.equal(p.kv, b) for p, b in zip(own.parts, before))


@pytest.mark.system  # subprocesses of the CLI and a daemon process
@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_calibrate_put_fetch_generate_with_a_model_folder(tmp_path, request, which):
    folder = request.getfixturevalue(f"{which}_folder")
    profile = tmp_path / "tiny.kvprofile"
    _cli("profile", "calibrate", "--model", str(folder), "--out", str(profile), "--contexts", "1", "--tokens", "256",
         "--tuning-contexts", "1", "--tuning-tokens", "128", "--tuning-continuation", "16")
    from codec.profile import Profile

    prof = Profile.load(profile)
    assert prof.model_id.startswith(folder.name + ":") and set(prof.meta["level_scales"]) == {"high", "balanced", "fast"}
    if which == "gemma":
        assert prof.layer_windows == (40, None, 40, None)
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    d = synthetic_daemon(tmp_path, "a", prof, codec={"chunk_tokens": 256})
    d.start()
    try:
        sock = str(d.socket)
        put = _cli("put", str(doc), "--model", str(folder), "--socket", sock, "--tokens", "300")
        assert put["stored_chunks"] == 2
        fetched = _cli("fetch", str(doc), "--model", str(folder), "--socket", sock, "--tokens", "300")
        assert fetched["found_tokens"] == 300 and fetched["kv_tokens"] == 300
        got = _cli("generate", str(doc), "--model", str(folder), "--socket", sock, "--tokens", "300",
                   "--max-new-tokens", "4", "--deadline-ms", "20000")
        assert got["found_tokens"] == 300 and got["kv_tokens"] == 300 and len(got["generated"]) == 4
    finally:
        d.stop()


async def test_generate_on_a_window_cut_fetch_equals_generate_on_every_layers_kv(inprocess, gemma_folder):
    """The hybrid model's prefix comes from a peer with its sliding layers cut to the window;
    greedy generation on it gives the tokens that the same KV, every layer's every token, gives."""
    import asyncio

    import numpy as np

    from codec import profile as profiles
    from codec.layout import PrefixKV
    from kvstreamd import models
    from kvstreamd.client import Client
    from kvstreamd.models.prefix import generate

    lm = models.load(gemma_folder)
    ids = lm.tokenizer.document(TEXT)[:400]
    _, kv = models.prefill(lm, ids[:300], all_logits=False)
    prof = profiles.fit([(kv, 0)], model_id=lm.model_id, inv_freq=lm.rotary.inv_freq, layer_windows=lm.layer_windows,
                        sensitivity=np.ones((4, 2)))
    a, b = await inprocess(["a", "b"], profile=prof, codec={"chunk_tokens": 256, "levels": ["fp16"]})
    half = kv.half()  # fp16 in, fp16 level: the bytes are exact, what is cut is the layers
    await asyncio.to_thread(lambda: Client(a.cfg.api.socket).put(lm.model_id, ids[:300], half))
    prompt = ids[:300] + ids[300:310]
    for _ in range(100):
        if (await asyncio.to_thread(Client(b.cfg.api.socket).lookup, lm.model_id, prompt))["found_tokens"] == 300:
            break
        await asyncio.sleep(0.05)
    new, reuse = await asyncio.to_thread(generate, lm.model, prompt, Client(b.cfg.api.socket), lm.model_id,
                                         max_new_tokens=6, levels=["fp16"], keep_kv=True)
    assert reuse.kv_tokens == 300 and reuse.kv.parts[1].start == 256  # sliding layers: 261.. in chunks from 256
    assert reuse.bytes < 0.8 * half.numel() * 2
    want = models.generate_greedy(lm, PrefixKV.from_dense(half.float()), prompt[300:], 6)
    assert new == want
