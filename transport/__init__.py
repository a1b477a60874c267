"""The peer protocol: frames, messages, a sans-IO connection state machine, bandwidth
estimation and per-chunk level choice, with thin asyncio glue on top (aio.py)."""
