"""Both level-choice rules (transport/policy.py) as a specification, without a network: on exact
situations, and compared on seeded CacheGen-style traces."""
from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest

from codec.tuning import catalog
from tests.fixtures import DPPL, fixed, mbit
from transport import traces
from transport.policy import NEAR_LOSSLESS_DPPL, TEXT, Situation, _finish, adaptive_rule, cachegen_rule, text_seconds

PAPER_LADDER = ("high", "balanced", "fast", TEXT)  # CacheGen's own levels, without int8


def situation(chunks: int, bandwidth: float, deadline_s: float, ladder=None, **kw) -> Situation:
    sizes, work = traces.smollm2_chunks(chunks)
    if ladder is not None:
        sizes = {lv: sizes[lv] for lv in ladder}
    return Situation(bandwidth=bandwidth, sizes=sizes, work_s=work, dppl=DPPL, deadline_s=deadline_s, **kw)


# --- the rules on exact situations ------------------------------------------------------------
# SmolLM2-135M chunks: int8 11.9 MB, high 4.52 MB, balanced 3.40 MB, fast 2.04 MB per chunk.

@pytest.mark.parametrize("deadline_s, level", [(5.0, "int8"), (2.0, "high"), (1.2, "balanced"),
                                               (0.7, "fast"), (0.5, TEXT)])
def test_cachegen_rule_takes_the_highest_level_whose_bytes_fit(deadline_s, level):
    # 4 chunks at 100 Mbit/s: int8 3.8 s, high 1.45 s, balanced 1.09 s, fast 0.65 s.
    choice = cachegen_rule(situation(4, mbit(100), deadline_s))
    assert choice.level == level


def test_cachegen_rule_predicts_bytes_over_bandwidth_only():
    s = situation(4, mbit(100), 2.0)
    assert cachegen_rule(s).predicted_seconds == pytest.approx(sum(s.sizes["high"]) / mbit(100))


def test_cachegen_rule_without_text_on_offer_falls_to_the_smallest_level():
    s = situation(4, mbit(100), 0.1, ladder=("int8", "high", "balanced", "fast"))
    assert cachegen_rule(s).level == "fast"


def test_adaptive_rule_takes_int8_when_the_link_is_fast_and_decode_is_the_bottleneck():
    # 2 Gbit/s: a `high` chunk crosses in 18 ms but decodes in 197 ms; int8 crosses in 48 ms
    # and decodes in 31 ms. CacheGen's rule sees only the bytes, and picks `high`.
    s = situation(4, mbit(2000), 0.3)
    assert cachegen_rule(situation(4, mbit(2000), 0.3, ladder=PAPER_LADDER)).level == "high"
    choice = adaptive_rule(s)
    assert choice.level == "int8" and choice.predicted_seconds <= 0.3


def test_on_a_fast_link_int8_meets_a_deadline_that_decode_makes_impossible_for_coded_levels():
    sizes, work = traces.smollm2_chunks(4)
    assert 4 * work["fast"] > 0.45  # even the fastest entropy-coded level decodes too slowly
    adaptive = traces.simulate(adaptive_rule, [2000.0] * 4, sizes, 0.45, work, DPPL)
    assert adaptive.deadline_met and adaptive.mean_dppl == 0.0 and "int8" in adaptive.levels
    paper = {lv: sizes[lv] for lv in PAPER_LADDER}
    assert not traces.simulate(cachegen_rule, [2000.0] * 4, paper, 0.45, work, DPPL).deadline_met


def fast_link_mix(n: int = 16):
    """16 chunks at 1000 Mbit/s: a `high` chunk decodes in 40 ms and crosses in 8; int8 decodes
    in 4 and crosses in 24; the two priced alike (a model's own `high` against int8 from the
    catalog). Returns n, sizes, work, dppl."""
    sizes = {"high": [1_000_000] * n, "int8": [3_000_000] * n}
    return n, sizes, {"high": 0.040, "int8": 0.004}, catalog.dppl_table(sizes, {"high": 0.08})


def test_with_time_to_spare_a_fast_link_mixes_two_levels_priced_alike_to_keep_wire_and_decoder_busy():
    # A deadline all `high` meets: the plan that finishes first sends some of each, `high`
    # first (the decoder's work starts while int8 fills the wire), replanning at every chunk.
    n, sizes, work, dppl = fast_link_mix()
    mixed = traces.simulate(adaptive_rule, [1000.0], sizes, 2.0, work, dppl)
    alone = {lv: traces.simulate(fixed([lv] * n), [1000.0], sizes, 2.0, work, dppl).total_seconds for lv in sizes}
    assert mixed.total_seconds < 0.8 * min(alone.values()), (mixed, alone)
    assert list(mixed.levels) == sorted(mixed.levels, key=("high", "int8").index)  # every `high` first
    assert 4 <= mixed.levels.count("high") <= 10, mixed.levels


def test_the_safety_discount_falls_on_the_decoder_as_on_the_link_so_it_leans_no_mix_either_way():
    # Discounting both stages alike moves every plan's time by one factor: the plan chosen at
    # any safety is the one chosen at none. (Discounting the link alone chose more `high`.)
    n, sizes, work, dppl = fast_link_mix()
    for mbit in (600.0, 1000.0, 1500.0):
        s = Situation(bandwidth=mbit * 1e6 / 8, sizes=sizes, work_s=work, dppl=dppl, deadline_s=2.0,
                      beside=frozenset({"int8"}))
        plan = lambda safety: adaptive_rule(s, safety=safety).reason.split(": ")[1].split(" in ")[0]  # noqa: E731
        assert plan(0.9) == plan(1.0) == plan(0.7), mbit


def test_a_level_the_receiver_decodes_beside_the_coded_ones_does_not_wait_behind_their_decode():
    # The same 1000 Mbit/s mix, on a receiver that decodes int8 in a thread of its own as each
    # chunk lands (node/fetch.py): int8's 4 ms no longer queue behind the `high` backlog, so
    # more `high` fits beside the wire, and the context is in sooner than with the plan that
    # priced int8 as queued -- on that receiver, and by the plan's own prediction.
    n, sizes, work, dppl = fast_link_mix()
    queued = traces.simulate(adaptive_rule, [1000.0], sizes, 2.0, work, dppl)
    aside = traces.simulate(adaptive_rule, [1000.0], sizes, 2.0, work, dppl, beside=frozenset({"int8"}))
    as_planned_before = traces.simulate(fixed(list(queued.levels)), [1000.0], sizes, 2.0, work, dppl,
                                        beside=frozenset({"int8"}))
    assert aside.levels.count("high") > queued.levels.count("high")
    assert aside.total_seconds < as_planned_before.total_seconds
    # The plan's prediction: no mix later priced beside, some sooner; an all-int8 plan still
    # ends one int8 decode after its last byte.
    plans = np.array([[k, n - k] for k in range(n + 1)], float)
    kw = dict(bandwidth=mbit(1000), sizes=sizes, work_s=work, dppl=dppl, deadline_s=2.0)
    apart = _finish(Situation(**kw, beside=frozenset({"int8"})), plans, mbit(1000))[0]
    inline = _finish(Situation(**kw), plans, mbit(1000))[0]
    assert (apart <= inline + 1e-12).all() and (apart < inline - 0.01).any()
    assert apart[0] == pytest.approx(n * 3_000_000 / mbit(1000) + 0.004)


def test_adaptive_rule_counts_the_receivers_backlog():
    free = adaptive_rule(situation(2, mbit(2000), 0.6))
    busy = adaptive_rule(situation(2, mbit(2000), 0.6, backlog_s=0.5))
    assert busy.predicted_seconds > free.predicted_seconds + 0.4


def test_adaptive_rule_sends_text_when_recompute_beats_a_slow_link_at_no_quality_cost():
    # 5 Mbit/s: one `high` chunk takes 7.2 s to cross; recompute takes 3.5 s and overlaps the link.
    choice = adaptive_rule(situation(2, mbit(5), 9.0))
    assert choice.level == TEXT and "Δppl 0.00%" in choice.reason


@pytest.mark.parametrize("high_dppl,level", [(0.08, "high"), (0.29, "high"), (0.31, TEXT), (1.0, TEXT)])
def test_recompute_wins_only_by_more_than_the_noise_of_the_measured_costs(high_dppl, level):
    # 100 Mbit/s, a 60 s deadline: every plan fits, recompute included; the levels below
    # high cost more than it, so the choice is high or TEXT
    costs = {**DPPL, "high": high_dppl, "balanced": high_dppl + 0.5, "fast": high_dppl + 2, "int8": high_dppl + 0.1,
             "fp16": high_dppl + 0.1}
    s = situation(4, mbit(100), 60.0)
    choice = adaptive_rule(Situation(s.bandwidth, s.sizes, s.work_s, costs, s.deadline_s))
    assert choice.level == level, choice.reason


@pytest.mark.parametrize("rate,deadline_s", [(5, 20.0), (10, 10.0), (20, 6.0)])
def test_with_text_last_a_plan_that_recomputes_sends_its_kv_chunks_first(rate, deadline_s):
    # 4 chunks on a slow link: the best plan recomputes some, TEXT first (the receiver computes
    # while the link carries the rest); a receiver that holds a KV prefix and then computes
    # (text_last) is planned for as it runs, TEXT after every KV chunk, and gets KV first
    s = situation(4, mbit(rate), deadline_s)
    anywhere, last = adaptive_rule(s), adaptive_rule(Situation(**{**s.__dict__, "text_last": True}))
    assert anywhere.level == TEXT, anywhere.reason
    assert last.level != TEXT, last.reason
    plan = last.reason.split(": ", 1)[1].split(" in ")[0]  # e.g. "2xbalanced + 2xtext"
    assert TEXT not in plan or plan.endswith("x" + TEXT), plan


def test_text_costs_more_the_further_into_the_prompt_it_lies():
    assert text_seconds(1024, 0, 512.0, None) == text_seconds(1024, 4096, 512.0, None) == 2.0
    assert text_seconds(1024, 0, 512.0, 5000.0) == pytest.approx(2.0 * (1 + 511.5 / 5000))
    # a chunk whose middle lies at the doubling position costs twice a flat-priced one
    assert text_seconds(1024, 5000 - 511.5, 512.0, 5000.0) == pytest.approx(4.0)


def test_a_text_head_priced_by_position_is_shorter_than_one_priced_flat():
    # 8 chunks on a slow link: the plan computes a head and streams the rest. Priced by
    # position (each chunk further in costs more), the head it plans is no longer, and its
    # predicted finish is what the per-position costs add up to.
    s = situation(8, mbit(10), -1.0)
    flat = s.work_s[TEXT]
    by_position = [text_seconds(1, i, 1 / flat, 2.0) for i in range(8)]  # chunk i costs flat*(1 + i/2)
    planned = adaptive_rule(Situation(**{**s.__dict__, "text_s": by_position}))
    plain = adaptive_rule(s)

    def texts(choice):
        plan = choice.reason.split(": ", 1)[1].split(" in ")[0]
        return sum(int(float(p.split("x")[0])) for p in plan.split(" + ") if p.endswith("x" + TEXT))

    assert planned.level == plain.level == TEXT
    assert 1 <= texts(planned) < texts(plain), (planned.reason, plain.reason)
    assert planned.predicted_seconds >= sum(by_position[:texts(planned)])
    with pytest.raises(ValueError, match="text_s"):
        Situation(**{**s.__dict__, "text_s": by_position[:3]})


@pytest.mark.parametrize("peak,bet", [(None, True), (2.0, True), (1.5, True), (1.05, False), (1.0, False)])
def test_a_rule_behind_its_deadline_bets_on_the_link_only_as_far_as_the_link_has_lately_gone(peak, bet):
    # 8 chunks at 20 Mbit/s, a deadline that all-`fast` meets at 1.4x the estimate and nothing
    # meets at 0.9x: a link whose samples have reached 1.5x (or that the rule knows nothing
    # of) may speed up, so the rule plans the fastest way (`fast` chunks); a steady one will not, and the
    # deadline is lost, so the rule finishes near-lossless the quickest way
    s = situation(8, mbit(20), 1.0, ladder=("high", "balanced", "fast", TEXT))
    deadline = sum(s.sizes["fast"]) / (1.4 * s.bandwidth) + s.work_s["fast"]
    s = Situation(**{**s.__dict__, "deadline_s": deadline,
                     "peak_bandwidth": None if peak is None else peak * s.bandwidth})
    choice = adaptive_rule(s)
    if bet:
        assert "behind" in choice.reason and "xfast" in choice.reason, choice.reason  # (a TEXT head, then fast)
    else:
        assert "deadline lost" in choice.reason and s.dppl[choice.level] <= NEAR_LOSSLESS_DPPL, choice.reason
    with pytest.raises(ValueError, match="peak_bandwidth"):
        Situation(**{**s.__dict__, "peak_bandwidth": 0.0})


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_a_lost_deadline_on_a_steady_slow_link_plans_text_and_high_at_a_shipped_profiles_costs(model):
    # A shipped profile's expected costs put `high` within NEAR_LOSSLESS_DPPL of exact and
    # `balanced` past it: 16 chunks at 20 Mbit/s with a lost deadline go as a TEXT head and a
    # `high` tail. Priced by their measured Δppl (0.08 / 0.097 for SmolLM2), `balanced` tails
    # went out, and cost +1.1% to +1.6% Δppl on bench e2e documents.
    from codec.profile import Profile
    from codec.tuning.registry import SHIPPED_DIR

    own = Profile.load(SHIPPED_DIR / f"{model}.kvprofile").meta["level_dppl"]
    s = situation(16, mbit(20), -1.0, ladder=("high", "balanced", "fast", "int8", TEXT))
    s = Situation(**{**s.__dict__, "dppl": catalog.dppl_table(list(s.sizes), own)})
    assert s.dppl["high"] <= NEAR_LOSSLESS_DPPL < s.dppl["balanced"] < s.dppl["fast"]
    choice = adaptive_rule(s)
    plan = choice.reason.split(": ", 1)[1].split(" in ")[0]
    assert "deadline lost" in choice.reason and "xtext" in plan and "xhigh" in plan, choice.reason
    assert "balanced" not in plan and "fast" not in plan, choice.reason


@pytest.mark.parametrize("deadline_s, all_max", [(6.0, True), (2.4, False)])
def test_max_priced_below_high_takes_the_chunks_the_deadline_has_room_for(deadline_s, all_max):
    # `max` (5.9 bits a value, a third slower to decode) priced as its profile prices it, int8 no
    # better: 4 chunks at 100 Mbit/s are 2.8 s at `max` and 1.5 s at `high`. With room, every
    # chunk goes at `max` (int8, priced alike, is slower); with less, as many as still fit.
    s = situation(4, mbit(100), deadline_s, ladder=("high", "int8", TEXT))
    sizes = {"max": [round(traces.CHUNK_ELEMENTS * 5.9 / 8)] * 4, **s.sizes}
    s = Situation(**{**s.__dict__, "sizes": sizes, "work_s": {**s.work_s, "max": traces.CHUNK_BYTES / 90e6},
                     "dppl": {"max": 0.0024, "high": 0.155, "int8": 0.0024, TEXT: 0.0}})
    choice = adaptive_rule(s)
    plan = choice.reason.split(": ", 1)[1].split(" in ")[0]
    assert "fits" in choice.reason, choice.reason
    if all_max:
        assert plan == "4xmax", choice.reason
    else:
        assert "xmax" in plan and "xhigh" in plan and choice.predicted_seconds <= deadline_s, choice.reason


def test_a_lost_deadline_splits_head_and_tail_at_the_estimate_whatever_the_safety_discount():
    # With no deadline left to keep, the discount on the link (safety) must not move the split
    # between a TEXT head and a KV tail: on the link alone, it priced a 20 Mbit/s, 8192-token
    # tail 11% slow and planned 12 TEXT chunks (10-11 s) beside a tail carried in 7.7 s.
    s = situation(16, mbit(20), -1.0, ladder=("high", TEXT))
    s = Situation(**{**s.__dict__, "work_s": {**s.work_s, TEXT: 1.1 * np.mean(s.sizes["high"]) / mbit(20)}})
    plans = {safety: adaptive_rule(s, safety=safety).reason.split(": ", 1)[1].split(" in ")[0]
             for safety in (1.0, 0.9, 0.6)}
    assert len(set(plans.values())) == 1 and "xtext" in plans[1.0] and "xhigh" in plans[1.0], plans


@pytest.mark.parametrize("rate", [20, 100])
def test_adaptive_rule_after_a_lost_deadline_finishes_near_lossless_the_quickest_way(rate):
    # Of the plans within NEAR_LOSSLESS_DPPL of the best quality, the fastest: not every chunk
    # recomputed (TEXT, exact) for a level measured a noise-level 0.08 points from it.
    s = situation(4, mbit(rate), -1.0)
    s = Situation(**{**s.__dict__, "dppl": {**s.dppl, "high": 0.08}})
    choice = adaptive_rule(s)
    assert s.dppl[choice.level] <= NEAR_LOSSLESS_DPPL and "deadline lost" in choice.reason
    assert choice.predicted_seconds < 4 * s.work_s[TEXT] and choice.predicted_seconds < sum(s.sizes["high"]) / s.bandwidth


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_adaptive_rule_meets_a_constant_link_deadline_whenever_an_assignment_fits_with_its_margin(chunks):
    # Every level sequence is tried on the same simulated pipeline; a deadline 1/0.9 above the
    # best of them (the rule plans at 0.9 x the estimate) must be met, at any bandwidth.
    sizes, work = traces.smollm2_chunks(chunks)
    for rate in (5, 12, 30, 70, 150, 300, 500, 1000, 2000):
        trace = [float(rate)] * chunks
        best = min(traces.simulate(fixed(seq), trace, sizes, 1e9, work, DPPL).total_seconds
                   for seq in itertools.product(sizes, repeat=chunks))
        for slack in (1 / 0.9 + 1e-3, 1.5, 3.0):
            result = traces.simulate(adaptive_rule, trace, sizes, best * slack, work, DPPL)
            assert result.deadline_met, (rate, slack, best, result)


# --- the comparison on CacheGen-style traces --------------------------------------------------

SEEDS = range(50)
# Deadlines of 1 to 2.5 s per chunk: at 5-500 Mbit/s a `high` chunk takes 0.1-7 s to cross,
# so each of them forces a choice between quality and the deadline on some traces.
CONFIGS = [(chunks, per_chunk * chunks) for chunks in (4, 8) for per_chunk in (1.0, 1.5, 2.0, 2.5)]


def _evaluate(rule, chunks: int, deadline_s: float, ladder=None) -> tuple[float, float, float]:
    sizes, work = traces.smollm2_chunks(chunks)
    if ladder is not None:
        sizes = {lv: sizes[lv] for lv in ladder}
    runs = [traces.simulate(rule, traces.generate(seed, chunks), sizes, deadline_s, work, DPPL) for seed in SEEDS]
    return (sum(r.deadline_met for r in runs) / len(runs), statistics.fmean(r.mean_dppl for r in runs),
            statistics.median(r.total_seconds for r in runs))


def test_adaptive_rule_meets_more_deadlines_than_cachegen_at_no_worse_quality():
    rules = {"cachegen": (cachegen_rule, None), "cachegen-paper": (cachegen_rule, PAPER_LADDER),
             "adaptive": (adaptive_rule, None)}
    print(f"\n{len(SEEDS)} traces each (5-500 Mbit/s, log-uniform per chunk); "
          "met = deadline attainment, Δppl = mean over chunks, s = median seconds")
    print(f"{'chunks':>6} {'deadline':>8}  " + "  ".join(f"{name:>22}" for name in rules))
    totals = {name: [0.0, 0.0] for name in rules}
    for chunks, deadline_s in CONFIGS:
        got = {name: _evaluate(rule, chunks, deadline_s, ladder) for name, (rule, ladder) in rules.items()}
        print(f"{chunks:>6} {deadline_s:>7.0f}s  " + "  ".join(
            f"{met:>5.0%} {dppl:>+6.2f}% {secs:>5.1f}s" for met, dppl, secs in got.values()))
        for name, (met, dppl, _) in got.items():
            totals[name][0] += met / len(CONFIGS)
            totals[name][1] += dppl / len(CONFIGS)
        adaptive = got["adaptive"]
        for baseline in ("cachegen", "cachegen-paper"):
            assert adaptive[0] >= got[baseline][0], (chunks, deadline_s, baseline, got)
            assert adaptive[1] <= got[baseline][1], (chunks, deadline_s, baseline, got)
    print(f"{'all':>15}  " + "  ".join(f"{met:>5.0%} {dppl:>+6.2f}%{'':7}" for met, dppl in totals.values()))
