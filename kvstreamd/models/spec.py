"""What kvstreamd knows of a model before loading it: where its weights come from, how its
tokenizer is made, how a prompt about a document is worded. Everything else -- layer count, KV
heads, which layers slide over which window, the rotary frequencies -- is read from the loaded
model itself (models.adapter). models.registry maps what --model says to one."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import weights


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what --model accepts, or the path given
    model_name: str  # the model id's name part
    gguf: Callable[[], Path] | None = None  # the GGUF to convert; None: `folder` is loaded as it is
    folder: Path | None = None
    tokenizer_json: Callable[[Path, Path], dict] = weights.hf_tokenizer_json
    install: str = ""  # how a user gets the weights, said when they are missing
    # How a document and a question about it make a prompt (demo, bench e2e): the stored
    # context is turn_open + document, the prompt adds turn_close. A base model's by default.
    turn_open: str = ""
    turn_close: str = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"
