"""The event loop the transport runs on: uvloop's where it is installed, asyncio's otherwise.
transport/aio.py gives both names too (aio.run is what the daemon and the benches call)."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine

__all__ = ["loop_factory", "run"]


def loop_factory() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed, asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run(main) on the loop loop_factory() makes."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)
