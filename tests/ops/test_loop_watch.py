"""The event loop's watch (kvstreamd/ops/loop_watch.py): a held loop is logged once it runs again,
with where it was held, counted in /v1/status and in kvstreamd_event_loop_lag_seconds."""
from __future__ import annotations

import asyncio
import logging
import time

from kvstreamd.metrics import Metrics
from kvstreamd.ops.loop_watch import HELD_S, LoopWatch


def lag_samples(metrics: Metrics, at_least: float) -> float:
    """Ticks of the histogram at or above `at_least` seconds late."""
    total = below = 0.0
    for s in metrics.registry.collect():
        for x in s.samples:
            if x.name == "kvstreamd_event_loop_lag_seconds_count":
                total = x.value
            elif x.name == "kvstreamd_event_loop_lag_seconds_bucket" and float(x.labels["le"]) < at_least:
                below = max(below, x.value)
    return total - below


def hold_the_loop_with_a_synchronous_sleep(seconds: float) -> None:
    time.sleep(seconds)


async def test_a_held_loop_is_logged_with_where_it_was_held_and_counted(caplog):
    metrics = Metrics()
    watch = LoopWatch(metrics)
    await watch.start()
    try:
        await asyncio.sleep(0.2)
        with caplog.at_level(logging.WARNING, logger="kvstreamd.ops.loop_watch"):
            hold_the_loop_with_a_synchronous_sleep(3 * HELD_S)
            await asyncio.sleep(0.2)  # the next tick says it
    finally:
        await watch.stop()
    said = [r.getMessage() for r in caplog.records if r.name == "kvstreamd.ops.loop_watch"]
    assert len(said) == 1, said
    assert said[0].startswith("event loop held 0.") and "hold_the_loop_with_a_synchronous_sleep" in said[0]
    assert "test_loop_watch.py:" in said[0]  # file:line of each frame
    status = watch.status()
    assert status["holds"] == 1 and status["longest_s"] >= 2.5 * HELD_S
    assert "hold_the_loop_with_a_synchronous_sleep" in status["last"]["where"]
    assert lag_samples(metrics, 0.5) == 1


async def test_a_loop_that_is_never_held_says_nothing_and_ticks(caplog):
    metrics = Metrics()
    watch = LoopWatch(metrics)
    await watch.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvstreamd.ops.loop_watch"):
            for _ in range(20):
                await asyncio.sleep(0.02)
    finally:
        await watch.stop()
    assert not [r for r in caplog.records if r.name == "kvstreamd.ops.loop_watch"]
    assert watch.status()["holds"] == 0 and lag_samples(metrics, 0.0) >= 4
