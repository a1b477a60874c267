"""The shape of a node's features: health, the A/B outcome log, predictive prefetch and preload
are each a `Feature`. The node tells every feature the same things (a fetch began, a fetch
ended, work on a fetch's behalf began, the configuration was reloaded) and shows what each
says under its name in /v1/status; it knows none of them by type. A new feature is its own
module, one line in node/daemon.py's `features()`, and its keys in the config schema."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

from kvstreamd.config import Config


@dataclass(frozen=True)
class FetchBegan:
    """A fetch of the local API was planned and is about to run."""

    model_id: str
    tokens: Sequence[int]
    plan: Any  # node.fetch.Plan: keys, bounds, and where chunks [0, found) come from
    task: asyncio.Future  # the fetch; done when it ends


@dataclass(frozen=True)
class FetchEnded:
    """A fetch of the local API ended (its End event is next)."""

    model_id: str
    arm: str  # experiment.CONTROL or CANDIDATE
    experiment: str  # the experiment's label
    seconds: float  # from its arrival to its last chunk
    decode_s: float  # of it, the decode stage's busy time
    deadline_missed: bool
    levels: list[str]  # each chunk's, "text" for a recomputed one
    bytes: int  # wire bytes of the chunks that came
    found_tokens: int  # the prefix it found (0: a miss)


class Feature:
    """A part of the node that watches its fetches. Every hook is optional."""

    name = ""  # its name, and its key in /v1/status
    in_status = True  # /v1/status shows status() under `name`

    async def start(self) -> None:
        """The node serves its API (a feature may use it from here on)."""

    async def stop(self) -> None:
        """The node is stopping; fetches are cancelled already."""

    def reconfigure(self, cfg: Config) -> None:
        """SIGHUP loaded `cfg`: apply its reloadable keys."""

    def status(self) -> dict | None:
        """This feature's section of /v1/status."""
        return None

    def degraded(self) -> list[dict]:
        """What this feature finds the node cannot do in full now: {"reason", "message"} each,
        reasons from metrics.DEGRADED (/healthz, /v1/status and kvstreamd_degraded show them)."""
        return []

    def fetch_began(self, began: FetchBegan) -> None:
        """A fetch is about to run."""

    def node_busy(self, task: asyncio.Future) -> None:
        """The node began work on a fetch's behalf that uses links or the store (storing the
        chunks it brought), done when `task` is."""

    async def fetch_ended(self, ended: FetchEnded) -> None:
        """A fetch ended; its client hears the End once every feature has returned."""
