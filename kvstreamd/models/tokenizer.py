"""A model's tokenizer as kvstreamd uses it: text to ids and back, with the model's BOS and EOS.

Built on the `tokenizers` library from a `tokenizer.json` (the converted copy of every model
keeps one); a model that needs a BOS gets it from `document()`, which is what a context's first
token is, while `encode()` adds nothing, so pieces of text concatenate."""
from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, backend, eos: str | None = None, bos: str | None = None):
        self._tok = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = backend.token_to_id(eos) if eos else None
        self.bos_id: int | None = backend.token_to_id(bos) if bos else None
        if eos and self.eos_id is None:
            raise ValueError(f"the vocabulary has no {eos} token")
        if bos and self.bos_id is None:
            raise ValueError(f"the vocabulary has no {bos} token")

    @classmethod
    def from_file(cls, path: Path, eos: str | None = None, bos: str | None = None) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        return cls(Backend.from_file(str(path)), eos, bos)

    def save(self, path: Path) -> None:
        self._tok.save(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def document(self, text: str) -> list[int]:
        """The ids of a whole context: BOS (for a model that needs one), then the text."""
        ids = self.encode(text)
        return [self.bos_id, *ids] if self.bos_id is not None else ids

    def decode(self, ids) -> str:
        # Special tokens are kept so that decode(encode(text)) == text for any text.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
