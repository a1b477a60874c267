"""GET /metrics over TCP ([api] metrics_listen), for a Prometheus server to scrape: the metrics
only, read-only; the API itself stays on the Unix socket."""
from __future__ import annotations

from aiohttp import web

from . import api
from .node import Node


async def start(node: Node, host: str, port: int) -> web.AppRunner:
    """Listening on host:port (port 0: a free one, in runner.addresses) until runner.cleanup()."""
    app = web.Application()
    app[api.NODE] = node
    app.router.add_get("/metrics", api.metrics)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner
