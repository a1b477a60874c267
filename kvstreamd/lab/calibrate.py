"""Make a codec profile for a model: PCA bases and symbol statistics from sample KV, the
model's sensitivity to errors in each (layer, K/V) stream, and the step scale of each level,
all measured on calibration text (the valid.txt splits: WikiText-2 for the statistics, every
kind of text tuned on for the level scales, corpus.TUNED) -- never on the text we report on,
and never on a kind held out from tuning (corpus's `manual`, which has no valid.txt)."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import numpy as np
import torch

import codec
from codec import profile as profiles
from codec.tuning import rate, token_steps, tuned
from codec.tuning.levels import LADDER, LEVELS

from .. import models
from ..config import CodecConfig
from ..models import rate_probe, token_weight
from . import corpus, quality

# The floors each level must hold on held-out text of every kind (codec.tuning.levels, Level.kl_floor).
LEVEL_KL_FLOORS = {name: LEVELS[name].kl_floor for name in LADDER}
# What each level aims for on the tuning text, on its worst kind (see tune_levels): the floor
# with a margin, for held-out text of a kind that is harder than the tuning text of that kind.
KL_MARGIN = 0.8  # held-out KL came out up to 1.14x the tuning target (Gemma fast, WikiText); 0.75 on SmolLM2, docs/benchmarks.md
LEVEL_KL_TARGETS = {name: round(KL_MARGIN * floor, 6) for name, floor in LEVEL_KL_FLOORS.items()}
# What per-chunk rate control aims for on the tuning text (tune_targets), on its worst kind, as a
# share of each level's floor. Its held-out KL lands far inside what it was tuned to: with targets
# tuned to 0.8 x each floor, SmolLM2's test.txt came to 0.45-0.51 of every floor on every tuned
# kind and 0.62-0.78 on the untuned manual (docs/benchmarks.md "Per-chunk rate control"; one scale
# per level, KL_MARGIN, had come out up to 1.14x its goal). So `balanced` and `fast` aim at the
# floor itself. `high` keeps 0.8: it is the near-lossless level (transport.policy
# NEAR_LOSSLESS_DPPL) a sender takes where the answer must not move, and aimed at its floor an
# e2e document's continuation moved +1.08% and +1.21% (docs/benchmarks.md "Rate control aimed at
# the floor").
RATE_KL_MARGIN = {"high": 0.8, "balanced": 1.0, "fast": 1.0}
RATE_KL_TARGETS = {name: round(RATE_KL_MARGIN[name] * floor, 6) for name, floor in LEVEL_KL_FLOORS.items()}
# The level scales are tuned on every kind of text that is tuned on (corpus.TUNED: all but the
# kind held out from tuning), on its tuning split (valid.txt): a level must hold its quality on
# contracts or code as well as on Wikipedia prose, and the held-out kind checks that it holds on
# a kind no tuning saw. Contexts are of the benchmark's shape (3 x 3072 tokens, 256 continuation
# tokens): short contexts are noisier and not what the daemon stores.
TUNING_TEXTS = corpus.TUNED
TUNING_CONTEXTS, TUNING_TOKENS, TUNING_CONTINUATION = 3, 3072, 256
# The sensitivity that finally sets each stream's step is measured with the codec's own error,
# on the tuning text of every kind, at this level's default scale (between high and fast).
# Gaussian noise on WikiText alone ranks the streams for WikiText only: on the licence text an
# error in the first layers' values costs 5-20x more KL (docs/benchmarks.md).
PROBE_LEVEL = "balanced"
# The chunk size contexts are coded in here: the daemon's default ([codec] chunk_tokens).
CHUNK_TOKENS = CodecConfig.chunk_tokens
# A stream's sensitivity is at least this share of the mean: a KL of ~1e-5 is mostly noise, and
# a stream priced at nothing would get a step that wipes it out.
SENSITIVITY_FLOOR = 0.02


class Case(NamedTuple):
    """One tuning context of one kind, measured on the exact cache."""
    kv: torch.Tensor  # [L, 2, T, H, D] fp16, as it is put
    cont: list[int]  # the continuation's tokens
    ref: torch.Tensor  # their exact logits
    tokens: list[int]  # the context's
    weights: np.ndarray | None = None  # [L, T]: how much the probes read each token (models.token_weight)

    def classes(self, profile) -> np.ndarray | None:
        """Its tokens' step classes with `profile` (codec.tuning.token_steps), None where it takes none."""
        return token_steps.classes_for(self.weights, profile)


def chunked_roundtrip(kv: torch.Tensor, level, profile, chunk_tokens: int = CHUNK_TOKENS,
                      scales: list[float] | None = None, token_classes: np.ndarray | None = None
                      ) -> tuple[torch.Tensor, int]:
    """Encode and decode kv chunk by chunk as the daemon stores it, each chunk at its own scale
    if `scales` (codec.tuning.rate) says, each token at its own step where `token_classes` ([L, T] of
    the whole context) are given; returns (decoded, bytes)."""
    parts, nbytes = [], 0
    for i, start in enumerate(range(0, kv.shape[2], chunk_tokens)):
        data = codec.encode(kv[:, :, start:start + chunk_tokens], level, profile, start=start,
                            scale=None if scales is None else scales[i],
                            token_classes=None if token_classes is None else token_classes[:, start:start + chunk_tokens])
        nbytes += len(data)
        parts.append(codec.decode(data, profile))
    return torch.cat(parts, dim=2), nbytes


def measure_sensitivity(lm, cases: list[tuple[torch.Tensor, list[int], torch.Tensor]], sink_tokens: int,
                        log: Callable[[str], None] = print) -> np.ndarray:
    """KL per unit of per-element squared error, for each (layer, K/V) stream perturbed alone
    with Gaussian noise (the sink rows untouched, as the codec keeps them exact)."""
    L = cases[0][0].shape[0]
    out = np.zeros((L, 2))
    gen = torch.Generator().manual_seed(0)
    for layer in range(L):
        window = lm.layout.windows[layer]
        for k_or_v in range(2):
            ratios = []
            for kv, cont, ref in cases:
                # A sliding layer is perturbed only where the model reads it: its window.
                first = max(sink_tokens, lm.layout.first_token(window, kv.shape[2]))
                stream = kv[layer, k_or_v, first:]
                eps = 0.03 * float(stream.std())
                for _ in range(5):
                    noisy = kv.clone()
                    noisy[layer, k_or_v, first:] += torch.randn(stream.shape, generator=gen) * eps
                    d = quality.kl(ref, models.continuation_logits(lm, noisy, cont))
                    if d > 5e-3:
                        eps /= 3  # out of the quadratic regime
                    elif d < 2e-5:
                        eps *= 3  # below the numerical floor
                    else:
                        break
                ratios.append(d / eps ** 2)
            out[layer, k_or_v] = float(np.mean(ratios))
        log(f"  layer {layer:2d}: K {out[layer, 0]:.3g}  V {out[layer, 1]:.3g}  (KL per unit MSE)")
    return out


def codec_sensitivity(lm, profile, cases: dict[str, list], log: Callable[[str], None] = print) -> np.ndarray:
    """[L, 2]: each (layer, K/V) stream's sensitivity as equal_slope_steps reads it (KL per unit
    of step^2 / 12, the error a uniform quantizer of that step adds), measured with the codec's
    own error: every chunk coded at PROBE_LEVEL's default scale on the profile's base steps, the
    stream's KL taken with it alone decoded and every other stream exact, on the kind of text
    where that stream costs most. The step's nominal error, not the measured one, is the unit,
    so a stream whose weak components the step zeroes is priced by what its step costs.
    `cases`: kind -> [(kv, continuation, exact logits)], as tuning_cases gives."""
    lv = dataclasses.replace(LEVELS[PROBE_LEVEL], name=f"{PROBE_LEVEL}-probe")  # the level's default scale
    nominal = (lv.steps(profile).astype(np.float64)) ** 2 / 12
    per_kind = {}
    for kind, kind_cases in cases.items():
        kl = np.zeros((profile.layers, 2))
        for kv, cont, ref, *_ in kind_cases:
            dec, _ = chunked_roundtrip(kv, lv, profile)
            mixed = kv.clone()  # one copy per case: each stream is swapped in, measured, swapped back
            for layer in range(profile.layers):
                for k_or_v in range(2):
                    mixed[layer, k_or_v] = dec[layer, k_or_v]
                    kl[layer, k_or_v] += quality.kl(ref, models.continuation_logits(lm, mixed, cont)) / len(kind_cases)
                    mixed[layer, k_or_v] = kv[layer, k_or_v]
        per_kind[kind] = kl / nominal
        top = np.argsort(kl.ravel())[::-1][:3]
        costly = ", ".join(f"{'KV'[i % 2]}{i // 2} {kl.ravel()[i]:.2g}" for i in top)
        log(f"  {kind}: KL of each stream alone sums to {kl.sum():.5f}; most: {costly}")
    worst = np.max(np.stack(list(per_kind.values())), axis=0)
    return np.maximum(worst, SENSITIVITY_FLOOR * worst.mean())


def channel_weights(lm, windows: list[list[int]], sink_tokens: int) -> np.ndarray:
    """[L, 2, H*D]: how much an error in each key or value channel matters, relative to the
    other channels of its stream.

    Keys: a key error e changes the logit of query q by q.R(n-m)e; averaged over relative
    positions the rotation spreads each rotary pair evenly, so the weight of channel i is the
    mean energy of the un-rotated queries (before RoPE: q_proj's output, or q_norm's in models
    that normalise queries, as Gemma-3 and Qwen3 do) in i's pair, over the query heads that
    share the KV head. Values: an error passes through the attention weights (which sum to one)
    and o_proj, so the weight is o_proj's squared column norm, summed over the query heads that
    read the KV head. Module names are transformers' for every Llama-like decoder.
    """
    layers = decoder_layers(lm.model)
    H, D = lm.num_kv_heads, lm.head_dim
    group = layers[0].self_attn.q_proj.out_features // (H * D)
    energy = [torch.zeros(group * H * D, dtype=torch.float64) for _ in layers]
    count = [0]

    def hook(i):
        def record(_module, _inputs, out):
            # q_proj gives [1, T, heads * D]; a q_norm runs on [1, heads, T, D]
            q = out[0].transpose(0, 1) if out.dim() == 4 else out[0]
            q = q[sink_tokens:].reshape(q.shape[0] - sink_tokens, -1).to(torch.float64)
            energy[i] += (q ** 2).sum(0)
            if i == 0:
                count[0] += q.shape[0]
        return record

    handles = [query_module(layer.self_attn).register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for w in windows:
            models.prefill(lm, w, all_logits=False)
    finally:
        for h in handles:
            h.remove()
    out = np.zeros((len(layers), 2, H * D))
    half = D // 2
    for i, layer in enumerate(layers):
        q = (energy[i] / max(count[0], 1)).view(H, group, D).sum(1)  # kv head h serves query heads h*group..
        pair = q[:, :half] + q[:, half:]
        out[i, 0] = torch.cat([pair, pair], dim=1).reshape(-1).numpy()
        cols = layer.self_attn.o_proj.weight.detach().to(torch.float64).pow(2).sum(0)  # [heads * D]
        out[i, 1] = cols.view(H, group, D).sum(1).reshape(-1).numpy()
    return out


def decoder_layers(model) -> list:
    """The decoder blocks of a transformers causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.model.layers to calibrate on")
    return list(layers)


def query_module(attn):
    """The module whose output is the queries before RoPE: q_norm where the model has one."""
    return getattr(attn, "q_norm", None) or attn.q_proj


def tuning_cases(lm, split: str = "valid", texts=TUNING_TEXTS, contexts: int = TUNING_CONTEXTS,
                 tokens: int = TUNING_TOKENS, continuation: int = TUNING_CONTINUATION,
                 log: Callable[[str], None] = print) -> dict[str, list]:
    """kind -> [Case], from each kind's split: the token weights recorded during each prefill."""
    texts = tuple(texts)
    for kind in texts:  # a kind held out from tuning, or unknown, is refused before any prefill
        corpus.path(split, kind)
    out = {}
    for kind in texts:
        out[kind] = []
        for i, w in enumerate(corpus.windows(lm.tokenizer, split, contexts, tokens + continuation, kind=kind)):
            log(f"prefill {kind} tuning context {i + 1}/{contexts} ({tokens} tokens)")
            _, kv, weights = token_weight.weighed_prefill(lm, w[:tokens], all_logits=False)
            cont = w[tokens:]
            out[kind].append(Case(kv.to(torch.float16), cont, models.continuation_logits(lm, kv, cont),  # stored as fp16
                                  w[:tokens], weights))
    return out


# How far past the coarsest point it tried a tuner may take a fitted answer: a fit is trusted
# between the points it was fitted on, a little beyond, not far.
FIT_REACH = 1.15


def crossing(tried: list[tuple[float, float]], goal: float) -> float:
    """Where KL meets `goal`, from every (x, KL) a tuner tried (x a scale or a target; KL grows
    as a power of it): a least-squares line through the points in log-log, solved for the goal,
    and held between the coarsest point that met the goal (within the tuners' tolerance, 10%)
    and the finer of FIT_REACH x the coarsest point tried and the finest point that missed it. One point, or a curve that does not grow: the
    coarsest point that met the goal, else the finest tried. Not the first point under the goal:
    the secant steps land anywhere below it, and the curve says where it is crossed."""
    met = [x for x, kl in tried if math.log(kl / goal) < 0.1]
    missed = [x for x, kl in tried if math.log(kl / goal) >= 0.1]
    fallback = max(met) if met else min(x for x, _ in tried)
    xs = np.log([x for x, _ in tried])
    ys = np.log([kl for _, kl in tried])
    if len(tried) < 2 or np.ptp(xs) < 1e-9:
        return fallback
    slope, intercept = np.polyfit(xs, ys, 1)
    if slope <= 0:
        return fallback
    ceiling = min([FIT_REACH * math.exp(xs.max()), *missed])  # never as coarse as a point that missed
    # held in log space: a curve that barely grows crosses the goal absurdly far out
    fitted = math.exp(min((math.log(goal) - intercept) / slope, math.log(ceiling)))
    return float(min(max(fitted, fallback if met else 0.0), ceiling))


def _worst_kind(lm, by_kind: dict[str, list], coded: Callable[[str, int, Case], tuple[torch.Tensor, int]]
                ) -> tuple[float, str]:
    """(the worst kind's mean KL, a line saying each kind's and the bits per element) of every
    case coded as coded(kind, index, case) -> (decoded KV, bytes) gives it."""
    kl_of, bits = {}, []
    for kind, kind_cases in by_kind.items():
        kls = []
        for i, case in enumerate(kind_cases):
            kv, cont, ref = case.kv, case.cont, case.ref
            dec, nbytes = coded(kind, i, case)
            kls.append(quality.kl(ref, models.continuation_logits(lm, dec, cont)))
            bits.append(nbytes * 8 / kv.numel())
        kl_of[kind] = float(np.mean(kls))
    got = max(kl_of.values())
    per_kind = "  ".join(f"{k} {v:.5f}" for k, v in kl_of.items())
    return got, f"KL {got:.5f} (worst; {per_kind})  {np.mean(bits):.3f} bits/element"


def tune_levels(lm, profile, cases, log: Callable[[str], None] = print) -> dict[str, float]:
    """For each level, the scale on the base steps whose KL meets its target on the worst kind
    of text: `cases` is kind -> cases (or one list of cases), and a scale's KL is the highest of
    the kinds' mean KLs (KL grows about as scale^2, so a few secant steps in log space converge,
    and the answer is where a line fitted through every point tried crosses the target)."""
    by_kind = cases if isinstance(cases, dict) else {"calibration": cases}
    scales = {}
    kl_per_scale2 = float(profile.meta["kl_budget"])  # KL at scale 1, as the base steps were set; then as measured
    for name in LADDER:
        target = LEVEL_KL_TARGETS[name]
        scale = math.sqrt(target / kl_per_scale2)
        tried = []
        for _ in range(5):
            # Another name, so the scale under test is not overridden by the profile's table.
            lv = dataclasses.replace(LEVELS[name], name=f"{name}-tuning", scale=scale)
            got, said = _worst_kind(lm, by_kind, lambda kind, i, case: chunked_roundtrip(
                case.kv, lv, profile, token_classes=case.classes(profile)))
            log(f"  {name:9s} scale {scale:6.3f}: {said}")
            kl_per_scale2 = got / scale ** 2
            tried.append((scale, got))
            if abs(math.log(got / target)) < 0.1:
                break
            scale *= math.sqrt(target / got) ** 0.8  # damped: the curve flattens at low rates
        scales[name] = round(crossing(tried, target), 4)
    return scales


def chunk_costs(lm, profile, cases: dict[str, list], log: Callable[[str], None] = print) -> dict[str, list]:
    """kind -> each case's chunk costs (models.rate_probe), what codec.tuning.rate sets a chunk's scale from."""
    costs = {}
    for kind, kind_cases in cases.items():
        log(f"probing each chunk of the {kind} tuning contexts")
        costs[kind] = [rate_probe.chunk_costs(lm, c.tokens, c.kv, CHUNK_TOKENS, profile) for c in kind_cases]
    return costs


def tune_targets(lm, profile, cases: dict[str, list], log: Callable[[str], None] = print,
                 costs: dict[str, list] | None = None) -> tuned.RateControl:
    """The profile's rate control (codec.tuning.rate): for each level, the target its chunks' probes
    may reach such that coding every tuning context chunk by chunk (each chunk at the scale its
    own probes give it) meets the level's RATE_KL_TARGETS on the worst kind of text. The
    continuation's KL grows about in proportion to the target, so a few secant steps converge,
    and the answer is where a line fitted through every point tried crosses the goal. `costs`:
    chunk_costs of the cases, if already probed."""
    costs = costs or chunk_costs(lm, profile, cases, log)
    targets = {}
    for name in LADDER:
        goal = RATE_KL_TARGETS[name]
        target = goal / tuned.DEFAULT_MARGIN
        tried = []
        for _ in range(4):
            got, said = _worst_kind(lm, cases, lambda kind, i, case: chunked_roundtrip(
                case.kv, name, profile, scales=rate.scales(name, profile, costs[kind][i], target),
                token_classes=case.classes(profile)))
            log(f"  {name:9s} target {target:.5f}: {said}")
            tried.append((target, got))
            if abs(math.log(got / goal)) < 0.1:
                break
            target *= (goal / got) ** 0.9
        targets[name] = round(crossing(tried, goal), 6)
    return tuned.RateControl(targets)


def calibrate(lm, *, split: str = "valid", contexts: int = 4, tokens: int = 2048, sensitivity_contexts: int = 2,
              sensitivity_tokens: int = 1024, continuation: int = 128, sink_tokens: int = 1,
              sensitivity: np.ndarray | None = None, texts=TUNING_TEXTS, tuning_contexts: int = TUNING_CONTEXTS,
              tuning_tokens: int = TUNING_TOKENS, tuning_continuation: int = TUNING_CONTINUATION,
              rate_control: bool = True, token_power: float | None = None,
              log: Callable[[str], None] = print) -> profiles.Profile:
    """The whole calibration. The statistics come from WikiText's split. Each stream's
    sensitivity is measured twice: with Gaussian noise on WikiText (a first ranking, which sets
    the steps the second measurement codes at), then with the codec's own error on the tuning
    text of each kind in `texts` (codec_sensitivity: what sets the shipped steps). The level
    scales are then tuned on that text: `tuning_contexts` x `tuning_tokens` (+
    `tuning_continuation`) tokens of each kind. `sensitivity` reuses an earlier profile's final
    measurement (the slow part) and skips both. `rate_control` False: no per-chunk rate control
    (every chunk at its level's one scale), for a model whose held-out text it does not hold the
    floors on (Gemma-3-270M's: docs/benchmarks.md). `token_power`: the profile takes per-token
    steps at that power (codec.tuning.token_steps), and its level scales are tuned with them."""
    texts = tuple(texts)
    for kind in texts:  # a kind held out from tuning, or unknown, is refused before any prefill
        corpus.path(split, kind)
    windows = corpus.windows(lm.tokenizer, split, contexts, tokens + continuation)
    sensitivity_tokens = min(sensitivity_tokens, tokens)  # a short calibration measures on what it has
    samples, cases = [], []
    for i, w in enumerate(windows):
        log(f"prefill calibration context {i + 1}/{len(windows)} ({tokens} tokens)")
        _, kv = models.prefill(lm, w[:tokens], all_logits=False)
        samples.append((kv, 0))
        if i < sensitivity_contexts:
            kvs = kv[:, :, :sensitivity_tokens].clone()
            cont = w[sensitivity_tokens:sensitivity_tokens + continuation]
            cases.append((kvs, cont, models.continuation_logits(lm, kvs, cont)))
    measured = sensitivity is None
    if measured:
        log("measuring sensitivity of each (layer, K/V) stream to Gaussian noise (a first ranking)")
        sensitivity = measure_sensitivity(lm, cases, sink_tokens, log)
    log("measuring channel weights (query energy per rotary pair, o_proj column norms)")
    weights = channel_weights(lm, [w[:tokens] for w in windows[:2]], sink_tokens)
    log("fitting PCA bases and symbol statistics")
    # (a model with fewer positions tunes on the longest contexts it takes)
    tuning_tokens = min(tuning_tokens, lm.max_positions - tuning_continuation - 1)
    prof = profiles.fit(samples, model_id=lm.model_id, inv_freq=lm.rotary.inv_freq,
                        unrotate_keys=lm.rotary.invertible, rope_info=lm.rotary.info,
                        layer_windows=lm.layer_windows, sensitivity=sensitivity, channel_weight=weights,
                        sink_tokens=sink_tokens,
                        source=f"wikitext-2 {split}.txt, {contexts} x {tokens} tokens; stream sensitivity "
                               f"(codec error, worst kind) and level scales on {split}.txt of {', '.join(texts)}, "
                               f"{tuning_contexts} x {tuning_tokens} tokens each")
    if token_power is not None:
        tuned.write(prof, token_steps=tuned.TokenSteps(float(token_power), tuned.DEFAULT_TOP))
    tuning = tuning_cases(lm, split, texts, tuning_contexts, tuning_tokens, tuning_continuation, log)
    if measured:
        log(f"measuring each stream's sensitivity to the codec's own error on {', '.join(texts)}")
        prof.set_sensitivity(codec_sensitivity(lm, prof, tuning, log))
    log(f"tuning level scales on {', '.join(texts)}")
    tuned.write(prof, level_scales=tune_levels(lm, prof, tuning, log))
    costs = None
    if rate_control:
        costs = chunk_costs(lm, prof, tuning, log)
        log("tuning each level's target for per-chunk rate control")
        tuned.write(prof, rate_control=tune_targets(lm, prof, tuning, log, costs))
    log("measuring each level's cost (what the sender's level choice weighs for this model)")
    tuned.write(prof, level_dppl=level_costs(lm, prof, tuning, costs, log))
    return prof


def level_costs(lm, profile, cases: dict[str, list], costs: dict[str, list] | None,
                log: Callable[[str], None] = print) -> dict[str, float]:
    """Each level's quality cost, what the sender's level choice weighs for this model
    (codec.tuning.catalog.dppl_table): the expected Δppl % of a continuation, 100 x its mean KL from the
    exact cache's next-token distributions, on the kind of text where the level costs most, with
    every chunk coded as the daemon codes it (at the scale its own probes give it, `costs`, where
    the profile has rate control; None: at its level's one scale).

    Not the Δppl measured on the continuations, which is logged beside it: on 256 scored tokens
    that swings about a point either way and cannot order the levels. On SmolLM2's nine tuning
    contexts it ranged -1.54% to +1.10% at `balanced` (KL 0.0013-0.0053) and its means priced
    `high` 0.08, `balanced` 0.097, so a sender that had lost its deadline took `balanced` as
    near-lossless; Gemma-3's priced `high` above `balanced`. Over text the model itself would
    write, the mean change in log-perplexity is the KL."""
    out = {}
    for name in LADDER:
        kl, dppl = {}, []
        for kind, kind_cases in cases.items():
            kls = []
            for i, case in enumerate(kind_cases):
                kv, cont, ref = case.kv, case.cont, case.ref
                dec, _ = chunked_roundtrip(kv, name, profile,
                                           scales=rate.scales(name, profile, costs[kind][i]) if costs else None,
                                           token_classes=case.classes(profile))
                logits = models.continuation_logits(lm, dec, cont)
                kls.append(quality.kl(ref, logits))
                target = torch.tensor(cont[1:])
                dppl.append(quality.perplexity(logits[:-1], target) / quality.perplexity(ref[:-1], target) - 1)
            kl[kind] = float(np.mean(kls))
        worst = max(kl, key=kl.get)
        out[name] = round(100 * kl[worst], 3)
        log(f"  {name:9s} cost {out[name]:.3f}% (100 x KL on {worst}; "
            f"{'  '.join(f'{k} {v:.5f}' for k, v in kl.items())})  "
            f"measured Δppl {100 * min(dppl):+.2f}% to {100 * max(dppl):+.2f}%")
    return out
