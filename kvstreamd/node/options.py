"""What a fetch runs by, decided once as it arrives: its request, and the configuration's and its
A/B arm's answers to what the request leaves open. A reload or an experiment that changes
meanwhile does not touch a fetch that has begun."""
from __future__ import annotations

from dataclasses import dataclass

from kvstreamd.config import Config
from kvstreamd.experiment import CANDIDATE
from kvstreamd.requests import FetchRequest


@dataclass(frozen=True)
class FetchOptions:
    """The request's own fields (model_id, tokens, dtype, device, text_last, order, ...) are read
    through it as they are: `options.order` is `options.request.order`."""

    request: FetchRequest
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

    def __getattr__(self, name: str):  # only for names not found above: the request's fields
        if name == "request":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.request, name)

    @classmethod
    def of(cls, req: FetchRequest, cfg: Config, arrived: float) -> FetchOptions:
        exp = cfg.policy.experiment
        arm = exp.arm(req.model_id, req.tokens)
        candidate = arm == CANDIDATE
        # the levels it asked for, else the candidate's ladder in the candidate arm, else the node's
        levels = req.levels or (exp.levels if candidate and exp.levels else cfg.codec.levels)
        return cls(request=req, chunk_tokens=cfg.codec.chunk_tokens, deadline_ms=req.deadline_ms or cfg.fetch.deadline_ms,
                   arrived=arrived, levels=tuple(levels),
                   recompute_tokens_per_s=req.recompute_tokens_per_s or cfg.fetch.recompute_tokens_per_s,
                   stall_s=cfg.fetch.stall_s, arm=arm, experiment=exp.label,
                   rule=(exp.rule or None) if candidate else None, keep_fetched=cfg.store.keep_fetched)
