"""The daemon itself: the Node (puts, fetches, pins), a fetch's pipeline, the local HTTP API and
the Daemon that starts and reloads them all. May import every other room; none imports it but
the CLI (tests/test_layering.py)."""
