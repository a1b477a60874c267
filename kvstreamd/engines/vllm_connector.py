"""kvstreamd as a vLLM KV connector (v1 API): a vLLM server loads a prompt's longest prefix that
the cluster holds from the local daemon, and puts the whole chunks of each prompt it computes.
The one module of kvstreamd that imports vLLM; load it with

    vllm serve MODEL_FOLDER --kv-transfer-config '{"kv_connector": "KvstreamdConnector",
        "kv_connector_module_path": "kvstreamd.engines.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"socket": "..."}}'

- Scheduler side: a lookup at the daemon, bounded by lookup_timeout_ms, names the prompt's
  longest held prefix (plan.tokens_to_load: whole chunks, short of the last prompt token). The
  load is asynchronous, so one request's transfer never holds up the batch: the worker fetches
  in a thread and reports the request finished through get_finished.
- Worker side: the fetched KV goes from the daemon's shared memory into vLLM's paged cache
  through the attention backend's own cache-write op. A chunk that came as TEXT, or a fetch that
  failed, makes its blocks and all after them load errors: vLLM recomputes from there.
- Save: once a request's prefill is done, its whole chunks are read out of the paged cache (by
  the layout paged.py probed at start-up) and put to the daemon from a thread, off the
  request's path; a prefix the daemon holds already is not put again.
- A daemon that is down, slow or restarting is a miss (the request is computed as if there were
  no connector), said in the log once per reason, never a failed request.
- Backends: only those tested with kvstreamd (TESTED_BACKENDS) are used; another is a miss for
  every request, said once. vLLM gives a prefix and then computed tokens, so the plan is a KV
  prefix then text. A model with sliding-window layers (Gemma-3) gets its sliding layers filled for
  the window before the loaded prefix's end only: vLLM reads no more of them.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from ..client import Client, ClientError
from . import plan
from .options import ConnectorOptions
from .paged import LayoutUnknown, PagedLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstreamd")  # under vLLM's logger: its handlers print it

# Attention implementations whose cache-write op and layout this connector was tested with.
TESTED_BACKENDS = ("CPUAttentionBackendImpl",)
SAVE_QUEUE = 4  # puts waiting for the daemon; a save past that is dropped (a later miss), said once
# A fetch whose daemon sends no event for this long failed (a daemon held up; one that dies closes
# the socket at once): its tokens are recomputed. The daemon itself gives up on a silent peer
# after [fetch] stall_s (2 s), so a live fetch is never this quiet.
FETCH_IDLE_S = 10.0


@dataclass
class LoadSpec:
    req_id: str
    tokens: list[int]  # the prefix to fetch (whole chunks)
    start: int  # tokens before this the engine computed itself: not written
    block_ids: list[int]


@dataclass
class SaveSpec:
    req_id: str
    tokens: list[int]  # the whole chunks to put
    block_ids: list[int]


@dataclass
class KvstreamdMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class _Once:
    """Log each reason once (a miss on every request is said once, not per request)."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def __call__(self, reason: str, msg: str, *args) -> None:
        if reason not in self._said:
            self._said.add(reason)
            log.warning(msg, *args)


@dataclass
class _Track:
    """A running request, as the scheduler side follows it for the save."""

    tokens: list[int]
    block_ids: list[int]
    held_locally: int = 0
    saved: bool = False  # its prefill is done: a save was decided on
    save_sent: bool = False  # a SaveSpec went to the worker: vLLM keeps its blocks until it is read


class KvstreamdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            raise ValueError('KvstreamdConnector needs "kv_load_failure_policy": "recompute" in --kv-transfer-config: '
                             "a chunk that fails on the way is recomputed, never a failed request")
        self.options = ConnectorOptions.parse(ktc.kv_connector_extra_config, vllm_config.model_config.model)
        self.block_size = vllm_config.cache_config.block_size
        self._once = _Once()
        # scheduler side
        self._chunk_tokens: int | None = None
        self._loads: dict[str, LoadSpec] = {}  # promised in get_num_new_matched_tokens, blocks set after alloc
        self._tracks: dict[str, _Track] = {}
        # requests whose load went to the worker: asked again, their load failed (vLLM recomputes
        # from the failed block), and they are not fetched again
        self._loading: set[str] = set()
        # vLLM gives a model with sliding-window layers one KV cache group (every layer a slot for
        # every token) when its connector does not handle several; several groups are not served
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        self._groups = len(groups)
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._layers: dict[str, Any] = {}
        self._layout: PagedLayout | None = None
        self._refused: str | None = None
        self._fetching: dict[str, threading.Thread] = {}
        self._fetched: queue.Queue = queue.Queue()  # (spec, fetch or None, why) from the fetch threads
        self._load_errors: set[int] = set()
        self._puts: queue.Queue = queue.Queue(maxsize=SAVE_QUEUE)
        self._putter: threading.Thread | None = None
        # saves whose blocks vLLM holds for the read: read out (or dropped), and finished on the worker
        self._saving: set[str] = set()
        self._read_out: set[str] = set()
        self._ended: set[str] = set()
        self._save_lock = threading.Lock()
        log.info("kvstreamd connector (%s): model %s, daemon socket %s", role.name, self.options.model_id,
                 self.options.socket or "the default")

    def _client(self, timeout_s: float) -> Client:
        return Client(self.options.socket, timeout=timeout_s)

    # == scheduler side ============================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id in self._loading:
            return 0, False  # its load failed: computed from there, not fetched twice
        tokens = list(request.prompt_token_ids or [])
        self._tracks[request.request_id] = _Track(tokens, [])
        if self._groups > 1:
            self._once("groups", "kvstreamd: vLLM keeps this model's KV in %d cache groups; the connector serves one: "
                       "every request is computed by vLLM", self._groups)
            return 0, False
        if not self._backend_ok():
            return 0, False
        held, local = self._lookup(tokens)
        self._tracks[request.request_id].held_locally = local
        if self._chunk_tokens is None:
            return 0, False
        n = plan.tokens_to_load(len(tokens), held, self._chunk_tokens, self.block_size, num_computed_tokens)
        if n == 0:
            return 0, False
        end = num_computed_tokens + n
        self._loads[request.request_id] = LoadSpec(request.request_id, tokens[:end], num_computed_tokens, [])
        # the local daemon holds what it fetched for this load (its [store] keep_fetched), or a peer
        # does: either way the prefix is not put again
        self._tracks[request.request_id].held_locally = max(local, end)
        return n, True

    def _backend_ok(self) -> bool:
        from vllm.platforms import current_platform
        if current_platform.device_type == "cpu":
            return True
        self._once("backend", "kvstreamd: vLLM on %s is not tested with kvstreamd (tested: the CPU backend); "
                   "every request is computed by vLLM", current_platform.device_type)
        return False

    def _lookup(self, tokens: list[int]) -> tuple[int, int]:
        """(tokens held in the cluster, tokens held by the local daemon) of the prompt's prefix;
        (0, 0) when the daemon does not answer within lookup_timeout_ms."""
        if self._chunk_tokens is not None and len(tokens) <= self._chunk_tokens:
            return 0, 0  # shorter than a chunk: nothing to load, no lookup
        try:
            client = self._client(self.options.lookup_timeout_ms / 1000)
            if self._chunk_tokens is None:
                self._chunk_tokens = int(client.status()["chunk_tokens"])
                if len(tokens) <= self._chunk_tokens:
                    return 0, 0
            reply = client.lookup(self.options.model_id, tokens[:-1])
        except (OSError, ClientError, ValueError, KeyError) as e:
            self._once(f"lookup:{type(e).__name__}", "kvstreamd: no lookup at the daemon (%s: %s): requests are "
                       "computed by vLLM until it answers", type(e).__name__, e)
            return 0, 0
        return int(reply.get("found_tokens", 0)), int(reply.get("local_tokens", 0))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        spec = self._loads.get(request.request_id)
        if spec is not None and num_external_tokens > 0 and not spec.block_ids:
            spec.block_ids = list(blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvstreamdMetadata()
        for req_id, spec in list(self._loads.items()):
            if spec.block_ids:
                meta.loads.append(spec)
                self._loading.add(req_id)
                del self._loads[req_id]
        if not self.options.save or self._chunk_tokens is None:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._tracks.get(new.req_id)
            if track is None:
                track = self._tracks[new.req_id] = _Track(list(new.prompt_token_ids or []), [])
            track.block_ids = list(new.block_ids[0])
            self._maybe_save(meta, new.req_id, track, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            track = self._tracks.get(req_id)
            if track is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    track.block_ids = list(new_blocks[0])  # a resumed request's whole list
                else:
                    track.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, req_id, track, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: KvstreamdMetadata, req_id: str, track: _Track, computed_after: int) -> None:
        if track.saved or computed_after < len(track.tokens):
            return
        track.saved = True  # its prefill ends in this step: the worker reads its KV after the forward
        n = plan.tokens_to_save(len(track.tokens), self._chunk_tokens, track.held_locally)
        if n and len(track.block_ids) * self.block_size >= n:
            meta.saves.append(SaveSpec(req_id, track.tokens[:n], track.block_ids[:-(-n // self.block_size)]))
            track.save_sent = True

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True while its save is being read out of its blocks: vLLM frees them once the worker
        reports it (get_finished), so a finished request's blocks are not reused under the read."""
        track = self._tracks.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._loading.discard(request.request_id)
        return bool(track is not None and track.save_sent), None

    # == worker side ===============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        # in the model's layer order (the daemon's KV is [layer, ...]): "model.layers.7.self_attn.attn" is layer 7
        self._caches = dict(sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0])))
        context = self._vllm_config.compilation_config.static_forward_context
        self._layers = {name: context[name] for name in self._caches if name in context}
        impls = {type(layer.impl).__name__ for layer in self._layers.values()}
        if not self._layers or not impls <= set(TESTED_BACKENDS):
            self._refused = f"attention backend {sorted(impls)} is not tested with kvstreamd (tested: {TESTED_BACKENDS})"
        else:
            name = next(iter(self._layers))
            layer, cache = self._layers[name], self._caches[name]
            heads, head_dim = layer.impl.num_kv_heads, layer.impl.head_size
            try:
                self._layout = PagedLayout.probe(cache, self._writer(name), self.block_size, heads, head_dim)
            except LayoutUnknown as e:
                self._refused = f"the paged cache's layout is unknown: {e}"
            if any(c.shape != cache.shape for c in self._caches.values()):
                self._refused = "the layers' paged caches differ in shape"
        if self._refused:
            log.warning("kvstreamd: %s; every request is computed by vLLM", self._refused)
        else:
            log.info("kvstreamd: paged cache layout probed (%d layers, block stride %d)", len(self._caches),
                     self._layout.block_stride)

    def _writer(self, name: str):
        layer, cache = self._layers[name], self._caches[name]

        def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
            layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
        return write

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for spec in meta.loads:
            t = threading.Thread(target=self._fetch, args=(spec,), name=f"kvstreamd-fetch-{spec.req_id}", daemon=True)
            self._fetching[spec.req_id] = t
            t.start()

    def _fetch(self, spec: LoadSpec) -> None:
        """In a thread: the daemon streams the prefix into shared memory; the worker's step
        writes it into the paged cache (get_finished)."""
        if self._refused:
            self._fetched.put((spec, None, self._refused))
            return
        o = self.options
        try:
            f = self._client(FETCH_IDLE_S).fetch(o.fetch_request(spec.tokens))
            f.wait()
        except (OSError, ClientError, ValueError) as e:
            self._fetched.put((spec, None, f"{type(e).__name__}: {e}"))
            return
        self._fetched.put((spec, f, None))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request computes only once its load is written

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole prompts are read after the forward of their last prefill step (wait_for_save)

    def wait_for_save(self):
        """Hand each prompt whose prefill just ended to the put thread: its KV is read out of the
        paged cache there (~1 s for 4096 SmolLM2 tokens on one core: not on the request's
        path), while vLLM keeps the request's blocks (request_finished) until it is read."""
        if not self.has_connector_metadata():
            return
        for spec in self._get_connector_metadata().saves:
            self._saving.add(spec.req_id)
            if self._layout is None or self._refused:
                self._done_reading(spec.req_id)
                continue
            if self._putter is None:
                self._putter = threading.Thread(target=self._putting, name="kvstreamd-put", daemon=True)
                self._putter.start()
            try:
                self._puts.put_nowait(spec)
            except queue.Full:
                self._once("save_full", "kvstreamd: %d saves already wait for the daemon; prompts past them are "
                           "not saved (a later request computes them)", SAVE_QUEUE)
                self._done_reading(spec.req_id)

    def _done_reading(self, req_id: str) -> None:
        with self._save_lock:
            self._read_out.add(req_id)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        t = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        return blocks[t // self.block_size] * self.block_size + t % self.block_size

    def _putting(self) -> None:
        while True:
            spec = self._puts.get()
            try:
                slots = self._slots(spec.block_ids, 0, len(spec.tokens))
                kv = torch.stack([self._layout.gather(self._caches[name], slots) for name in self._caches])
                kv = kv.to(torch.float16)
            except (RuntimeError, IndexError, ValueError) as e:
                self._once(f"read:{type(e).__name__}", "kvstreamd: a prompt's KV could not be read out of the "
                           "paged cache (%s: %s); it is not saved", type(e).__name__, e)
                kv = None
            finally:
                self._done_reading(spec.req_id)  # its blocks may go back to vLLM
            if kv is None:
                continue
            try:
                self._client(120.0).put(self.options.model_id, spec.tokens, kv)
            except (OSError, ClientError, ValueError) as e:
                self._once(f"put:{type(e).__name__}", "kvstreamd: a put to the daemon failed (%s: %s); "
                           "prompts are not saved until it answers", type(e).__name__, e)
            del kv

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        while True:
            try:
                spec, f, why = self._fetched.get_nowait()
            except queue.Empty:
                break
            self._fetching.pop(spec.req_id, None)
            done.add(spec.req_id)
            loaded = self._write(spec, f, why)
            if loaded < len(spec.tokens):
                bad = plan.blocks_of(loaded, len(spec.tokens), self.block_size)
                self._load_errors.update(spec.block_ids[i] for i in bad)
        with self._save_lock:  # saves read out of requests that have finished: their blocks may go
            self._ended |= finished_req_ids & self._saving
            sent = self._read_out & self._ended
            self._read_out -= sent
            self._ended -= sent
            self._saving -= sent
        return (sent or None), (done or None)

    def _write(self, spec: LoadSpec, f, why: str | None) -> int:
        """Write the fetched chunks into the paged cache, up to the first that is not KV; the
        tokens written (the rest are load errors: vLLM recomputes them)."""
        if f is None:
            self._once(f"fetch:{why.split(':')[0]}", "kvstreamd: a fetch failed (%s): its tokens are recomputed", why)
            return spec.start
        try:
            loaded = spec.start
            for ev in sorted(f.events, key=lambda e: e.start):
                if ev.kind != "kv" or ev.start != loaded:
                    break
                loaded = ev.end
            if loaded > spec.start:
                loaded = self._fill(f, spec, loaded)
            if loaded < len(spec.tokens):
                self._once("text", "kvstreamd: a fetch gave tokens %d.. as text (or not at all): vLLM computes "
                           "them (its errors: %s)", loaded, (f.end.errors if f.end else None))
            return loaded
        except (ValueError, RuntimeError, ClientError) as e:
            self._once(f"write:{type(e).__name__}", "kvstreamd: a fetched prefix could not be written (%s: %s): "
                       "its tokens are recomputed", type(e).__name__, e)
            return spec.start
        finally:
            try:
                f.release()
            except Exception as e:  # noqa: BLE001  (a view left over: the mapping goes with it)
                self._once("release", "kvstreamd: a fetch's buffer did not release cleanly: %s", e)

    def _fill(self, f, spec: LoadSpec, loaded: int) -> int:
        """Write tokens [spec.start, loaded) of the fetch into the paged cache, every layer
        through the backend's write op (a sliding layer only its window: vLLM reads no more);
        returns where the load ends (spec.start: nothing, when a sliding layer lacks its window)."""
        prefix = f.prefix  # per layer, the tokens it holds: all, or a sliding layer's window of them
        if prefix is None:
            return spec.start
        loaded = self._cut_to_windows(prefix, spec.start, loaded)
        for layer, name in enumerate(self._caches):
            first, kv = prefix.layer(layer)  # [2, T, H, D] of tokens [first, found)
            lo = max(spec.start, first)
            if lo < loaded:
                part = kv[:, lo - first:loaded - first].to(self._caches[name].dtype)
                self._writer(name)(part[0].contiguous(), part[1].contiguous(), self._slots(spec.block_ids, lo, loaded))
        return loaded

    @staticmethod
    def _cut_to_windows(prefix, start: int, loaded: int) -> int:
        """The tokens a load may end at: `loaded`, where every sliding layer holds the window
        before it (the fetch ends past `loaded` when a text suffix followed: a window ends at
        the fetch's end); else `start`, nothing loaded."""
        for p in prefix.parts:
            if p.window is not None and p.start > max(loaded - p.window, 0):
                return start
        return loaded

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out


def _layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer's name ("model.layers.7.self_attn.attn": 7)."""
    m = re.search(r"\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"no layer number in the attention layer name {name!r}")
    return int(m.group(1))
