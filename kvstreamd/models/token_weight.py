"""How much the probes' queries read each token of a context, per layer: the weights that
per-token steps class a put's tokens by (codec.tuning.token_steps), measured in the attention the
model runs anyway.

While `recording` is active, the adapter's attention function (attention.OBSERVER) hands each
layer's queries and keys here; for the query rows asked for (the rate probes' tokens,
rate_probe.probe_rows at codec.tuning.token_steps.PROBE_EVERY) the softmax over the keys each may read (causal, within the layer's
window) is recomputed, squared and summed over heads and rows into that layer's weight of each
key token. During the prefill a put runs anyway this costs no forward pass of its own; where
the KV came prefilled (`measure`), a forward over each run of probe rows on the KV before it.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from codec.tuning.token_steps import PROBE_EVERY

from . import attention
from .adapter import LoadedModel, extend, prefill
from .rate_probe import probe_rows

ROWS_AT_ONCE = 256  # query rows whose probabilities are held at once (bounds the memory)


class Recorder:
    """Accumulates weights [layers, tokens] from the attention calls it is shown, the first call
    of each layer covering queries from position `first`."""

    def __init__(self, layers: int, tokens: int, rows: list[int], first: int = 0):
        self.weights = np.zeros((layers, tokens), np.float64)
        self.rows = np.asarray(sorted(set(rows)), np.int64)
        self.seen = [first] * layers

    def __call__(self, module, query: torch.Tensor, key: torch.Tensor, scaling: float | None, softcap) -> None:
        layer = module.layer_idx
        q_len, k_len = query.shape[2], key.shape[2]
        first = self.seen[layer]
        self.seen[layer] += q_len
        local = self.rows[(self.rows >= first) & (self.rows < first + q_len)] - first
        if not local.size:
            return
        heads, kv_heads = query.shape[1], key.shape[1]
        keys = key[0].float().repeat_interleave(heads // kv_heads, 0)  # [Hq, k, D]
        kpos = torch.arange(k_len) + (first + q_len - k_len)  # the key rows' token positions
        window = getattr(module, "sliding_window", None)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        acc = torch.zeros(k_len, dtype=torch.float64)
        for i in range(0, local.size, ROWS_AT_ONCE):
            rows = torch.from_numpy(local[i:i + ROWS_AT_ONCE])
            logits = query[0][:, rows].float() @ keys.transpose(-1, -2) * scale  # [Hq, r, k]
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            qpos = (rows + first)[:, None]
            allowed = kpos[None] <= qpos
            if window:
                allowed &= qpos - kpos[None] < window
            probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
            acc += (probs.double() ** 2).sum((0, 1))
        lo = max(0, -int(kpos[0]))  # key rows before the context (none in a prefill)
        self.weights[layer, int(kpos[lo]):int(kpos[-1]) + 1] += acc[lo:].numpy()


@contextlib.contextmanager
def recording(layers: int, tokens: int, rows: list[int], first: int = 0):
    """While inside, every attention call of this thread's model runs feeds a Recorder (yielded)
    of a `tokens`-token context's `layers` layers, weighing by the queries at `rows`; `first`:
    the position of the first query the runs inside take."""
    rec = Recorder(layers, tokens, rows, first)
    token = attention.OBSERVER.set(rec)
    try:
        yield rec
    finally:
        attention.OBSERVER.reset(token)


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Ascending rows -> their runs of consecutive tokens, [start, end)."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


@torch.no_grad()
def measure(lm: LoadedModel, tokens: list[int], kv: torch.Tensor, at: list[int] | None = None) -> np.ndarray:
    """Weights [L, T] of the context `tokens` whose KV `[L, 2, T, H, D]` is `kv`, by the queries
    at `at` (default: rows()): each run of them run again on the KV before it (for a caller that
    prefilled elsewhere; one that prefills here records during it)."""
    layers, n = kv.shape[0], kv.shape[2]
    weights = np.zeros((layers, n), np.float64)
    for a, b in runs(sorted(set(rows(n) if at is None else at))):
        with recording(layers, n, list(range(a, b)), first=a) as rec:
            extend(lm, kv[:, :, :a] if a else None, tokens[a:b])
        weights += rec.weights
    return weights


def rows(n_tok: int) -> list[int]:
    """The query rows a context of n_tok tokens is weighed by (codec.tuning.token_steps.PROBE_EVERY)."""
    return probe_rows(n_tok, PROBE_EVERY)


def weighed_prefill(lm: LoadedModel, tokens: list[int], **kw):
    """models.prefill(lm, tokens, **kw) and the context's weights [L, T] by its rows(),
    recorded during it: (logits, kv, weights)."""
    with recording(lm.model.config.num_hidden_layers, len(tokens), rows(len(tokens))) as rec:
        logits, kv = prefill(lm, tokens, **kw)
    return logits, kv, rec.weights
