"""The weighted KLT (codec.pca with a channel scale): the rotation fitted to the channels scaled by
their error weights' roots, one step for every component. Its error stays where the quantizer
puts it, in the weighted metric; where channels are correlated and weighted unevenly it takes
fewer bits than the plain rotation for the same weighted error; and a profile fitted without it
codes as the plain rotation always did."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec import pca, profile as profiles, rope
from codec.tuning import levels
from tests.fixtures import SMALL

C = SMALL["heads"] * SMALL["head_dim"]


def correlated_kv(tokens: int, seed: int) -> torch.Tensor:
    """KV whose channels are mixtures of a few strong sources and noise: what PCA is for."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(C, C, generator=torch.Generator().manual_seed(99)) * torch.logspace(0.3, -2, C).view(C, 1)
    z = torch.randn(SMALL["layers"], 2, tokens, C, generator=g)
    return (z @ mix).view(SMALL["layers"], 2, tokens, SMALL["heads"], SMALL["head_dim"])


def fitted(weighted: bool, samples) -> profiles.Profile:
    sens = np.ones((SMALL["layers"], 2))
    # uneven weights, as a model's queries and o_proj give them: a few channels matter most
    weights = np.broadcast_to(np.logspace(1.5, -1.5, C), (SMALL["layers"], 2, C)).copy()
    return profiles.fit(samples, model_id="synthetic-weighted", rope_theta=10000.0, sensitivity=sens,
                        channel_weight=weights, kl_budget=1e-2, weighted=weighted)


@pytest.fixture(scope="module")
def pair():
    samples = [(correlated_kv(600, 1), 0), (correlated_kv(500, 2), 600)]
    return fitted(True, samples), fitted(False, samples)


def weighted_error(prof: profiles.Profile, kv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per (layer, K/V): the mean over tokens of the error's squared norm in the weighted metric
    (sum_i weight_i err_i^2), the sink row left out."""
    w = torch.from_numpy(prof.tensors["channel_weight"].astype(np.float32)).view(SMALL["layers"], 2, 1, C)
    err = (out.float() - kv.float()).flatten(3)[:, :, prof.sink_tokens:]
    return (w * err ** 2).sum(-1).mean(-1)


def test_a_weighted_profile_keeps_each_tokens_weighted_error_within_the_quantizers_bound(pair):
    prof, _ = pair
    assert prof.tensors["pca_channel_scale"].shape == (SMALL["layers"], 2, C)
    assert np.all(prof.tensors["pca_step_scale"] == 1)  # every component takes the stream's step
    for seed, start in [(5, 0), (6, 700)]:
        kv = correlated_kv(90, seed)
        out = codec.decode(codec.encode(kv, "balanced", prof, start=start), prof)
        steps = levels.get("balanced").steps(prof)
        for layer in range(SMALL["layers"]):
            for k in range(2):
                g = prof.channel_scale(layer, k)
                x = kv[layer, k].flatten(1).float()
                if k == 0:  # keys are compared un-rotated, where they were quantized
                    x = rope.unrotate(kv[layer, k].float(), start, prof.inv_freq(layer)).flatten(1)
                    y = rope.unrotate(out[layer, k].float(), start, prof.inv_freq(layer)).flatten(1)
                else:
                    y = out[layer, k].flatten(1).float()
                d = ((y - x) * g)[prof.sink_tokens if start == 0 else 0:]
                # each component rounded to the step moves the weighted vector by at most
                # sqrt(C) * step / 2 (the rotation is orthonormal in the weighted channels)
                bound = float(steps[layer, k]) / 2 * C ** 0.5
                assert float(d.norm(dim=-1).max()) <= bound * 1.001 + 1e-4


def test_the_weighted_rotation_takes_fewer_bits_for_no_more_weighted_error(pair):
    weighted, plain = pair
    kv = correlated_kv(512, 9)

    def coded(prof, scale):
        data = codec.encode(kv, "high", prof, scale=scale)
        return len(data), float(weighted_error(prof, kv, codec.decode(data, prof)).mean())

    base = levels.get("high").scale_in(plain)
    size_plain, err_plain = coded(plain, base)
    lo, hi = base / 8, base * 8  # the weighted profile's coarsest scale with no more error
    for _ in range(20):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if coded(weighted, mid)[1] <= err_plain else (lo, mid)
    size_weighted, err_weighted = coded(weighted, lo)
    assert err_weighted <= err_plain
    assert size_weighted < 0.93 * size_plain  # 0.88 here


def test_a_profile_fitted_without_weights_codes_with_the_plain_rotation(pair):
    _, plain = pair
    assert "pca_channel_scale" not in plain.tensors and plain.channel_scale(0, 0) is None
    assert not np.all(plain.tensors["pca_step_scale"] == 1)  # steps by equal slope per component
    kv = correlated_kv(40, 4)
    out = codec.decode(codec.encode(kv, "high", plain, start=3), plain)
    x = pca.forward(kv[1, 1].flatten(1).float(), torch.from_numpy(plain.tensors["pca_mean"][1, 1]), plain.basis(1, 1))
    y = pca.forward(out[1, 1].flatten(1).float(), torch.from_numpy(plain.tensors["pca_mean"][1, 1]), plain.basis(1, 1))
    steps = plain.component_steps(1, 1, float(levels.get("high").steps(plain)[1, 1]))
    assert float(((y - x).abs() / steps).max()) <= 0.5 + 1e-2  # each component within half its own step


def test_the_channel_scale_is_part_of_the_profile_its_file_and_its_layer_subsets(pair, tmp_path):
    prof, plain = pair
    assert prof.id != plain.id
    again = profiles.Profile.load(prof.save(tmp_path / "w.kvprofile"))
    assert again.id == prof.id and np.array_equal(again.tensors["pca_channel_scale"], prof.tensors["pca_channel_scale"])
    sub = prof.subset((1, 2))
    assert torch.equal(sub.channel_scale(0, 1), prof.channel_scale(1, 1))
    lo, hi = profiles.CHANNEL_SCALE_RANGE
    assert prof.tensors["pca_channel_scale"].min() >= lo and prof.tensors["pca_channel_scale"].max() <= hi


def test_smollm2s_shipped_profile_uses_the_weighted_rotation():
    from codec.tuning import registry
    assert "pca_channel_scale" in registry.for_model("SmolLM2-135M-Instruct-Q4_1:bad8a3c4602d479c").tensors

