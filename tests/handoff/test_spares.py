"""Released fetch buffers kept for the next fetch (handoff/spares.py), over real shared memory."""
from __future__ import annotations

import time
from pathlib import Path

from kvstreamd.handoff.buffers import HostBuffer
from kvstreamd.handoff.spares import IDLE_S, SpareBuffers
from kvstreamd.metrics import Metrics
from kvstreamd.node.leases import BufferLeases

MB = 1 << 20


def buffer(mb: int) -> HostBuffer:
    return HostBuffer.create((mb * MB // 2,), "float16")


def linked(buf: HostBuffer) -> bool:
    return Path("/dev/shm", buf.name).exists()


def test_a_spare_goes_to_the_smallest_fetch_it_holds_and_only_once():
    spares = SpareBuffers(64 * MB)
    small, large = buffer(2), buffer(8)
    spares.give(large)
    spares.give(small)
    try:
        assert spares.take(9 * MB) is None
        assert spares.take(1 * MB) is small  # the smallest that holds it
        assert spares.take(3 * MB) is large and len(spares) == 0 and spares.take(1) is None
    finally:
        for b in (small, large):
            b.release()


def test_spares_over_the_budget_let_the_oldest_go_and_idle_ones_go_after_idle_s():
    spares = SpareBuffers(10 * MB)
    first, second, third = buffer(4), buffer(4), buffer(4)
    spares.give(first, now=0.0)
    spares.give(second, now=1.0)
    spares.give(third, now=2.0)  # 12 MB > 10: the oldest goes
    assert not linked(first) and linked(second) and linked(third) and spares.nbytes() == 8 * MB
    spares.expire(1.0 + IDLE_S + 0.5)
    assert not linked(second) and linked(third)
    spares.reconfigure(0)
    assert not linked(third) and len(spares) == 0


def test_only_a_buffer_its_client_released_is_kept_never_an_expired_lease():
    leases = BufferLeases(lease_s=10.0, metrics=Metrics(), spare_bytes=64 * MB)
    kept, expired = buffer(2), buffer(2)
    leases.hold(kept)
    leases.hold(expired)
    assert leases.release(kept.name, spare=True)
    leases.expire(now=time.monotonic() + 11.0)  # the other's lease ran out: its client may still read it
    assert linked(kept) and not linked(expired) and len(leases.spares) == 1 and len(leases) == 0
    leases.release_all()
    assert not linked(kept) and len(leases.spares) == 0


def test_a_fetch_short_of_room_lets_the_oldest_spares_go_until_it_has_room():
    # /dev/shm has 1 MB free; each spare's 4 MB come back once it goes
    spares = SpareBuffers(64 * MB)
    bufs = [buffer(4) for _ in range(3)]
    for k, b in enumerate(bufs):
        spares.give(b, now=float(k))
    gone = spares.make_room(6 * MB, 1 * MB)  # 1 + 4 is short: the two oldest go
    for b in gone:
        b.release_now()
    assert [linked(b) for b in bufs] == [False, False, True] and len(spares) == 1
    assert spares.make_room(1 * MB, 1 * MB) == []  # room enough: nothing goes
    assert linked(bufs[2])
    spares.release_all()
