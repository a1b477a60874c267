"""The connector's settings, from the engine's `kv_connector_extra_config` (a JSON object): each
key checked here, with a clear error at the engine's start rather than a miss on every request."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from .. import requests
from ..limits import MODEL_META, speedup_deadline_ms
from ..requests import FetchRequest

# A lookup that takes longer than this is a miss: the request is computed as if there were no
# connector. A lookup on the local socket takes about a millisecond.
LOOKUP_TIMEOUT_MS = 200


class OptionsError(ValueError):
    """A kv_connector_extra_config key the connector cannot use."""


@dataclass(frozen=True)
class ConnectorOptions:
    socket: str | None = None  # the local daemon's API socket; None: the daemon's default
    model_id: str | None = None  # the id contexts are filed under; None: from the model folder
    lookup_timeout_ms: int = LOOKUP_TIMEOUT_MS
    deadline_ms: int | None = None  # a fetch's deadline; None: the daemon's [fetch] deadline_ms
    levels: tuple[str, ...] | None = None  # levels a fetch accepts; None: the daemon's
    # the engine's own prefill rate: the sender's rule prices a chunk sent as text (for the
    # engine to compute) with it; None: the daemon's [fetch] recompute_tokens_per_s
    recompute_tokens_per_s: float | None = None
    save: bool = True  # put each prompt's whole chunks to the local daemon after its prefill
    # a fetch's deadline as a speed-up over computing: the engine's own prefill time of the
    # prefix (at recompute_tokens_per_s) over this, so a long prompt gets a long deadline and
    # the levels whose chunks the engine answers from as it would have computed (`max`) fit it
    speedup: float | None = None

    @classmethod
    def parse(cls, extra: dict | None, model_folder: str | Path | None = None) -> ConnectorOptions:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise OptionsError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        out = {}
        for key, value in extra.items():
            out[key] = _check(key, value)
        if out.get("speedup") is not None:
            if out.get("deadline_ms") is not None:
                raise OptionsError("kv_connector_extra_config: deadline_ms and speedup both set; a fetch's "
                                   "deadline is one or the other")
            if out.get("recompute_tokens_per_s") is None:
                raise OptionsError("kv_connector_extra_config: speedup needs recompute_tokens_per_s, the "
                                   "engine's prefill rate it is a speed-up over")
        if out.get("model_id") is None:
            out["model_id"] = model_id_of(model_folder)
        opts = cls(**out)
        try:  # the daemon's own rules for a fetch's body (kvstreamd.requests), checked once here
            requests.parse(FetchRequest, requests.to_body(opts.fetch_request([0])))
        except requests.BadRequest as e:
            raise OptionsError(f"kv_connector_extra_config: {e} (the daemon would refuse every fetch)") from None
        return opts

    def deadline_for(self, tokens: int) -> int | None:
        """A fetch's deadline, ms, for a prefix of `tokens` tokens (None: the daemon's)."""
        if self.speedup is None:
            return self.deadline_ms
        return speedup_deadline_ms(tokens, self.recompute_tokens_per_s, self.speedup)

    def fetch_request(self, tokens: list[int]) -> FetchRequest:
        """What the connector asks its daemon for a prompt's prefix: KV first, TEXT only after
        every KV chunk (vLLM cannot load KV after a hole)."""
        return FetchRequest(self.model_id, list(tokens), deadline_ms=self.deadline_for(len(tokens)),
                            levels=list(self.levels) if self.levels else None,
                            recompute_tokens_per_s=self.recompute_tokens_per_s, text_last=True)


def _check(key: str, value):
    bad = OptionsError(f"kv_connector_extra_config: {key}={value!r}")
    if key in ("socket", "model_id"):
        if value is not None and (not isinstance(value, str) or not value):
            raise bad
        return value
    if key in ("lookup_timeout_ms", "deadline_ms"):
        if value is None and key == "deadline_ms":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise OptionsError(f"{bad}: a whole number of milliseconds > 0")
        return value
    if key == "recompute_tokens_per_s":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise OptionsError(f"{bad}: tokens per second > 0")
        return None if value is None else float(value)
    if key == "speedup":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 1):
            raise OptionsError(f"{bad}: a finite factor > 1")
        return None if value is None else float(value)
    if key == "levels":
        if value is not None and (not isinstance(value, list) or not value or
                                  not all(isinstance(v, str) and v for v in value)):
            raise OptionsError(f"{bad}: a list of level names")
        return None if value is None else tuple(value)
    if key == "save":
        if not isinstance(value, bool):
            raise OptionsError(f"{bad}: true or false")
        return value
    raise bad


def model_id_of(folder: str | Path | None) -> str:
    """The model id recorded in a model folder (`kvstreamd model-folder` writes it), so that the
    engine files its contexts under the id the HF side uses for the same weights."""
    meta = Path(folder) / MODEL_META if folder is not None else None
    try:
        mid = json.loads(meta.read_text())["model_id"] if meta is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        mid = None
    if not isinstance(mid, str) or not mid:
        raise OptionsError(f"no model_id: set kv_connector_extra_config.model_id, or serve a folder made by "
                           f"`kvstreamd model-folder` (its {MODEL_META} names the id); {folder} has none")
    return mid
