"""What coding each chunk of a context costs the model (codec.tuning.rate.ChunkCost), measured where
the model is: in the process that has just prefilled the context and is about to put it.

Each chunk is coded once at codec.tuning.rate.PROBE_SCALE and decoded (codec.tuning.named.roundtrip: the
codec's own symbols and inverse, without the entropy coder), and put in place of its exact
KV, alone, under two short probes of the context's own tokens (no text beyond the context is
needed): the context's last PROBE_TOKENS (`end`) and the PROBE_TOKENS right after the chunk
(`last`; for the last chunk the two are one). The KL of each against the same probe on the
exact KV, over PROBE_SCALE**2, is the chunk's cost. A context of n chunks costs 2n - 1 forward
passes of PROBE_TOKENS tokens and n roundtrips at one level, and n more forwards unless the
prefill kept the exact logits the probes compare with (probe_rows, models.put does).
"""
from __future__ import annotations

import torch

from codec.tuning.named import roundtrip
from codec.profile import Profile
from codec.tuning.rate import PROBE_SCALE, ChunkCost

from .adapter import LoadedModel, continuation_logits

# Tokens per probe: enough that a probe's KL is a steady figure (its noise, chunk to chunk,
# moves a scale by a grid step or less), few enough that probing costs a fraction of the put.
PROBE_TOKENS = 64
PROBE_LEVEL = "balanced"  # the transforms the probes code with (every level of the ladder has them)


def kl(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Mean over positions of KL(reference || test) of the next-token distributions."""
    p = torch.log_softmax(reference.float(), -1)
    q = torch.log_softmax(test.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _layout(n_tok: int, chunk_tokens: int) -> tuple[list[tuple[int, int]], int]:
    """(each chunk's token range, the probe's length) of a context of n_tok tokens."""
    bounds = [(s, min(s + chunk_tokens, n_tok)) for s in range(0, n_tok, chunk_tokens)]
    return bounds, max(1, min(PROBE_TOKENS, (bounds[-1][1] - bounds[-1][0]) // 2))


def probe_rows(n_tok: int, chunk_tokens: int) -> list[int]:
    """The tokens (ascending, disjoint) whose exact logits the probes compare against: those
    right after each chunk but the last, then the context's last ones. A caller that prefills
    the context asks models.prefill for them (logits_at) and saves the probes a forward each."""
    bounds, probe = _layout(n_tok, chunk_tokens)
    return [t for _, e in bounds[:-1] for t in range(e, e + probe)] + list(range(n_tok - probe, n_tok))


@torch.no_grad()
def chunk_costs(lm: LoadedModel, tokens: list[int], kv: torch.Tensor, chunk_tokens: int,
                profile: Profile, exact: torch.Tensor | None = None) -> list[ChunkCost]:
    """One ChunkCost per chunk of `chunk_tokens` of the context `tokens`, whose KV
    `[L, 2, T, H, D]` (as it will be put) is `kv`. `exact`: the context's logits at
    probe_rows() from its prefill, else run here on the exact KV."""
    n_tok = len(tokens)
    if kv.shape[2] != n_tok:
        raise ValueError(f"KV holds {kv.shape[2]} tokens, the context {n_tok}")
    bounds, probe = _layout(n_tok, chunk_tokens)
    rows = len(probe_rows(n_tok, chunk_tokens))
    if exact is not None and exact.shape[0] != rows:
        raise ValueError(f"exact logits for {exact.shape[0]} tokens, the probes read {rows}")
    coded = [roundtrip(kv[:, :, s:e], PROBE_LEVEL, profile, start=s, scale=PROBE_SCALE) for s, e in bounds]

    def cost(cut: int, c: int, ref: torch.Tensor | None) -> float:
        """KL of tokens[cut:cut+probe] on kv[:cut] with chunk c's part of it coded, against
        `ref` (those tokens' logits on the exact KV; run here when None)."""
        ids = tokens[cut:cut + probe]
        if ref is None:
            ref = continuation_logits(lm, kv[:, :, :cut], ids)
        mixed = kv[:, :, :cut].clone()
        s, e = bounds[c]
        mixed[:, :, s:min(e, cut)] = coded[c][:, :, :min(e, cut) - s]
        return kl(ref, continuation_logits(lm, mixed, ids)) / PROBE_SCALE ** 2

    def exact_at(i: int) -> torch.Tensor | None:
        """The exact logits of probe i (the i-th run of probe_rows), when the caller gave them."""
        return None if exact is None else exact[i * probe:(i + 1) * probe]

    n = len(bounds)
    end_cut = n_tok - probe
    # the one reference every end probe shares
    shared = exact_at(n - 1) if exact is not None else continuation_logits(lm, kv[:, :, :end_cut], tokens[end_cut:])
    out = []
    for c, (_, e) in enumerate(bounds):
        end = cost(end_cut, c, shared)
        out.append(ChunkCost(end, end if c == n - 1 else cost(e, c, exact_at(c))))
    return out
