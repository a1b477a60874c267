"""What kvstreamd knows of a model before loading it: where its weights come from and how its
tokenizer is made. A shipped model is one `ModelSpec` in `SHIPPED`; a GGUF file or a local
folder (config.json + safetensors + tokenizer.json) is made into one by `resolve`. Everything
else -- layer count, KV heads, which layers slide over which window, the rotary frequencies --
is read from the loaded model itself (models.adapter)."""
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


def _shipped() -> dict[str, ModelSpec]:
    from . import gemma3, smollm2

    return {s.name: s for s in (smollm2.SPEC, gemma3.SPEC)}


DEFAULT = "smollm2-135m"


def shipped_names() -> list[str]:
    return list(_shipped())


def resolve(model: str | Path | None) -> ModelSpec:
    """A shipped name (`smollm2-135m`, `gemma3-270m`), a .gguf file, or a folder holding
    config.json and safetensors weights. None: the default model."""
    name = str(model) if model is not None else DEFAULT
    specs = _shipped()
    if name in specs:
        return specs[name]
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec(name, path.stem, gguf=lambda: path)
    if path.is_dir():
        if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"{path}: a model folder holds config.json and *.safetensors weights")
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json beside the weights")
        return ModelSpec(name, path.resolve().name, folder=path)
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(specs)}, a .gguf file, "
                     "or a folder with config.json + *.safetensors + tokenizer.json")
