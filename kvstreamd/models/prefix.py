"""Generate with a prompt, reusing whatever prefix the cluster holds: the drop-in for a
HuggingFace-transformers model (any decoder whose cache is a `DynamicCache` of `[1, H, T, D]`
layers, keys post-RoPE: Llama, Qwen, Mistral, Gemma; a hybrid model's sliding layers get
their window of the prefix only, as its own cache holds them).

    from kvstreamd.client import Client
    from kvstreamd.models.prefix import generate
    new_tokens, reuse = generate(model, prompt_ids, Client(), model_id, max_new_tokens=64)

It asks the local daemon for the prompt's longest cached prefix, lets the daemon stream it into
shared memory, recomputes TEXT chunks on top of the chunks before them, and hands the cache to
`model.generate`, which prefills only the rest of the prompt.

TEXT chunks are recomputed while the rest streams in, not after it (`_Recompute`): where the
sender's plan gives the prompt's head as TEXT and its tail as KV (a slow link, where computing
the head here beats waiting for its bytes), this process prefills the head from its tokens while
the tail's KV arrives. The tail's KV needs nothing from this side -- the sender computed it on
the whole prefix -- so the two join exactly: the head bit for bit as a prefill here would make
it, the tail up to its level's coding error."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from codec.layout import PrefixKV
from transport.policy import text_seconds

from ..client import ChunkEvent, Client
from ..events import End
from .adapter import cache_from_kv, empty_cache, generate_cache_kwarg, run
from .host_memory import Recycled


@dataclass
class Reuse:
    """What one prompt got from the cluster."""

    prompt_tokens: int
    found_tokens: int = 0  # the prefix held somewhere (KV or TEXT chunks)
    kv_tokens: int = 0  # of which arrived as KV
    text_tokens: int = 0  # of which this process recomputed (TEXT chunks)
    text_ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each, in prompt order
    text_blocks: list[tuple[int, int]] = field(default_factory=list)  # the passes they were recomputed in
    events: list[ChunkEvent] = field(default_factory=list)
    seen_s: list[float] = field(default_factory=list)  # when this process read each event, from the request
    end: End | None = None  # the daemon's end event (timings, levels, bytes, errors)
    end_seen_s: float | None = None  # when it read the end event, from the request
    fetch_s: float = 0.0  # from the request to the last chunk in the buffer
    recompute_s: float = 0.0  # TEXT chunks, run here (while the fetch streams the rest)
    recompute_after_s: float = 0.0  # of it, the seconds after the fetch's last chunk: what the stream did not hide
    ttft_s: float | None = None  # prompt in -> first generated token (set by generate)
    kv: PrefixKV | None = None  # the prefix KV used, when generate(keep_kv=True)
    cache_s: float = 0.0  # building the model's cache from the fetched KV
    # the prefill rate told the senders: the caller's, over how much slower this process's heads
    # have run inside fetches than it predicts (HEAD_PACE); None where the caller gave none
    recompute_tokens_per_s_told: float | None = None

    @property
    def levels(self) -> list[str]:
        """Each chunk's level, in prompt order (the events come as the chunks land)."""
        return [e.level for e in sorted(self.events, key=lambda e: e.i)]

    errors: list[str] = field(default_factory=list)  # why some of what was found was not used

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.events if e.source not in ("local", "fallback"))


# A TEXT chunk waits this long for the next one, to run in one pass with it. A head's TEXT
# chunks come a millisecond or two apart (the sender decides each and sends a few bytes), and one
# pass is faster than a pass per chunk: 1536 SmolLM2 tokens in 2.9-3.2 s against 4.1-4.2 s as six
# 256-token passes (two cores), as the prompt's own prefill runs in blocks of PREFILL_BLOCK.
GATHER_S = 0.005


class _Recompute:
    """TEXT chunks recomputed in prompt order on a thread of their own, while the fetch goes on
    (torch releases the GIL in its kernels, so the model runs beside the event loop's copying).
    Each chunk runs on top of every token before it: TEXT chunks that follow on from each other
    run as one pass where they come together (GATHER_S), and consecutive passes extend one
    running cache, as a prefill in blocks would (bit for bit the KV a prefill here in the same
    blocks makes: `blocks`); a TEXT chunk after KV chunks starts a cache from what `kv` holds
    before it, which the fetch has filled by then (a TEXT event comes after every chunk before
    it, whatever order KV events come in, and each KV chunk is copied before the next event is
    read)."""

    def __init__(self, model, prompt: list[int], kv: PrefixKV, dtype: torch.dtype) -> None:
        self.model, self.prompt, self.kv, self.dtype = model, prompt, kv, dtype
        self.error: str | None = None  # why the recompute gave up (the prompt is then prefilled whole)
        self.busy_s = 0.0
        self.ranges: list[tuple[int, int]] = []  # each TEXT chunk done
        self.blocks: list[tuple[int, int]] = []  # the passes they ran in
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvstreamd-recompute", daemon=True)
        self._thread.start()

    def add(self, start: int, end: int) -> None:
        self._queue.put((start, end))

    def finish(self, cancel: bool = False) -> None:
        """Wait for every chunk added (or, with `cancel`, only the one running) to be done."""
        self._stop = cancel
        self._queue.put(None)
        self._thread.join()

    def _gather(self, first: tuple[int, int]) -> tuple[list[tuple[int, int]], object]:
        """`first` and the chunks that follow on from it as they come (each within GATHER_S of
        the last); returns them and what came after them: a chunk that does not follow on, the
        end (None), or nothing yet (False)."""
        chunks = [first]
        while not self._stop:
            try:
                nxt = self._queue.get(timeout=GATHER_S)
            except queue.Empty:
                return chunks, False
            if nxt is None or nxt[0] != chunks[-1][1]:
                return chunks, nxt
            chunks.append(nxt)
        return chunks, False

    def _run(self) -> None:
        cache, at = None, -1  # the running cache, and the token it ends at
        after: object = False  # an item _gather took that is not part of its pass
        with torch.no_grad():  # grad mode is per thread
            while True:
                item = after if after is not False else self._queue.get()
                after = False
                if item is None:
                    break
                if self._stop or self.error is not None:
                    continue
                chunks, after = self._gather(item)
                if self._stop:
                    continue
                start, end = chunks[0][0], chunks[-1][1]
                t0 = time.perf_counter()
                try:
                    if at != start:
                        cache = empty_cache(self.model.config) if start == 0 else \
                            cache_from_kv(self.kv.prefix(start), self.dtype, self.model.config)
                except ValueError as e:
                    # A hybrid model's sliding layers were fetched for the prefix's last window only:
                    # a TEXT chunk after KV chunks and before that window cannot run on them.
                    self.error = f"chunk at {start} came as text outside the sliding window ({e})"
                    continue
                try:
                    _, new = run(self.model, torch.tensor(self.prompt[start:end]), cache, all_logits=False,
                                 keep_kv=True)
                except Exception as e:  # noqa: BLE001 -- said in reuse.errors; the prompt is then prefilled whole
                    self.error = f"recomputing the chunk at {start} failed ({type(e).__name__}: {e})"
                    continue
                at = end
                for part in self.kv.parts:  # new holds every layer of the chunks; each part takes its layers' tokens
                    if part.start < end:
                        lo = max(start, part.start)
                        part.kv[:, :, lo - part.start:end - part.start] = new[list(part.layers), :, lo - start:]
                self.ranges.extend(chunks)
                self.blocks.append((start, end))
                self.busy_s += time.perf_counter() - t0


class HeadPace:
    """How much slower this process's TEXT heads run inside a fetch than the prefill rate its
    caller gives predicts (transport.policy.text_seconds), per model, learned from every fetch
    that brought TEXT: a head shares the CPU with the daemon's receiving and decoding of the
    tail. The rate told the senders is the caller's divided by it, so a sender plans a head that
    ends as the tail's KV does. On two cores (bench e2e, 20 Mbit/s, host a's prefill fitting
    541-563 tokens/s): 1536-token heads took 4.75-4.85 s where that rate predicts 3.5 s, and the
    head ended 1.1-1.3 s after the last KV chunk."""

    ALPHA = 0.5  # weight of the newest fetch
    BOUNDS = (0.5, 4.0)  # what one fetch may say: outside it, something else held the head up

    def __init__(self) -> None:
        self._slowdown: dict[str, float] = {}

    def slowdown(self, model_id: str) -> float:
        return self._slowdown.get(model_id, 1.0)

    def told(self, model_id: str, tokens_per_s: float | None) -> float | None:
        """The rate to tell senders for a caller's `tokens_per_s` (None: none, the daemon's)."""
        return None if tokens_per_s is None else tokens_per_s / self.slowdown(model_id)

    def learn(self, model_id: str, ranges: list[tuple[int, int]], seconds: float, tokens_per_s: float | None,
              doubling: float | None) -> None:
        """One fetch's TEXT: its [start, end) ranges took `seconds` here; the caller's rate."""
        if tokens_per_s is None or not ranges or seconds <= 0:
            return
        predicted = sum(text_seconds(e - s, s, tokens_per_s, doubling) for s, e in ranges)
        ratio = min(max(seconds / predicted, self.BOUNDS[0]), self.BOUNDS[1])
        before = self._slowdown.get(model_id)
        self._slowdown[model_id] = ratio if before is None else (1 - self.ALPHA) * before + self.ALPHA * ratio


HEAD_PACE = HeadPace()  # this process's
HOST_MEMORY = Recycled()  # what this process's fetched KV is copied into, reused fetch after fetch


@torch.no_grad()
def prefix_kv(model, prompt: list[int], client: Client, model_id: str, *, deadline_ms: int | None = None,
              levels: list[str] | None = None, recompute_tokens_per_s: float | None = None,
              on_chunk: Callable[[ChunkEvent], None] | None = None,
              recompute_doubling_tokens: float | None = None, grow_to: int = 0) -> tuple[PrefixKV | None, Reuse]:
    """The KV (the model's dtype; codec.layout.PrefixKV, `.dense()` is `[L, 2, n, H, D]` for a
    model whose layers all hold every token) of the prompt's longest prefix the cluster holds,
    TEXT chunks recomputed here as they come (while the rest streams), and what it took;
    (None, reuse) when nothing was found. `recompute_tokens_per_s` (this model's prefill rate at
    the start of a prompt) and `recompute_doubling_tokens` (the position where a token costs it
    twice that) let the senders price TEXT chunks (Client.fetch), the rate as HEAD_PACE corrects it.
    `grow_to`: the tokens the caller's sequence will reach (prompt and answer): the KV leaves
    room for those after the prefix (Part.room), where the model's cache writes them in place."""
    reuse = Reuse(len(prompt))
    reuse.recompute_tokens_per_s_told = told = HEAD_PACE.told(model_id, recompute_tokens_per_s)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    t0 = time.perf_counter()
    recompute: _Recompute | None = None
    # A model on a GPU asks for the KV in device memory (the daemon decodes it on its GPU and
    # hands it over by CUDA IPC, or says why not and uses shared memory).
    try:
        with client.fetch(model_id, prompt, deadline_ms=deadline_ms, levels=levels, recompute_tokens_per_s=told,
                          device="cuda" if device.type == "cuda" else "cpu",
                          recompute_doubling_tokens=recompute_doubling_tokens, order="landed") as f:
            # A copy, always (even in the same dtype and device): the buffer is released on exit. Laid
            # out heads-first, as the model's cache holds it, so that generate() need not copy it again;
            # each chunk is copied out as it lands, while the next ones stream in, on this thread
            # alone (the daemon's codec workers need the cores meanwhile: layout.copy_serial_), KV
            # chunks in the order they land (an int8 chunk is copied while the `high` chunks sent
            # before it still decode, not after them).
            src = f.prefix
            kv = src.empty_heads_first(device=device, dtype=dtype, room=max(0, grow_to - src.tokens),
                                       empty=HOST_MEMORY.empty) if src is not None else None
            copied = np.zeros(src.tokens if src is not None else 0, bool)  # KV chunks, and TEXT ones (recompute's)
            for ev in f:
                reuse.events.append(ev)
                reuse.seen_s.append(time.perf_counter() - t0)
                if kv is not None and ev.kind == "kv":
                    kv.copy_tokens_(src, ev.start, ev.end, serial=True)
                    copied[ev.start:ev.end] = True
                elif kv is not None and ev.kind == "text":
                    if recompute is None:
                        recompute = _Recompute(model, prompt, kv, dtype)
                    recompute.add(ev.start, ev.end)
                    copied[ev.start:ev.end] = True
                if on_chunk is not None:
                    on_chunk(ev)
            reuse.end = f.end
            reuse.end_seen_s = time.perf_counter() - t0
            reuse.found_tokens = f.found_tokens
            if kv is not None:  # what no chunk brought is the buffer's, as it stands
                for start, end in _runs(~copied):
                    kv.copy_tokens_(src, start, end)
            del src
    except BaseException:
        if recompute is not None:
            recompute.finish(cancel=True)
        raise
    reuse.fetch_s = time.perf_counter() - t0
    if recompute is not None:
        t1 = time.perf_counter()
        recompute.finish()
        reuse.recompute_after_s = time.perf_counter() - t1
        reuse.recompute_s = recompute.busy_s
        reuse.text_ranges = recompute.ranges
        reuse.text_blocks = recompute.blocks
        reuse.text_tokens = sum(e - s for s, e in recompute.ranges)
        if recompute.error is None:
            HEAD_PACE.learn(model_id, recompute.ranges, recompute.busy_s, recompute_tokens_per_s,
                            recompute_doubling_tokens)
        if recompute.error is not None:
            reuse.errors.append(f"{recompute.error}: the prompt is prefilled whole")
            reuse.found_tokens = reuse.kv_tokens = reuse.text_tokens = 0
            return None, reuse
    if kv is None:
        return None, reuse
    reuse.kv_tokens = reuse.found_tokens - reuse.text_tokens
    return kv, reuse


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


class _FirstToken:
    """A `generate` streamer that notes when the first new token comes out (its first put()
    is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


@torch.no_grad()
def generate(model, prompt: list[int], client: Client | None, model_id: str, *, max_new_tokens: int = 32,
             deadline_ms: int | None = None, levels: list[str] | None = None,
             recompute_tokens_per_s: float | None = None, on_chunk: Callable[[ChunkEvent], None] | None = None,
             keep_kv: bool = False, recompute_doubling_tokens: float | None = None,
             **generate_kwargs) -> tuple[list[int], Reuse]:
    """Greedy-generate after `prompt`, reusing the cluster's longest cached prefix of it
    (`client` None: no reuse, the whole prompt is prefilled here). Returns the new token ids and
    what was reused, with `ttft_s` from the call to the first new token."""
    t0 = time.perf_counter()
    kv, reuse = (None, Reuse(len(prompt))) if client is None else prefix_kv(
        model, prompt, client, model_id, deadline_ms=deadline_ms, levels=levels,
        recompute_tokens_per_s=recompute_tokens_per_s, on_chunk=on_chunk,
        recompute_doubling_tokens=recompute_doubling_tokens, grow_to=len(prompt) + max_new_tokens)
    kwargs = dict(generate_kwargs)
    if kv is not None:
        t1 = time.perf_counter()
        n = min(kv.tokens, len(prompt) - 1)  # generate needs one prompt token left to run
        # kv is this call's own copy, already in the cache's layout, with room for the rest of the
        # prompt and the answer: the cache holds it as it is and appends in place
        kwargs[generate_cache_kwarg()] = cache_from_kv(kv.prefix(n), next(model.parameters()).dtype, model.config,
                                                       copy=False)
        reuse.cache_s = time.perf_counter() - t1
    streamer = _FirstToken()
    out = model.generate(torch.tensor([prompt], device=next(model.parameters()).device), max_new_tokens=max_new_tokens, do_sample=False,
                         streamer=streamer, **kwargs)
    reuse.ttft_s = (streamer.at or time.perf_counter()) - t0
    if keep_kv:
        reuse.kv = kv
    return out[0, len(prompt):].tolist(), reuse

