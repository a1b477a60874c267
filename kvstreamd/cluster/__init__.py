"""The cluster: who holds what (the directory, built-in or Redis), connections to peers, serving a
peer's FETCH, admitting a peer's chunk, splitting a fetch among holders, and prefetch. Imports
the base modules and store/ only (tests/test_layering.py)."""
