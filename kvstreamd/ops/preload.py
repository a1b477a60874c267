"""`kvstreamd preload`: prefill text documents with the model, in this process, and store them
in a running daemon at every level, pinned (so that its eviction passes them over).

A document the daemon holds whole already (its chunk keys, asked through the lookup API) is not
prefilled again, only pinned: that is how pins come back after a restart, when the daemon runs
this for [store] preload. Each document's outcome is one JSON line on stdout; a progress bar
goes to stderr when it is a terminal.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from kvstreamd.client import Client, ClientError


@dataclass
class Outcome:
    """What became of one document."""
    path: str
    outcome: str  # "stored" (prefilled and put), "held" (stored already: pinned only), "failed"
    tokens: int = 0
    chunks: int = 0  # chunks of the context
    stored_chunks: int = 0  # chunks this run stored
    pinned: int = 0  # payload bytes newly pinned
    seconds: float = 0.0
    error: str | None = None  # why it failed


def documents(paths: Iterable[str | Path]) -> tuple[list[Path], list[Outcome]]:
    """The documents named: files as given, and every *.txt file directly in a folder (sorted by
    name); and a failed Outcome for each path that is neither (missing, or a folder with none)."""
    docs: list[Path] = []
    bad: list[Outcome] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix == ".txt" and q.is_file())
            docs += found
            if not found:
                bad.append(Outcome(str(p), "failed", error=f"{p}: a folder with no *.txt files"))
        elif p.is_file():
            docs.append(p)
        else:
            why = "not a regular file" if p.exists() else "no such file or folder"
            bad.append(Outcome(str(p), "failed", error=f"{p}: {why}"))
    return docs, bad


def preload_one(client: Client, lm, path: Path) -> Outcome:
    """Store one document pinned (prefilling it only when the daemon does not hold it whole)."""
    from kvstreamd.models.put import put_context

    t0 = time.perf_counter()
    try:
        tokens = lm.tokenizer.document(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return Outcome(str(path), "failed", error=f"{path}: cannot read it as UTF-8 text: {e}")
    if not tokens:
        return Outcome(str(path), "failed", error=f"{path}: no tokens (an empty document)")
    out = Outcome(str(path), "held", len(tokens))
    try:
        if client.lookup(lm.model_id, tokens)["local_tokens"] >= len(tokens):
            reply = client.pin(lm.model_id, tokens)
            out.chunks = reply["chunks"]
        else:
            reply = put_context(lm, client, tokens, pin=True)
            out.outcome, out.chunks, out.stored_chunks = "stored", len(reply["keys"]), reply["stored_chunks"]
        out.pinned = reply["pinned"]
    except ClientError as e:
        out.outcome, out.error = "failed", f"{path}: {e}"
    out.seconds = round(time.perf_counter() - t0, 3)
    return out


def run(paths: list[str], model: str | None, client: Client, progress: bool = True,
        emit: Callable[[str], None] = print) -> list[Outcome]:
    """Preload every document named (see `documents`), one after another; emit each outcome as a
    JSON line, the paths that name no document first (before the model loads)."""
    from tqdm import tqdm

    from kvstreamd import models

    docs, outcomes = documents(paths)
    for o in outcomes:
        emit(json.dumps(asdict(o)))
    if not docs:
        return outcomes
    client.health()  # a daemon that is not there fails here (ClientError), before the model loads
    lm = models.load(model)
    with tqdm(docs, desc="preload", unit="doc", disable=not (progress and sys.stderr.isatty())) as bar:
        for path in bar:
            bar.set_postfix_str(path.name)
            o = preload_one(client, lm, path)
            outcomes.append(o)
            emit(json.dumps(asdict(o)))
    return outcomes
