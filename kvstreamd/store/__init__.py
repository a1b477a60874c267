"""The store: chunk keys, the chunk file format, the files on disk, the memory and disk tiers,
lasting pins and the Store over them. Imports nothing else of kvstreamd (tests/test_layering.py)."""
