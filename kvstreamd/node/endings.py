"""How a peer's part of a fetch can end before its END, as one table: for each way (what was
raised, and when), the fetch's error it makes, what becomes of the peer's chunks, what is logged
and counted, and whether the peer cools down or may be asked again (node/from_peers.py applies
it). Matched in order: the first row whose type and condition fit is the ending."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from transport import aio
from transport.messages import BAD_CRC, NOT_FOUND

from kvstreamd.cluster.admission import Refused


@dataclass(frozen=True)
class Ending:
    raised: type[Exception]
    # the fetch's error (End.errors), formatted with peer, chunk (where it stopped), e and cooldown
    says: str
    then: str  # what becomes of the peer's chunks, logged after `says`
    log_level: int
    metric: str | None  # the error kind counted (Metrics.error), formatted with e; None: none
    recorded: bool = True  # in the fetch's errors
    cools: bool = False  # left out of lookups for a cooldown (Directory.cool_down)
    # the chunk is taken off the peer's holdings and its share goes back to the others; the peer
    # may still be asked for the rest
    drops_chunk: bool = False
    when: Callable[[Exception], bool] = lambda e: True

    @property
    def asked_again(self) -> bool:
        """The peer may be asked for more of this fetch's chunks."""
        return self.drops_chunk


OTHERS = "the rest comes from another peer or as text"

ENDINGS: tuple[Ending, ...] = (
    # a chunk that is not the one asked (admission): not trusted for the rest of this fetch
    Ending(Refused, "peer {peer} sent chunk {chunk} that is not the chunk asked: {e}",
           "it and the rest come from another peer or as text", logging.WARNING, "chunk_refused_{e.reason}"),
    Ending(aio.FetchStalled, "peer {peer} stalled at chunk {chunk}: {e.msg}; it is avoided for {cooldown:g} s",
           OTHERS, logging.WARNING, "peer_stalled", cools=True),
    # still sending, only too slowly for this fetch: not marked; its chunks come as text
    Ending(aio.FetchTimedOut, "peer {peer}: chunk {chunk} not in by the fetch's wait + grace",
           "the rest comes as text", logging.INFO, None, recorded=False),
    # The holder lost that chunk (evicted or damaged: its WITHDRAW follows) after it advertised
    # it, or holds it at levels not asked: it sent the chunks before it and may still serve the
    # others; only that one looks elsewhere.
    Ending(aio.FetchFailed, "peer {peer} no longer holds chunk {chunk}: {e.msg}",
           "that chunk comes from another peer or as text", logging.INFO, None, drops_chunk=True,
           when=lambda e: e.code == NOT_FOUND),
    Ending(aio.FetchFailed, "peer {peer} failed at chunk {chunk}: {e.code}: {e.msg}", OTHERS, logging.WARNING,
           "peer_fetch_failed"),
    # a chunk damaged on the wire closes the connection (bad_crc): a damaged chunk, counted so
    Ending(aio.TransportError, "peer {peer} failed at chunk {chunk}: {e.code}: {e.msg}", OTHERS, logging.WARNING,
           "chunk_bad_crc", when=lambda e: e.code == BAD_CRC),
    Ending(aio.TransportError, "peer {peer} failed at chunk {chunk}: {e.code}: {e.msg}", OTHERS, logging.WARNING,
           "peer_fetch_failed"),
)


def ending_of(e: Exception) -> Ending:
    """The row of ENDINGS for `e` (a TransportError or Refused)."""
    return next(end for end in ENDINGS if isinstance(e, end.raised) and end.when(e))
