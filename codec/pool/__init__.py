"""The codec across worker processes: CodecPool (parallel) splits a chunk's streams over
workers that share its tensors and bitstreams through shared-memory segments (segments), warm
their tables ahead of the chunks (warm) and yield to coding work (quiet).

Kept apart from the method and tuning because it is the codec's only code with processes,
signals and shared memory: it imports both, neither imports it (tests/test_layering.py)."""
