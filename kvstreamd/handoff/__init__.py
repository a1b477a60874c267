"""The hand-off to the model process: POSIX shared memory, the fetch buffers over it and CUDA IPC
buffers. Imports nothing else of kvstreamd (tests/test_layering.py)."""
