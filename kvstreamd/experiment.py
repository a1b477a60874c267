"""An A/B experiment on the level policy: which arm a fetch is in, and what the candidate arm
changes (the sender's rule, the fetch's level ladder). `[policy] experiment` configures it."""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

CONTROL, CANDIDATE = "control", "candidate"
ARMS = (CONTROL, CANDIDATE)


def arm_point(model_id: str, tokens: list[int]) -> float:
    """Where a request falls in [0, 1): a blake2b of what the request is (the model and the
    prompt's token ids), never of when it came or its request id, so that a retry -- or the
    same prompt after a daemon restart -- falls at the same point, and so in the same arm."""
    m = model_id.encode()
    h = hashlib.blake2b(b"kvstreamd-ab\0" + struct.pack("<I", len(m)) + m, digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}Q", *tokens))
    return int.from_bytes(h.digest(), "little") / 2**64


@dataclass(frozen=True)
class Experiment:
    """`[policy] experiment`: the candidate's rule and/or level ladder, and the share of fetches
    that get it. fraction 0 (the default) is no experiment: every fetch is control."""

    fraction: float = 0.0  # the share of fetches in the candidate arm, 0..1
    rule: str = ""  # the candidate's rule (transport.policy.RULES); "": the sender's default
    levels: tuple[str, ...] = ()  # the candidate's ladder, best first; (): the fetch's own

    def arm(self, model_id: str, tokens: list[int]) -> str:
        """The arm of a fetch of `tokens` for `model_id`."""
        if self.fraction <= 0:
            return CONTROL
        return CANDIDATE if arm_point(model_id, tokens) < self.fraction else CONTROL

    @property
    def label(self) -> str:
        """One line naming the experiment: the records of one are compared with each other only."""
        if self.fraction <= 0:
            return "off"
        return f"fraction={self.fraction:g} rule={self.rule or '-'} levels={','.join(self.levels) or '-'}"

    def describe(self) -> dict:
        """As GET /v1/ab and `kvstreamd ab report` show it."""
        return {"fraction": self.fraction, "rule": self.rule or None, "levels": list(self.levels) or None,
                "label": self.label}
