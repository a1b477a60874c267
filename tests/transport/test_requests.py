"""The request lifecycle as a specification, on bytes alone (no sockets, no clocks): every
rule of transport/requests.py in both directions (a side refuses to send what it would refuse
to receive), CANCEL, request ERRORs, ACKs, the receive buffer, and how a sender's request ends."""
from __future__ import annotations

import pytest

from transport import frames
from transport.messages import (BAD_REQUEST, INTERNAL, UNEXPECTED_MESSAGE, Ack, Cancel, Chunk, End,
                                Error, Fetch, Message, Text, to_wire)
from transport.protocol import (AckReceived, CancelReceived, ChunkReceived, Connection,
                                ConnectionClosed, EndReceived, ErrorReceived, FetchReceived,
                                LocalProtocolError, State)
from transport.requests import (DELIVER, DROP, FETCHER, RULES, SENDER, ReceiveBuffer, Requests,
                                apply, held_bytes)

SECRET = b"cluster-secret"
NOW = 1.0
KEYS = [bytes([n]) * 32 for n in range(3)]  # chunk keys are 32 bytes
DEADLINE_MS = 1000


def ready_pair(**kw) -> tuple[Connection, Connection]:
    """A fetcher c and a sender s, authenticated, nothing pending."""
    c = Connection("client", "fetcher", SECRET, nonce_source=lambda n: b"\x01" * n, **kw)
    s = Connection("server", "sender", SECRET, nonce_source=lambda n: b"\x02" * n, **kw)
    for _ in range(4):
        s.receive_data(c.data_to_send(), NOW)
        c.receive_data(s.data_to_send(), NOW)
    assert (c.state, s.state) == (State.READY, State.READY)
    events(c), events(s)
    return c, s


def events(conn: Connection) -> list:
    out = []
    while (ev := conn.next_event()) is not None:
        out.append(ev)
    return out


def frame(msg: Message) -> bytes:
    return frames.encode_frame(to_wire(msg))


def wire(data: bytes) -> list[dict]:
    dec = frames.FrameDecoder(2**30)
    dec.feed(data)
    return [f for f, _ in dec]


def deliver(src: Connection, dst: Connection, now: float = NOW) -> list:
    """Move what src has queued to dst; returns dst's events."""
    dst.receive_data(src.data_to_send(), now)
    return events(dst)


def fetch(c: Connection, s: Connection, keys=KEYS, deadline_ms: int = DEADLINE_MS, now: float = NOW) -> int:
    req = c.next_request_id()
    c.send(Fetch(req, keys, deadline_ms, ["high"]), now)
    assert [type(e) for e in deliver(c, s, now)] == [FetchReceived]
    return req


def send_chunks(c: Connection, s: Connection, req: int, indices) -> None:
    for i in indices:
        s.send(Chunk.of(req, i, "high", bytes([i]) * 10), NOW)
    deliver(s, c)
    deliver(c, s)  # the ACKs


def closed_with_bad_request(conn: Connection) -> str:
    evs = events(conn)
    assert conn.state is State.CLOSED
    assert isinstance(evs[-1], ConnectionClosed) and evs[-1].code == BAD_REQUEST and not evs[-1].by_peer
    sent = wire(conn.data_to_send())
    assert sent[-1]["t"] == "ERROR" and sent[-1]["code"] == BAD_REQUEST
    return evs[-1].msg


# -- one table, both directions ---------------------------------------------------------------


def _opened(c, s):
    return fetch(c, s)


def _one_chunk_in(c, s):
    req = fetch(c, s)
    send_chunks(c, s, req, [0])
    return req


def _ended(c, s):
    req = fetch(c, s, keys=[b"k" * 32])
    send_chunks(c, s, req, [0])
    s.send(End(req, "ok", False), NOW)
    deliver(s, c)
    return req


def _failed(c, s):
    req = fetch(c, s)
    s.send(Error("not_found", "no k1", req), NOW)
    deliver(s, c)
    return req


# name: (set-up returning req, the message that breaks a rule, who sends it, what the refusal says)
VIOLATIONS = {
    "chunk index out of range": (_opened, lambda r: Chunk.of(r, 3, "high", b"x"), SENDER, "out of range"),
    "text index out of range": (_opened, lambda r: Text(r, 7, [1]), SENDER, "out of range"),
    "chunk sent twice": (_one_chunk_in, lambda r: Chunk.of(r, 0, "high", b"y"), SENDER, "twice"),
    "text for a chunk already sent": (_one_chunk_in, lambda r: Text(r, 0, [1]), SENDER, "twice"),
    "END ok before every chunk": (_one_chunk_in, lambda r: End(r, "ok", False), SENDER, "1 of 3"),
    "END ok before any chunk": (_opened, lambda r: End(r, "ok", False), SENDER, "0 of 3"),
    "chunk after END": (_ended, lambda r: Chunk.of(r, 0, "high", b"x"), SENDER, "not an open FETCH"),
    "second END": (_ended, lambda r: End(r, "ok", False), SENDER, "not an open FETCH"),
    "chunk after a request ERROR": (_failed, lambda r: Text(r, 0, [1]), SENDER, "not an open FETCH"),
    "ERROR after a request ERROR": (_failed, lambda r: Error(INTERNAL, "x", r), SENDER, "not an open FETCH"),
    "chunk for a request never made": (_opened, lambda r: Chunk.of(r + 5, 0, "high", b"x"), SENDER, "never fetched"),
    "END for a request never made": (_opened, lambda r: End(r + 5, "ok", False), SENDER, "never fetched"),
    "ERROR for a request never made": (_opened, lambda r: Error(INTERNAL, "x", r + 5), SENDER, "never fetched"),
    "FETCH req not above the last": (_opened, lambda r: Fetch(r, KEYS, 1, []), FETCHER, "not above"),
    "CANCEL for a request never made": (_opened, lambda r: Cancel(r + 5), FETCHER, "never fetched"),
}


@pytest.mark.parametrize("direction", ["send", "receive"])
@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_a_request_rule_holds_for_what_is_sent_and_what_arrives(name, direction):
    setup, make, author, what = VIOLATIONS[name]
    c, s = ready_pair()
    msg = make(setup(c, s))
    writer, reader = (s, c) if author == SENDER else (c, s)
    if direction == "send":
        with pytest.raises(LocalProtocolError, match=what) as e:
            writer.send(msg, NOW)
        assert e.value.code == BAD_REQUEST and f"cannot send {msg.TYPE}" in e.value.msg
        assert writer.data_to_send() == b"" and writer.state is State.READY  # nothing queued
        assert events(writer) == []
    else:
        reader.receive_data(frame(msg), NOW)
        why = closed_with_bad_request(reader)
        assert what in why and "(state READY)" in why


def test_every_request_message_has_one_rule_naming_the_side_that_sends_it():
    assert {t.TYPE: r.by for t, r in RULES.items()} == {
        "FETCH": FETCHER, "ACK": FETCHER, "CANCEL": FETCHER,
        "CHUNK": SENDER, "TEXT": SENDER, "END": SENDER, "ERROR": SENDER}


def test_the_same_rule_gives_the_same_verdict_to_either_end():
    # the fetcher's copy and the sender's of one request, fed the same messages: each message
    # is outgoing at the end whose side of the request sends it, incoming at the other
    fetcher, sender = Requests(mine=True), Requests(mine=False)
    for msg in [Fetch(0, KEYS, 100, []), Chunk.of(0, 0, "high", b"a"), Text(0, 1, [1])]:
        by_fetcher = RULES[type(msg)].by == FETCHER
        assert apply(msg, fetcher, by_fetcher, NOW) == DELIVER
        assert apply(msg, sender, not by_fetcher, NOW) == DELIVER
    assert fetcher.open[0].done == sender.open[0].done == {0, 1}
    assert fetcher.open[0].deadline_at == sender.open[0].deadline_at == NOW + 0.1


# -- a request's course ------------------------------------------------------------------------


def test_a_whole_request_ends_complete_on_both_sides():
    c, s = ready_pair()
    req = fetch(c, s)
    s.send(Chunk.of(req, 0, "high", b"a"), NOW)
    s.send(Text(req, 1, [1, 2]), NOW)
    s.send(Chunk.of(req, 2, "fast", b"c"), NOW)
    s.send(End(req, "ok", False), NOW)
    evs = deliver(s, c)
    assert [type(e) for e in evs] == [ChunkReceived] * 3 + [EndReceived]
    assert [e.msg.i for e in evs[:3]] == [0, 1, 2] and evs[-1].complete
    assert c.fetching == {} and s.serving == {}


def test_chunks_may_come_in_any_order():
    c, s = ready_pair()
    req = fetch(c, s)
    send_chunks(c, s, req, [2, 0, 1])
    s.send(End(req, "ok", False), NOW)
    assert [type(e) for e in deliver(s, c)] == [EndReceived]


def test_either_side_may_fetch_and_each_direction_keeps_its_own_req_sequence():
    c, s = ready_pair()
    assert fetch(c, s) == 0
    req = s.next_request_id()
    s.send(Fetch(req, [b"x" * 32], 100, []), NOW)  # the sender fetches back, also from req 0
    assert [type(e) for e in deliver(s, c)] == [FetchReceived] and req == 0
    c.send(Text(req, 0, [9]), NOW)
    c.send(End(req, "ok", False), NOW)
    assert [type(e) for e in deliver(c, s)] == [ChunkReceived, EndReceived]
    assert list(c.fetching) == list(s.serving) == [0]  # c's own fetch 0 is still open
    assert c.serving == {} and s.fetching == {}


# -- ACK -----------------------------------------------------------------------------------------


def test_every_chunk_is_acked_on_receipt_with_its_frames_wire_size():
    c, s = ready_pair()
    req = fetch(c, s)
    sizes = [s.send(Chunk.of(req, 0, "high", b"a" * 1000), NOW), s.send(Text(req, 1, [5, 6]), NOW)]
    evs = deliver(s, c)
    assert [e.wire_bytes for e in evs] == sizes
    assert wire(c.data_to_send()) == [{"t": "ACK", "req": req, "i": 0, "recv_bytes": sizes[0]},
                                       {"t": "ACK", "req": req, "i": 1, "recv_bytes": sizes[1]}]


def test_the_sender_gets_an_event_per_ack():
    c, s = ready_pair()
    req = fetch(c, s)
    size = s.send(Chunk.of(req, 0, "high", b"a"), NOW)
    deliver(s, c)
    assert deliver(c, s) == [AckReceived(Ack(req, 0, size))]


def test_the_application_cannot_send_an_ack():
    c, s = ready_pair()
    req = fetch(c, s)
    s.send(Chunk.of(req, 0, "high", b"a"), NOW)
    deliver(s, c)
    c.data_to_send()
    with pytest.raises(LocalProtocolError, match="sent by the connection") as e:
        c.send(Ack(req, 0, 5), NOW)
    assert e.value.code == UNEXPECTED_MESSAGE and c.data_to_send() == b""


@pytest.mark.parametrize("ack, what", [(Ack(0, 1, 5), "not sent"), (Ack(4, 0, 5), "never fetched")])
def test_an_ack_must_name_a_chunk_sent_of_a_request_fetched(ack, what):
    c, s = ready_pair()
    req = fetch(c, s)
    s.send(Chunk.of(req, 0, "high", b"a"), NOW)
    s.receive_data(frame(ack), NOW)
    assert what in closed_with_bad_request(s)


def test_acks_that_cross_the_end_are_still_delivered():
    c, s = ready_pair()
    req = fetch(c, s, keys=[b"k" * 32])
    size = s.send(Text(req, 0, [1]), NOW)
    s.send(End(req, "ok", False), NOW)
    assert s.serving == {}
    s.receive_data(frame(Ack(req, 0, size)), NOW)
    assert events(s) == [AckReceived(Ack(req, 0, size))] and s.state is State.READY


# -- CANCEL ------------------------------------------------------------------------------------


def test_cancel_reaches_the_sender_which_ends_the_request_cancelled():
    c, s = ready_pair()
    req = fetch(c, s)
    c.send(Cancel(req), NOW)
    assert deliver(c, s) == [CancelReceived(Cancel(req))]
    assert s.end_request(req, NOW) == End(req, "cancelled", False)
    assert deliver(s, c) == [EndReceived(End(req, "cancelled", False))]
    assert c.fetching == {} and s.serving == {}


def test_after_cancel_the_fetcher_drops_chunks_unchecked_and_unacked():
    c, s = ready_pair()
    req = fetch(c, s)
    c.send(Cancel(req), NOW)
    c.data_to_send()
    # in flight when the CANCEL left: even a repeat or an index out of range is just dropped
    c.receive_data(frame(Chunk.of(req, 0, "high", b"a")) + frame(Chunk.of(req, 0, "high", b"a"))
                   + frame(Text(req, 9, [1])), NOW)
    assert events(c) == [] and c.data_to_send() == b"" and c.state is State.READY
    assert c.buffered_bytes == 0


def test_the_sender_may_finish_a_chunk_after_cancel_and_an_end_ok_crossing_it_is_accepted():
    c, s = ready_pair()
    req = fetch(c, s)
    c.send(Cancel(req), NOW)
    for i in range(3):
        s.send(Chunk.of(req, i, "high", b"a"), NOW)  # the sender has not seen the CANCEL yet
    s.send(End(req, "ok", False), NOW)
    # the fetcher stopped counting at its CANCEL, so END ok cannot be held against the count
    assert deliver(s, c) == [EndReceived(End(req, "ok", False))] and c.state is State.READY
    assert deliver(c, s) == [] and s.state is State.READY  # the CANCEL, late: ignored


def test_a_cancel_that_crosses_the_end_is_ignored_but_one_sent_after_it_is_refused():
    c, s = ready_pair()
    req = _ended(c, s)
    s.receive_data(frame(Cancel(req)), NOW)
    assert events(s) == [] and s.state is State.READY and s.data_to_send() == b""
    with pytest.raises(LocalProtocolError, match="not an open FETCH of this side"):
        c.send(Cancel(req), NOW)  # the fetcher has seen the END: its CANCEL crossed nothing


def test_apply_says_drop_for_what_is_dropped():
    fetcher = Requests(mine=True)
    apply(Fetch(0, KEYS, 100, []), fetcher, True, NOW)
    apply(Cancel(0), fetcher, True, NOW)
    assert apply(Chunk.of(0, 0, "high", b"a"), fetcher, False, NOW) == DROP
    sender = Requests(mine=False)
    apply(Fetch(0, [b"k"], 100, []), sender, False, NOW)
    apply(Text(0, 0, [1]), sender, True, NOW)
    apply(End(0, "ok", False), sender, True, NOW)
    assert apply(Cancel(0), sender, False, NOW) == DROP
    assert apply(Ack(0, 0, 9), sender, False, NOW) == DELIVER


# -- request ERROR ---------------------------------------------------------------------------


def test_a_request_error_ends_only_that_request_on_both_sides():
    c, s = ready_pair()
    first, second = fetch(c, s), fetch(c, s)
    s.send(Error("not_found", "no k1", first), NOW)
    assert deliver(s, c) == [ErrorReceived(Error("not_found", "no k1", first))]
    assert list(c.fetching) == list(s.serving) == [second]
    assert c.state is s.state is State.READY
    send_chunks(c, s, second, range(3))
    s.send(End(second, "ok", False), NOW)
    assert [type(e) for e in deliver(s, c)] == [EndReceived]


def test_a_connection_error_is_not_a_request_message():
    c, s = ready_pair()
    with pytest.raises(LocalProtocolError, match="use close"):
        c.send(Error("normal", "bye"), NOW)


# -- how a sender's request ends -----------------------------------------------------------------


def test_end_request_sends_end_ok_once_every_chunk_is_out():
    c, s = ready_pair()
    req = fetch(c, s)
    send_chunks(c, s, req, range(3))
    assert s.end_request(req, NOW + 0.5) == End(req, "ok", False)
    assert deliver(s, c) == [EndReceived(End(req, "ok", False))]


def test_end_request_reports_a_missed_deadline():
    c, s = ready_pair()
    req = fetch(c, s, deadline_ms=200)
    send_chunks(c, s, req, range(3))
    assert s.end_request(req, NOW + 0.3) == End(req, "ok", True)


def test_end_request_is_an_error_when_chunks_are_missing():
    c, s = ready_pair()
    req = fetch(c, s)
    send_chunks(c, s, req, [0])
    msg = s.end_request(req, NOW)
    assert msg == Error(INTERNAL, "the sender stopped after 1 of 3 chunks", req)
    assert deliver(s, c) == [ErrorReceived(msg)] and c.fetching == {}


def test_end_request_is_an_error_carrying_the_failure():
    c, s = ready_pair()
    req = fetch(c, s)
    send_chunks(c, s, req, range(3))  # even complete: the sender says it failed
    assert s.end_request(req, NOW, failure="disk on fire") == Error(INTERNAL, "disk on fire", req)


def test_end_request_after_cancel_is_end_cancelled_whatever_the_sender_did():
    c, s = ready_pair()
    req = fetch(c, s, deadline_ms=100)
    c.send(Cancel(req), NOW)
    deliver(c, s)
    assert s.end_request(req, NOW + 1, failure="CancelledError") == End(req, "cancelled", True)


def test_end_request_does_nothing_for_a_request_already_over_or_a_closed_connection():
    c, s = ready_pair()
    req = fetch(c, s)
    s.send(Error("not_found", "gone", req), NOW)
    s.data_to_send()
    assert s.end_request(req, NOW) is None and s.data_to_send() == b""
    other = fetch(c, s)
    s.close()
    s.data_to_send()
    assert s.end_request(other, NOW) is None and s.data_to_send() == b""


# -- the receive buffer ------------------------------------------------------------------------


def test_received_chunks_count_as_buffered_until_taken():
    c, s = ready_pair()
    req = fetch(c, s)
    s.send(Chunk.of(req, 0, "high", b"a" * 100), NOW)
    s.send(Text(req, 1, [1, 2, 3]), NOW)
    evs = deliver(s, c)
    text = frames.text_wire_bytes([1, 2, 3], req, 1)  # its whole frame: 31 bytes
    assert c.buffered_bytes == 100 + text == sum(held_bytes(e.msg) for e in evs)
    c.taken(evs[0].msg)
    assert c.buffered_bytes == text
    c.taken(evs[1].msg)
    assert c.buffered_bytes == 0


def test_reading_pauses_above_the_limit_and_resumes_at_half_of_it():
    c, s = ready_pair(max_buffered_bytes=250)
    req = fetch(c, s, keys=[b"k" * 32] * 4)
    for i in range(4):
        s.send(Chunk.of(req, i, "high", bytes(100)), NOW)
    evs = deliver(s, c)
    assert c.buffered_bytes == 400 and c.reading_paused
    c.taken(evs[0].msg)
    assert c.buffered_bytes == 300 and c.reading_paused  # still above half the limit
    c.taken(evs[1].msg)
    assert c.buffered_bytes == 200 and c.reading_paused
    c.taken(evs[2].msg)
    assert c.buffered_bytes == 100 and not c.reading_paused


def test_a_complete_fetch_keeps_its_chunks_buffered_until_taken():
    c, s = ready_pair()
    req = fetch(c, s, keys=[b"k" * 32])
    s.send(Chunk.of(req, 0, "high", bytes(50)), NOW)
    s.send(End(req, "ok", False), NOW)
    chunk, _ = deliver(s, c)
    assert c.fetching == {} and c.buffered_bytes == 50
    c.taken(chunk.msg)
    assert c.buffered_bytes == 0


@pytest.mark.parametrize("ending", ["error", "end not ok", "cancel", "close"])
def test_a_fetch_that_fails_releases_what_it_buffered(ending):
    c, s = ready_pair(max_buffered_bytes=50)
    req = fetch(c, s)
    keep = fetch(c, s, keys=[b"k" * 32])
    s.send(Chunk.of(req, 0, "high", bytes(100)), NOW)
    s.send(Chunk.of(keep, 0, "high", bytes(10)), NOW)
    got = deliver(s, c)
    assert c.buffered_bytes == 110 and c.reading_paused
    if ending == "error":
        s.send(Error(INTERNAL, "x", req), NOW)
        deliver(s, c)
    elif ending == "end not ok":
        s.receive_data(frame(Cancel(req)), NOW)  # so the sender may end it early
        s.send(End(req, "cancelled", False), NOW)
        deliver(s, c)
    elif ending == "cancel":
        c.send(Cancel(req), NOW)
    else:
        c.close()
    assert c.buffered_bytes == (0 if ending == "close" else 10) and not c.reading_paused
    c.taken(got[0].msg)  # the application may still hand back what it had: a no-op
    assert c.buffered_bytes == (0 if ending == "close" else 10)


def test_the_buffer_without_a_limit_never_pauses():
    buf = ReceiveBuffer(None)
    buf.hold(Chunk.of(0, 0, "high", bytes(10**6)))
    assert buf.total == 10**6 and not buf.paused
