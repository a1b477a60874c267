"""The one table of levels and baselines: every scheme the codec implements is priced there,
and nothing is priced that the codec cannot code."""
from codec import baselines
from codec.tuning import catalog, levels
from transport.policy import TEXT


def test_every_codec_level_and_baseline_is_in_the_catalog_and_nothing_else():
    assert set(catalog.SCHEMES) == set(levels.LEVELS) | set(baselines.SCHEMES)
    for name in levels.LEVELS:
        assert catalog.get(name).kind == "level"
    for name in baselines.SCHEMES:
        assert catalog.get(name).kind == "baseline"
        assert catalog.get(name).decode_mbps > 0


def test_the_policy_table_prices_the_levels_asked_for_and_text():
    table = catalog.dppl_table(["high", "cachegen-paper", "int8"])
    assert table == {"high": 0.0, "cachegen-paper": catalog.get("cachegen-paper").dppl, "int8": 0.0, TEXT: 0.0}
    assert catalog.TEXT == TEXT


def test_with_a_models_own_figures_a_baseline_counts_as_no_better_than_its_best_own_level():
    # SmolLM2's own: high 0.08. int8's catalog 0.0 comes from another measurement: it is priced
    # as high, so a fast link's plan may mix the two for time, not send all int8 for "quality".
    own = {"high": 0.08, "balanced": 0.097, "fast": 0.753}
    table = catalog.dppl_table(["high", "balanced", "fast", "int8", "fp16", "kivi2"], own)
    assert table == {**own, "int8": 0.08, "fp16": 0.08, "kivi2": catalog.get("kivi2").dppl, TEXT: 0.0}
    assert catalog.dppl_table(["int8"], None)["int8"] == catalog.get("int8").dppl  # no own figures: the catalog's


def test_a_baseline_is_priced_as_the_best_own_level_in_play_not_one_the_fetch_cannot_use():
    # `max`'s own price is tiny; where `max` is offered, int8 counts as no better than it, and
    # where it is not, as no better than `high`, as before.
    own = {"max": 0.01, "high": 0.16, "balanced": 0.5}
    assert catalog.dppl_table(["max", "high", "int8"], own)["int8"] == 0.01
    assert catalog.dppl_table(["high", "balanced", "int8"], own)["int8"] == 0.16
    assert catalog.dppl_table(["int8"], own)["int8"] == 0.01  # no own level in play: the best own


def test_decode_time_uses_the_receivers_rate_for_entropy_coded_levels_only():
    assert catalog.decode_seconds("high", 100.0, receiver_mbps=50.0) == 2.0
    assert catalog.decode_seconds("fp16", 100.0, receiver_mbps=50.0) == 100.0 / catalog.get("fp16").decode_mbps


def test_an_unknown_name_is_named():
    import pytest
    with pytest.raises(ValueError, match="unknown level 'ultra'"):
        catalog.get("ultra")


def test_is_level_tells_the_codec_levels_from_baselines_text_and_unknown_names():
    assert all(catalog.is_level(n) for n in ("high", "balanced", "fast", "cachegen-paper"))
    assert not any(catalog.is_level(n) for n in ("fp16", "int8", "zstd-fp16", "kivi2", catalog.TEXT, "nonsense"))
    assert [n for n, s in catalog.SCHEMES.items() if s.is_level] == [n for n in catalog.SCHEMES if catalog.is_level(n)]
