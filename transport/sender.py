"""The sender side of one FETCH, sans-IO: which chunk goes next and at which level, learning
the link from the fetcher's ACKs. No sockets and no clock: every call takes `now`
(transport/send.py runs it over a connection)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .bandwidth import BandwidthEstimator
from .policy import TEXT, Choice, Rule, Situation


@dataclass(frozen=True)
class _InFlight:
    level: str
    bytes: int


class FetchSender:
    """Hands out chunks 0..chunks-1 of request `req` in order, each at the level `rule` picks
    from the estimator's view of the link, the receiver's predicted backlog and the time left.
    What each level costs is data: `work_s` (receiver seconds per chunk) and `dppl` (quality);
    `text_s`, where given, each chunk's receiver seconds as TEXT (policy.text_seconds);
    `beside`, the levels whose receiver work does not queue behind the others' (Situation.beside).

    A deadline that passes is recorded, not ignored: the stream goes on at whatever the rule
    says once the deadline is lost, and `deadline_missed` reports it for the END message.
    The deadline counts until the receiver has acknowledged every chunk.

    TEXT comes as a head, a tail, or both, never between KV chunks: a head of TEXT the receiver
    prefills from its tokens while the KV after it streams in (the plan prices the two side by
    side), and once a KV chunk has gone, TEXT only as a tail -- the receiver computes it on top
    of every chunk before it, so after they have all arrived, and the rule plans it so. Once a
    chunk goes as TEXT after a KV chunk, every later one does too. With `text_last` (the
    receiver holds a KV prefix, then computes: vLLM) there is no head: TEXT is a tail from the
    first chunk on."""

    def __init__(self, req: int, chunks: int, sizes: Mapping[str, Sequence[int]], deadline_ms: float,
                 now: float, rule: Rule, estimator: BandwidthEstimator, work_s: Mapping[str, float],
                 dppl: Mapping[str, float], text_last: bool = False,
                 text_s: Sequence[float] | None = None, beside: Iterable[str] = ()) -> None:
        if chunks < 1:
            raise ValueError(f"request {req}: a stream needs at least one chunk, got {chunks}")
        wrong = {lv: len(s) for lv, s in sizes.items() if len(s) != chunks}
        if not sizes or wrong:
            raise ValueError(f"request {req}: every level needs {chunks} chunk sizes, "
                             f"got {wrong or 'no levels'}")
        missing = [lv for lv in sizes if lv not in work_s or lv not in dppl]
        if missing:
            raise ValueError(f"request {req}: no receiver work or quality cost for levels {missing}")
        if deadline_ms < 0:
            raise ValueError(f"request {req}: deadline_ms must be >= 0, got {deadline_ms}")
        self.req = req
        self.chunks = chunks
        self.sizes = {lv: list(s) for lv, s in sizes.items()}
        self.deadline_at = now + deadline_ms / 1000
        self.rule = rule
        self.estimator = estimator
        self.work_s = dict(work_s)
        self.dppl = dict(dppl)
        self.text_last = text_last
        if text_s is not None and len(text_s) != chunks:
            raise ValueError(f"request {req}: text_s lists {len(text_s)} chunks, not {chunks}")
        self.text_s = None if text_s is None else list(text_s)  # each chunk's receiver seconds as TEXT
        self.beside = frozenset(beside)  # levels the receiver works on beside the rest (Situation.beside)
        self.levels: list[str] = []  # the level of each chunk handed out, in order
        self.choices: list[Choice] = []  # the rule's answer for each, with its reason
        self.cancelled = False
        self.finished_at: float | None = None  # when the last chunk was acknowledged
        self._inflight: dict[int, _InFlight] = {}
        self._receiver_free = now  # predicted: the receiver is through every chunk acked so far
        self._missed = False

    @property
    def needs_probe(self) -> bool:
        """True when the link to this peer was never measured: probe before the first chunk."""
        return self.estimator.needs_probe

    @property
    def finished(self) -> bool:
        """Every chunk acknowledged, or the stream cancelled: time for END."""
        return self.cancelled or self.finished_at is not None

    def next_chunk(self, now: float) -> tuple[int, str] | None:
        """The next chunk to send and its level; None once all are handed out or after cancel."""
        if self.cancelled or len(self.levels) == self.chunks:
            return None
        estimate = self.estimator.estimate()
        if estimate is None:
            raise RuntimeError(f"request {self.req}: no bandwidth estimate for this peer; "
                               "probe the link before the first chunk (needs_probe)")
        self.deadline_missed(now)
        i = len(self.levels)
        # past the head: TEXT is a tail, computed after every chunk before it has arrived
        text_last = self.text_last or any(lv != TEXT for lv in self.levels)
        if text_last and self.levels and self.levels[-1] == TEXT:
            return self._hand_out(i, Choice(TEXT, 0.0, "a TEXT tail: after a TEXT chunk, the rest as TEXT"))
        situation = Situation(
            bandwidth=estimate, sizes={lv: s[i:] for lv, s in self.sizes.items()},
            work_s=self.work_s, dppl=self.dppl, deadline_s=self.deadline_at - now,
            # Chunks in flight still have their decode ahead of them at the receiver.
            backlog_s=max(0.0, self._receiver_free - now)
            + sum(self.work_s[c.level] for c in self._inflight.values() if c.level not in self.beside),
            inflight_bytes=sum(c.bytes for c in self._inflight.values()), text_last=text_last,
            text_s=None if self.text_s is None else self.text_s[i:], peak_bandwidth=self.estimator.peak(),
            beside=self.beside)
        choice = self.rule(situation)
        if choice.level not in self.sizes:
            raise ValueError(f"request {self.req}: the rule chose {choice.level!r}, "
                             f"not one of the levels on offer {list(self.sizes)}")
        return self._hand_out(i, choice)

    def _hand_out(self, i: int, choice: Choice) -> tuple[int, str]:
        self.levels.append(choice.level)
        self.choices.append(choice)
        self._inflight[i] = _InFlight(choice.level, self.sizes[choice.level][i])
        return i, choice.level

    def on_ack(self, i: int, nbytes: int, sent_at: float, acked_at: float) -> None:
        """The receiver has chunk i in full: `nbytes` on the wire, written from `sent_at`.
        Acks still count after cancel: they are honest measurements of the link."""
        sent = self._inflight.pop(i, None)
        if sent is None:
            raise ValueError(f"request {self.req}: ACK for chunk {i}, which is not in flight "
                             f"({len(self.levels)} of {self.chunks} chunks sent)")
        self.estimator.add(nbytes, sent_at, acked_at)
        if sent.level not in self.beside:
            self._receiver_free = max(self._receiver_free, acked_at) + self.work_s[sent.level]
        if len(self.levels) == self.chunks and not self._inflight and not self.cancelled:
            self.finished_at = acked_at
            self._missed |= acked_at > self.deadline_at

    def cancel(self) -> None:
        """Stop at once: no chunk is handed out after this."""
        self.cancelled = True

    def deadline_missed(self, now: float) -> bool:
        """Whether the deadline passed before the receiver had every chunk; once True, stays
        True (it goes into END)."""
        if not self.finished and now > self.deadline_at:
            self._missed = True
        return self._missed
