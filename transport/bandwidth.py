"""Link bandwidth from the chunks a sender really delivered: bytes over send-to-ack time,
smoothed as a harmonic mean, kept per peer, with an active probe for a peer with no history."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

# A delivery this small measures round-trip latency rather than bandwidth (a TEXT chunk is
# ~3 KiB), so it must not drag the estimate down.
MIN_SAMPLE_BYTES = 64 * 1024
CLOCK_TICK = 1e-3  # seconds: the coarsest event-loop clock a sender may time with
RTT_JITTER = 0.02  # a PING's round trip is trusted to within this share of it (plus a clock tick)
# Seconds after which a sample no longer speaks for the link: a fetch after such a pause probes
# the link again (stale), and the probe drops the older samples, so one fetch's fast link does not
# plan the next fetch's first chunks once the link has changed (bench e2e: after a fetch at 1000
# Mbit/s, a 20 Mbit/s fetch sent its first three chunks as KV, which rules out a TEXT head: 5.4 s
# where a head and a streamed tail take 4.6 s).
STALE_S = 10.0


def crossing_s(elapsed: float, rtt: float) -> float:
    """How long bytes written onto an idle link took to cross it, from `elapsed` (write start to
    ACK or PONG) and the link's round trip `rtt`: elapsed - rtt, but never under what a ping's
    error could hide (RTT_JITTER of the round trip plus a clock tick) nor, for an RTT as long
    as `elapsed` or longer (impossible: noise), under half of `elapsed`, so a noisy RTT cannot
    blow the rate up. On a long link the round trip is most of a small delivery's time, so it
    must come off: a 512 KiB probe at 1 Gbit/s over 100 ms takes 104 ms, 4 of them crossing."""
    if rtt >= elapsed:
        return elapsed / 2
    return max(elapsed - rtt, min(elapsed / 2, RTT_JITTER * rtt + CLOCK_TICK))


class BandwidthEstimator:
    """Bytes/s of one link, from (bytes, send start, ack time) of each chunk actually sent.

    The estimate is the harmonic mean of the last `window` samples: the time to send B bytes
    is B/bandwidth, and the harmonic mean is the rate whose time is the mean of the samples'
    times, so one fast outlier cannot make the sender over-commit."""

    def __init__(self, window: int = 5, min_bytes: int = MIN_SAMPLE_BYTES, stale_s: float = STALE_S) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.min_bytes = min_bytes
        self.stale_s = stale_s
        self._rates: deque[float] = deque(maxlen=window)
        self._last_at: float | None = None  # when the newest sample's delivery was acknowledged

    def add(self, nbytes: int, sent_at: float, acked_at: float) -> bool:
        """Record one delivery; returns whether it counted (small ones do not). The first one
        more than `stale_s` after the last drops the samples before it."""
        if acked_at < sent_at:
            raise ValueError(f"ack at {acked_at} is before the send started at {sent_at}")
        if nbytes < self.min_bytes:
            return False
        if self.stale(sent_at):
            self._rates.clear()
        # Event-loop clocks tick in milliseconds (uvloop): a delivery inside one tick took at
        # most one tick, so count it as that rather than as infinitely fast.
        self._rates.append(nbytes / max(acked_at - sent_at, CLOCK_TICK))
        self._last_at = acked_at
        return True

    @property
    def needs_probe(self) -> bool:
        """True until the link has been measured once: the first chunk needs a probe."""
        return not self._rates

    def stale(self, now: float) -> bool:
        """Whether the newest sample is over `stale_s` old at `now` (the clock the deliveries
        were timed with): the link may have changed since, so a fetch probes it again before
        its first chunk, whose level (KV or a TEXT head) sets what the rest of the plan can be."""
        return self._last_at is not None and now - self._last_at > self.stale_s

    @property
    def samples(self) -> tuple[float, ...]:
        """The rates (bytes/s) in the window, oldest first."""
        return tuple(self._rates)

    def peak(self) -> float | None:
        """The fastest recent rate, bytes/s: as fast as this link has lately shown it can be;
        None without history."""
        return max(self._rates) if self._rates else None

    def estimate(self) -> float | None:
        """Harmonic mean of the recent rates, bytes/s; None without history."""
        if not self._rates:
            return None
        return len(self._rates) / sum(1.0 / r for r in self._rates)


@dataclass(frozen=True)
class Probe:
    """An active measurement before the first chunk to a peer with no history: send `size`
    bytes (padding the receiver acknowledges), and time them from write start to the ack."""

    # 0.8 s at 5 Mbit/s, 8 ms at 500 Mbit/s: large enough that a shaper's burst allowance or a
    # socket buffer does not make it look like line rate, small next to a chunk.
    size: int = 512 * 1024

    def crossing_s(self, sent_at: float, acked_at: float, rtt: float = 0.0) -> float:
        """How long its bytes took to cross the link (crossing_s: the round trip taken off)."""
        if acked_at < sent_at:
            raise ValueError(f"probe ack at {acked_at} is before its send at {sent_at}")
        return crossing_s(max(acked_at - sent_at, CLOCK_TICK), rtt)  # see BandwidthEstimator.add

    def record(self, estimator: BandwidthEstimator, sent_at: float, acked_at: float,
               rtt: float = 0.0) -> float:
        """Feed the probe's timing to `estimator` as its first sample; returns the rate.

        A probe is small, so one round trip (from PING/PONG) is a visible part of its time and
        is taken off (crossing_s), so that a noisy RTT cannot blow the rate up."""
        transfer = self.crossing_s(sent_at, acked_at, rtt)
        if not estimator.add(self.size, acked_at - transfer, acked_at):
            raise ValueError(f"a probe of {self.size} bytes is under the estimator's "
                             f"minimum sample of {estimator.min_bytes} bytes")
        return self.size / transfer


# The probes a link is measured with, in turn, smallest first: one whose bytes take PROBE_ENOUGH_S
# to cross is the measurement, and the larger ones are not sent. Probe.size alone took 0.21 s of
# a 20 Mbit/s fetch (0.84 s at 5 Mbit/s); 128 KiB crosses such a link in 52 ms (a tbf burst of
# 16 kB is an eighth of it), while a fast link crosses it in a millisecond or two, mostly the
# shaper's burst and the socket's buffers, and gets Probe.size after it, as before.
PROBES = (Probe(128 * 1024), Probe())
PROBE_ENOUGH_S = 0.04


class PeerBandwidth:
    """Estimators by peer id, so a later FETCH to the same peer starts from its history and
    skips the probe; past `max_peers` the least recently used peer is forgotten."""

    def __init__(self, window: int = 5, max_peers: int = 1024) -> None:
        self.window = window
        self.max_peers = max_peers
        self._peers: OrderedDict[str, BandwidthEstimator] = OrderedDict()

    def get(self, peer: str) -> BandwidthEstimator:
        """The estimator of `peer`, made empty (needing a probe) on first use."""
        est = self._peers.pop(peer, None) or BandwidthEstimator(self.window)
        self._peers[peer] = est
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        return est

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def __contains__(self, peer: str) -> bool:
        return peer in self._peers

    def __len__(self) -> int:
        return len(self._peers)
