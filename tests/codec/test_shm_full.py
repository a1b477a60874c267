"""A full /dev/shm costs a chunk, not the process (issue 49, item 1). The pool's segments were sized
with ftruncate only, and the first write into a page /dev/shm could not back killed the daemon
with SIGBUS (exit -7). Run for real in a private mount namespace whose /dev/shm is a small tmpfs
that another process fills: a codec pool's workers code and decode there, then a chunk that needs a
segment larger than any the pool has made is refused with NoSharedMemory, and the pool goes on
decoding with the segments it holds."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fixtures import REPO

pytestmark = pytest.mark.system  # a mount namespace (root), a codec pool's worker processes

SCRIPT = r'''
import os, subprocess, sys
import torch
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", "/dev/shm"], check=True)
import codec
from codec.errors import NoSharedMemory
from codec.pool.parallel import CodecPool
from tests.fixtures import synthetic_kv

from codec.tuning import registry
prof = registry.register(codec.Profile.load(sys.argv[1]))
small = synthetic_kv(64, 3).half()
large = synthetic_kv(16384, 4).half()  # 3 MiB of fp16: a segment three times any the pool has made
with CodecPool(1, profile_paths=(sys.argv[1],), warm_levels=()) as pool:
    data = pool.encode(small, "fast", prof)
    assert torch.equal(pool.decode(data), codec.decode(data))
    big = codec.encode(large, "high", prof)
    # another process fills /dev/shm
    subprocess.run(["dd", "if=/dev/zero", "of=/dev/shm/filler", "bs=1M", "count=64"], capture_output=True)
    try:
        pool.decode(big)
    except NoSharedMemory as e:
        print("refused:", e)
    else:
        raise SystemExit("decoded a chunk /dev/shm had no room for")
    try:
        pool.encode(large, "high", prof)
    except NoSharedMemory as e:
        print("refused:", e)
    else:
        raise SystemExit("encoded a chunk /dev/shm had no room for")
    assert torch.equal(pool.decode(data), codec.decode(data))  # the segments it holds still serve
    print("served on")
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs in a mount namespace needs root")
def test_a_full_dev_shm_refuses_the_chunk_and_the_pool_goes_on(small_profile):
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SCRIPT,
                          str(small_profile.path)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    refused = [ln for ln in out.stdout.splitlines() if ln.startswith("refused: ")]
    assert len(refused) == 2 and all("no room in /dev/shm for a " in ln for ln in refused), out.stdout
    assert out.stdout.rstrip().endswith("served on")
