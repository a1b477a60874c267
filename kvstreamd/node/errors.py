"""The one error a node's work raises for its caller: a request it cannot serve as asked."""
from __future__ import annotations


class RequestError(Exception):
    """A request the node cannot serve as asked; the API answers it with `status` and
    {"error": {"code", "message", **detail}}."""

    def __init__(self, status: int, code: str, message: str, detail: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.detail = detail or {}
