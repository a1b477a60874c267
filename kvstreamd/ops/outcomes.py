"""The record of what each fetch came to (its arm, time, deadline, levels, bytes), kept for the
A/B report: the latest MAX_RECORDS in memory, and as JSON lines in the store directory
(bounded: one rotated file) so that a restart keeps the experiment's history."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstreamd.config import Config
from kvstreamd.features import Feature, FetchEnded

log = logging.getLogger(__name__)

FILE_NAME = "ab-fetches.jsonl"
# In memory, and what a restart reads back. The file takes MAX_RECORDS lines (~200 bytes each)
# before it becomes FILE_NAME.1 (the one before that is dropped), so the two together hold at
# least the latest MAX_RECORDS and at most twice that (~8 MB).
MAX_RECORDS = 20_000


@dataclass(frozen=True)
class Outcome:
    """One fetch that found some of its prompt, as it ended."""

    t: float  # unix time it ended
    arm: str  # "control" or "candidate" (kvstreamd.experiment)
    experiment: str  # the experiment in force (Experiment.label): the report compares like with like
    seconds: float  # request to last chunk ready: what the model waited
    deadline_missed: bool
    levels: dict[str, int]  # chunks per level they landed at ("text" for recompute)
    bytes: int  # wire bytes received from peers
    found_tokens: int

    @classmethod
    def of(cls, t: float, arm: str, experiment: str, seconds: float, deadline_missed: bool,
           levels: list[str], nbytes: int, found_tokens: int) -> Outcome:
        return cls(round(t, 3), arm, experiment, round(seconds, 6), bool(deadline_missed),
                   dict(Counter(levels)), int(nbytes), int(found_tokens))

    @classmethod
    def from_json(cls, obj: dict) -> Outcome:
        """From a JSON line; ValueError naming what is wrong."""
        try:
            out = cls(float(obj["t"]), str(obj["arm"]), str(obj.get("experiment", "")), float(obj["seconds"]),
                      bool(obj["deadline_missed"]), {str(k): int(v) for k, v in dict(obj["levels"]).items()},
                      int(obj["bytes"]), int(obj.get("found_tokens", 0)))
        except KeyError as e:
            raise ValueError(f"missing field {e.args[0]!r}") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(str(e)) from None
        return out


def read_lines(lines, where: str) -> list[Outcome]:
    """Outcomes from JSON lines; a line that is not one is skipped with a warning (a crash may
    leave the last line cut short)."""
    out, bad = [], 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(Outcome.from_json(json.loads(line)))
        except (ValueError, TypeError) as e:
            bad += 1
            if bad == 1:
                log.warning("%s line %d: not a fetch outcome (%s); skipped", where, n, e)
    if bad > 1:
        log.warning("%s: %d lines skipped in all", where, bad)
    return out


def read_file(path: Path) -> list[Outcome]:
    """Every outcome in a recorded log (JSON lines); OSError if it cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return read_lines(f, str(path))


class FetchOutcomes:
    """The latest outcomes, in memory and appended to `path` (None: memory only)."""

    def __init__(self, path: Path | None, max_records: int = MAX_RECORDS) -> None:
        self.path = path
        self.records: deque[Outcome] = deque(maxlen=max_records)
        self._lines = 0  # records in the file at `path`
        self._lock = threading.Lock()  # add() runs in worker threads: one rotation and append at a time
        self._write_failed = False
        if path is not None:
            for p in (path.with_name(path.name + ".1"), path):
                try:
                    got = read_file(p)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("%s: cannot read (%s); its outcomes are not in the A/B report", p, e)
                    continue
                self.records.extend(got)
                if p == path:
                    self._lines = len(got)  # (the rotated file's lines do not count towards the next rotation)

    def add(self, outcome: Outcome) -> None:
        """Blocking (a file append): from the event loop, call it in a thread."""
        with self._lock:
            self._add(outcome)

    def _add(self, outcome: Outcome) -> None:
        self.records.append(outcome)
        if self.path is None:
            return
        line = json.dumps(asdict(outcome), separators=(",", ":")) + "\n"
        try:
            if self._lines >= self.records.maxlen:
                self._lines = 0  # (also where the file went meanwhile: then nothing is rotated)
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            self._lines += 1
            self._write_failed = False
        except OSError as e:  # the fetch is served all the same; the record stays in memory
            if not self._write_failed:
                log.warning("%s: cannot append a fetch outcome (%s); kept in memory only", self.path, e)
            self._write_failed = True

    def as_json(self) -> list[dict]:
        with self._lock:  # (not while a worker thread appends)
            records = list(self.records)
        return [asdict(r) for r in records]


class OutcomeLog(Feature):
    """What each fetch that found something came to, with its A/B arm, for GET /v1/ab and
    `kvstreamd ab report`: kept in the store dir's FILE_NAME (in memory without one)."""

    name = "ab"
    in_status = False  # GET /v1/ab shows it, not /v1/status

    def __init__(self, cfg: Config) -> None:
        self.experiment = cfg.policy.experiment
        self.records = FetchOutcomes(cfg.store.dir / FILE_NAME if cfg.store.dir else None)

    def reconfigure(self, cfg: Config) -> None:
        self.experiment = cfg.policy.experiment

    async def fetch_ended(self, ended: FetchEnded) -> None:
        if ended.found_tokens:
            await asyncio.to_thread(self.records.add, Outcome.of(
                time.time(), ended.arm, ended.experiment, ended.seconds, ended.deadline_missed, ended.levels,
                ended.bytes, ended.found_tokens))

    def report(self) -> dict:
        """The experiment in force and the latest outcomes, oldest first."""
        return {"experiment": self.experiment.describe(), "outcomes": self.records.as_json()}
