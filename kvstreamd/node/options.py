"""What a fetch runs by, decided once as it arrives: from its request, the configuration in
force, and its A/B arm. A reload or an experiment that changes meanwhile does not touch a fetch
that has begun."""
from __future__ import annotations

from dataclasses import dataclass

from kvstreamd.config import Config
from kvstreamd.events import FetchRequest
from kvstreamd.experiment import CANDIDATE


@dataclass(frozen=True)
class FetchOptions:
    model_id: str
    tokens: tuple[int, ...]
    dtype: str  # of the buffer the KV lands in
    device: str  # what the request asked: "cpu", or "cuda" (decode on the node's GPU)
    chunk_tokens: int
    deadline_ms: int  # the request's, else [fetch] deadline_ms; counted from `arrived`
    arrived: float  # time.monotonic() the request arrived
    levels: tuple[str, ...]  # the levels it takes chunks at (TEXT aside), best first
    recompute_tokens_per_s: float  # the model process's prefill rate, to price TEXT chunks
    stall_s: float  # a peer silent this long while waited for has stalled
    arm: str  # the A/B arm: experiment.CONTROL or CANDIDATE
    experiment: str  # the experiment's label, as the outcome log records it
    rule: str | None  # the level rule its senders are asked for (the candidate's); None: theirs
    keep_fetched: bool  # store the chunks peers sent, to serve them onward
    text_last: bool = False  # its senders send TEXT only after every KV chunk (events.FetchRequest)
    recompute_doubling_tokens: float | None = None  # TEXT priced by position (events.FetchRequest)
    order: str = "prompt"  # of its chunk events (events.ORDERS)

    @classmethod
    def of(cls, req: FetchRequest, cfg: Config, arrived: float) -> FetchOptions:
        exp = cfg.policy.experiment
        arm = exp.arm(req.model_id, req.tokens)
        candidate = arm == CANDIDATE
        # the levels it asked for, else the candidate's ladder in the candidate arm, else the node's
        levels = req.levels or (exp.levels if candidate and exp.levels else cfg.codec.levels)
        return cls(model_id=req.model_id, tokens=tuple(req.tokens), dtype=req.dtype, device=req.device,
                   chunk_tokens=cfg.codec.chunk_tokens, deadline_ms=req.deadline_ms or cfg.fetch.deadline_ms,
                   arrived=arrived, levels=tuple(levels),
                   recompute_tokens_per_s=req.recompute_tokens_per_s or cfg.fetch.recompute_tokens_per_s,
                   stall_s=cfg.fetch.stall_s, arm=arm, experiment=exp.label,
                   rule=(exp.rule or None) if candidate else None, keep_fetched=cfg.store.keep_fetched,
                   text_last=req.text_last, recompute_doubling_tokens=req.recompute_doubling_tokens,
                   order=req.order)
