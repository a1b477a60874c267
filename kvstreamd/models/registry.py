"""What `--model` can name: a shipped model (one ModelSpec each: smollm2.py, gemma3.py), a GGUF
file, or a local folder with config.json + safetensors + tokenizer.json."""
from __future__ import annotations

from pathlib import Path

from . import gemma3, smollm2
from .spec import ModelSpec

SHIPPED = {s.name: s for s in (smollm2.SPEC, gemma3.SPEC)}
DEFAULT = smollm2.SPEC.name


def shipped_names() -> list[str]:
    return list(SHIPPED)


def resolve(model: str | Path | None) -> ModelSpec:
    """A shipped name (`smollm2-135m`, `gemma3-270m`), a .gguf file, or a folder holding
    config.json and safetensors weights. None: the default model."""
    name = str(model) if model is not None else DEFAULT
    if name in SHIPPED:
        return SHIPPED[name]
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec(name, path.stem, gguf=lambda: path)
    if path.is_dir():
        if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"{path}: a model folder holds config.json and *.safetensors weights")
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json beside the weights")
        return ModelSpec(name, path.resolve().name, folder=path)
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(SHIPPED)}, a .gguf file, "
                     "or a folder with config.json + *.safetensors + tokenizer.json")
