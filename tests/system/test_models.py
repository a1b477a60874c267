"""The SmolLM2 adapter, on the real model: its tokenizer, the KV layout, and that a KV cache
taken out of the model and put back continues it exactly as one long pass would."""

from pathlib import Path

import pytest
import torch

from kvstreamd import models
from kvstreamd.lab import corpus

WIKITEXT = corpus.wikitext_dir() / "test.txt"

# Observed max |diff| is ~6e-5 (fp32 GEMMs round differently for different numbers of query
# rows); a wrong position or a mangled K/V shows up as differences of order 1.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def lm():
    # One thread: on 2 cores with anything else busy, torch's second OpenMP thread spin-waits
    # and a 500-token prefill goes from 2 s to 12 s. Results do not depend on the thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield models.load()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokens(lm) -> list[int]:
    return lm.tokenizer.encode(WIKITEXT.read_text(encoding="utf-8")[:4000])[:500]


def test_tokenizer_round_trips_wikitext(lm):
    text = WIKITEXT.read_text(encoding="utf-8")[:8000]
    assert lm.tokenizer.decode(lm.tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", [
    "héllo wörld — naïve café, 中文, 日本語, emoji 😀 and 👩‍👩‍👧 (ZWJ)",
    "  leading, trailing and   inner runs of spaces   ",
    "tabs\t\tand\nnewlines\n\n\r\nand CRLF\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
])
def test_tokenizer_round_trips_unicode_whitespace_and_special_tokens(lm, text):
    assert lm.tokenizer.decode(lm.tokenizer.encode(text)) == text


def test_tokenizer_splits_digits_one_at_a_time(lm):
    ids = lm.tokenizer.encode("2024")
    assert [lm.tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_tokenizer_adds_no_bos(lm):
    ids = lm.tokenizer.encode("Hello world")
    assert [lm.tokenizer.decode([i]) for i in ids] == ["Hello", " world"]


def test_im_end_is_one_token_and_is_eos(lm):
    assert lm.tokenizer.encode("<|im_end|>") == [lm.tokenizer.eos_id]
    assert lm.tokenizer.decode([lm.tokenizer.eos_id]) == "<|im_end|>"
    assert lm.tokenizer.vocab_size == lm.model.config.vocab_size == 49152


def test_model_id_names_the_weights_by_hash(lm):
    name, digest = lm.model_id.split(":")
    assert name == "SmolLM2-135M-Instruct-Q4_1"
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert models.model_id() == lm.model_id


def test_kv_has_shape_layers_kv_tokens_heads_headdim(lm, tokens):
    logits, kv = models.prefill(lm, tokens[:40])
    assert kv.shape == (30, 2, 40, 3, 64) == (lm.num_layers, 2, 40, lm.num_kv_heads, lm.head_dim)
    assert kv.dtype == torch.float32
    assert logits.shape == (40, 49152) and logits.dtype == torch.float32


def test_kv_survives_cache_round_trip_unchanged(lm, tokens):
    _, kv = models.prefill(lm, tokens[:40])
    assert torch.equal(models.kv_from_cache(models.cache_from_kv(kv)), kv)


def test_injected_cache_gives_the_logits_of_one_long_pass(lm, tokens):
    a, b = tokens[:300], tokens[300:]
    full_logits, full_kv = models.prefill(lm, a + b)

    _, kv_a = models.prefill(lm, a)
    cache = models.cache_from_kv(kv_a)  # through the model's own cache type, as a fetch would
    logits_b, kv = models.prefill(lm, b, models.kv_from_cache(cache))

    diff = (logits_b - full_logits[300:]).abs().max().item()
    assert torch.allclose(logits_b, full_logits[300:], atol=LOGITS_ATOL, rtol=0), f"max |diff| {diff:.3g}"
    assert kv.shape == full_kv.shape
    assert torch.allclose(kv, full_kv, atol=LOGITS_ATOL, rtol=0)
    assert torch.allclose(models.continuation_logits(lm, kv_a, b), logits_b, atol=0, rtol=0)


def test_a_timed_prefill_on_a_running_cache_gives_the_kv_of_one_pass_and_times_every_step(lm, tokens):
    _, full_kv = models.prefill(lm, tokens)
    seen = []
    kv, steps = models.prefill_timed(lm, tokens, 128, seen.append)
    assert kv.shape == full_kv.shape and torch.allclose(kv, full_kv, atol=LOGITS_ATOL, rtol=0)
    assert [(s, n) for s, n, _ in steps] == [(0, 128), (128, 128), (256, 128), (384, 116)] and seen == [128, 128, 128, 116]
    assert all(t > 0 for _, _, t in steps)
    with pytest.raises(ValueError, match="prefill takes"):
        models.prefill_timed(lm, [], 128)


def test_injected_fp16_cache_runs_close_to_the_exact_one(lm, tokens):
    _, kv_a = models.prefill(lm, tokens[:200])
    exact = models.continuation_logits(lm, kv_a, tokens[200:260])
    rounded = models.continuation_logits(lm, kv_a.half(), tokens[200:260])
    assert rounded.dtype == torch.float32
    assert 0 < (rounded - exact).abs().max().item() < 0.5


def test_greedy_generation_from_injected_cache_equals_one_pass(lm, tokens):
    prompt = tokens[:400]
    one_pass = models.generate_greedy(lm, None, prompt, 16)
    _, kv = models.prefill(lm, prompt[:350])
    injected = models.generate_greedy(lm, kv, prompt[350:], 16)
    assert len(one_pass) == 16
    assert injected == one_pass


def test_prefill_rejects_kv_of_another_shape(lm, tokens):
    _, kv = models.prefill(lm, tokens[:10])
    with pytest.raises(ValueError, match="KV shape"):
        models.prefill(lm, tokens[10:20], kv[:, :, :, :2])


def test_second_load_reads_the_safetensors_copy(lm):
    again = models.load()
    copy = again.weights_dir
    assert copy == lm.weights_dir
    assert copy.parent.parent == models.cache_dir()
    assert lm.model_id.split(":")[1] in copy.name  # other weights never reuse this copy
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in copy.iterdir()}
    assert Path(again.model.config.name_or_path) == copy
    assert not list(copy.parent.glob(".*.tmp-*"))  # no half-written copy left behind
    assert not again.model.training
    assert next(again.model.parameters()).dtype == torch.float32
