"""The GPU decode path. On every machine: the decoder with batched lanes and the C library
standing in for the kernel (the very transforms a GPU runs), and the CUDA kernel's own source
compiled by the host C++ compiler and run lane by lane (blockIdx/threadIdx emulated), both
against the CPU codec. On a GPU: the kernel itself, bit-identical symbols and the same tensors."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import time

import numpy as np
import pytest

import torch

import codec
from codec import bitstream as bs, gpu, rans
from tests.fixtures import synthetic_kv

GPU_OK, GPU_WHY = gpu.available()
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"needs an NVIDIA GPU with CuPy: {GPU_WHY}")


@pytest.fixture(scope="module")
def context(small_profile):
    """One context's chunks as a fetch mixes them: levels change chunk to chunk, the first
    holds the sink token, the last is short, and one is constriction-coded (paper config)."""
    import importlib.util
    kv = synthetic_kv(150, seed=11).to(torch.float16)
    plan = [(0, 40, "high"), (40, 80, "fast"), (80, 120, "balanced"), (120, 143, "high"), (143, 150, "cachegen-paper")]
    if importlib.util.find_spec("constriction") is None:  # a GPU host given only what lane rANS needs
        plan[-1] = (143, 150, "fast")
    chunks = [codec.encode(kv[:, :, a:b].contiguous(), lv, small_profile, start=a) for a, b, lv in plan]
    ref = torch.cat([codec.decode(c, small_profile) for c in chunks], dim=2)
    return chunks, ref


def test_batched_decoder_matches_the_cpu_codec(context, small_profile):
    chunks, ref = context
    dec = gpu.device_decoder(small_profile, "cpu")
    out = dec.decode_many(chunks)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    # One decoder, one set of transforms: on the CPU the batched lanes give codec.decode's
    # tensor bit for bit (on a GPU, TF32 and another GEMM round differently).
    assert torch.equal(out, ref)
    assert torch.equal(out[:, :, :1], ref[:, :, :1])  # the sink token travels exact
    prep = dec.prepare(chunks)
    for c, sym in zip(chunks, dec.symbols(prep)):
        if sym is None:
            assert not bs.unpack(c).transforms & bs.RANS
            continue
        assert torch.equal(sym, gpu.cpu_symbols(c, small_profile))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decoder_keeps_the_dtype_and_fills_a_given_tensor(small_profile, dtype):
    kv = synthetic_kv(64, seed=3).to(dtype)
    chunks = [codec.encode(kv[:, :, a:a + 32].contiguous(), "high", small_profile, start=a) for a in (0, 32)]
    out = torch.full(kv.shape, float("nan"), dtype=dtype)
    gpu.device_decoder(small_profile, "cpu").decode_many(chunks, out=out)
    ref = torch.cat([codec.decode(c, small_profile) for c in chunks], dim=2)
    assert not torch.isnan(out).any()
    assert torch.equal(out, ref)


def _damaged(chunk: bytes) -> bytes:
    """Flip a bit in the last stream's rANS words and recompute the CRC, so only the
    decoder's own checks stand in the way."""
    import zlib
    data = bytearray(chunk[:-4])
    data[-3] ^= 0x10
    return bytes(data) + zlib.crc32(bytes(data)).to_bytes(4, "little")


def test_damaged_stream_names_its_chunk(context, small_profile):
    chunks, _ = context
    bad = list(chunks)
    bad[2] = _damaged(chunks[2])
    with pytest.raises(codec.CodecError, match="chunk 2"):
        gpu.device_decoder(small_profile, "cpu").decode_many(bad)
    with pytest.raises(codec.CodecError, match="checksum"):
        gpu.device_decoder(small_profile, "cpu").prepare([chunks[0][:-5] + b"\0" + chunks[0][-4:]])


# -- the CUDA source, compiled for the host --------------------------------------------------

_EMULATION = r"""
struct Dim3 { unsigned x; };
static Dim3 blockIdx, blockDim, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(int i) { float f; __builtin_memcpy(&f, &i, 4); return f; }
"""
_LAUNCHER = r"""
extern "C" void launch(unsigned grid, unsigned block, uint32_t n_lanes, const uint16_t *words,
    const int64_t *word_start, const uint32_t *comp_start, const uint32_t *rows,
    const uint32_t *comp_model, const int64_t *out_off, const uint32_t *cum,
    const uint32_t *cum_off, const uint16_t *bucket, const uint32_t *alphabet,
    RANS_OUT_T *out, int32_t *status)
{
    blockDim.x = block;
    for (unsigned b = 0; b < grid; b++)
        for (unsigned t = 0; t < block; t++) {
            blockIdx.x = b;
            threadIdx.x = t;
            lane_rans_decode(n_lanes, words, word_start, comp_start, rows, comp_model, out_off, cum,
                             cum_off, bucket, alphabet, out, status);
        }
}
"""


def _host_kernel(tmp_path, float_out: bool):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail("a C++ compiler is part of the build requirements (Makefile installs g++)")
    src = tmp_path / f"kernel_{int(float_out)}.cpp"
    src.write_text(_EMULATION + gpu.kernel_source(float_out) + _LAUNCHER)
    lib = tmp_path / f"kernel_{int(float_out)}.so"
    res = subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(lib), str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return ctypes.CDLL(str(lib)).launch


def _launch_on_host(fn, g, out: np.ndarray) -> np.ndarray:
    n = len(g.lanes)
    status = np.full(n, 99, np.int32)
    m = g.tables.models
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    fn(ctypes.c_uint((n + gpu.THREADS - 1) // gpu.THREADS), ctypes.c_uint(gpu.THREADS), ctypes.c_uint32(n),
       ptr(g.words), ptr(g.word_start), ptr(g.lanes.comp_start), ptr(g.lanes.rows), ptr(g.lanes.comp_model),
       ptr(g.lanes.out_off), ptr(m.cum), ptr(m.cum_off), ptr(m.bucket), ptr(m.alphabet), ptr(out), ptr(status))
    return status


def test_cuda_kernel_source_decodes_like_the_cpu_library_when_run_on_the_host(context, small_profile, tmp_path):
    """The kernel text NVRTC compiles, built by the host compiler with one call per thread:
    its int variant writes the CPU library's symbols, its fused float variant the values the
    batched decoder dequantizes, and a damaged lane reports its error in status."""
    chunks, _ = context
    dec = gpu.LaneDecoder(small_profile, "cpu")
    prep = gpu.device_decoder(small_profile, "cpu").prepare(chunks).lanes
    ints = dec.entropy_decode(prep, float_out=False).numpy()
    floats = dec.entropy_decode(prep, float_out=True).numpy()
    int_kernel, float_kernel = _host_kernel(tmp_path, False), _host_kernel(tmp_path, True)
    got_i = np.zeros_like(ints)
    got_f = np.zeros_like(floats)
    for g in prep.groups:
        assert not _launch_on_host(int_kernel, g, got_i).any()
        assert not _launch_on_host(float_kernel, g, got_f).any()
    assert np.array_equal(got_i, ints)
    assert np.array_equal(np.isnan(got_f), np.isnan(floats))
    assert np.array_equal(np.nan_to_num(got_f, nan=7e7), np.nan_to_num(floats, nan=7e7))
    bad = gpu.device_decoder(small_profile, "cpu").prepare([_damaged(chunks[0])]).lanes
    status = _launch_on_host(int_kernel, bad.groups[0], np.zeros(bad.n_sym, np.int32))
    assert status[-1] in (rans.E_WORDS, rans.E_END) and not status[:-1].any()


def _nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel (a test dependency on Linux x86-64)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    libs = sorted(Path(p) / "lib" for p in (spec.submodule_search_locations if spec else []))
    found = [f for d in libs for f in sorted(d.glob("libnvrtc.so.*")) if "alt" not in f.name]
    if not found:
        pytest.skip("NVRTC is not installed (nvidia-cuda-nvrtc-cu12 is a test dependency on Linux x86-64 only)")
    return ctypes.CDLL(str(found[0]))


@pytest.mark.parametrize("float_out", [False, True])
def test_cuda_kernel_source_compiles_with_nvrtc_for_hopper(float_out):
    """The exact text codec/gpu.py hands CuPy's RawModule, compiled by NVRTC (which needs no GPU)
    for sm_90 without a warning: the kernel a GPU host will build."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), gpu.kernel_source(float_out).encode(), b"lane_rans.cu",
                                  0, None, None) == 0
    opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_90")
    rc = lib.nvrtcCompileProgram(prog, 1, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    assert "warning" not in log.value.decode(), log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    assert ".visible .entry lane_rans_decode(" in ptx.value.decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_gpu_unavailable_is_said_not_hidden():
    if GPU_OK:
        pytest.skip("this machine has a GPU: the GPU tests below run instead")
    with pytest.raises(RuntimeError, match="GPU decode unavailable"):
        gpu.device_decoder(None, "cuda")


# -- on a GPU -----------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.gpu
def test_kernel_symbols_are_bit_identical_to_the_cpu_library(context, small_profile):
    chunks, _ = context
    dec = gpu.device_decoder(small_profile, "cuda")
    prep = dec.prepare(chunks)
    for c, sym in zip(chunks, dec.symbols(prep)):
        if sym is not None:
            assert torch.equal(sym.cpu(), gpu.cpu_symbols(c, small_profile))


@needs_gpu
@pytest.mark.gpu
def test_gpu_decode_matches_the_cpu_codec(context, small_profile):
    chunks, ref = context
    out = gpu.device_decoder(small_profile, "cuda").decode_many(chunks)
    assert out.is_cuda and out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.allclose(out.cpu().float(), ref.float(), rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@needs_gpu
@pytest.mark.gpu
def test_gpu_decode_rejects_a_damaged_stream(context, small_profile):
    chunks, _ = context
    with pytest.raises(codec.CodecError, match="chunk 0"):
        gpu.device_decoder(small_profile, "cuda").decode_many([_damaged(chunks[0])] + chunks[1:])


# -- the pipeline's GPU stages ----------------------------------------------------------------

def test_cuda_stages_fill_a_buffer_chunk_by_chunk(context, small_profile):
    chunks, ref = context
    stages = gpu.CudaStages(small_profile, "cpu")
    out = torch.zeros_like(ref)
    t0 = 0
    for c in chunks:
        staged = stages.decode(stages.receive(c))
        n = staged.kv.shape[2]
        assert stages.fill(staged, out[:, :, t0:t0 + n]) is None  # on the CPU: done on return
        t0 += n
    assert t0 == ref.shape[2]
    assert torch.equal(out, ref)  # on the CPU the stages run codec.decode's transforms


async def test_fetch_job_decodes_through_the_stages_when_it_has_them(small_profile):
    """The daemon's fetch pipeline with CudaStages in its receive, decode and fill stages
    (what a fetch with device "cuda" gets on a GPU host), here on the CPU: same chunks, same
    events, and a chunk that does not decode becomes TEXT."""
    from kvstreamd.coder import Coder
    from kvstreamd.cluster.directory import PeerDirectory
    from kvstreamd.metrics import Metrics
    from codec.layout import PrefixKV
    from kvstreamd.config import Config
    from kvstreamd.requests import FetchRequest
    from kvstreamd.node.fetch import FetchJob
    from kvstreamd.node.plan import plan
    from kvstreamd.node.options import FetchOptions
    from kvstreamd.store.chunkfile import ChunkRecord
    from kvstreamd.store.keys import chunk_keys
    from kvstreamd.store.store import Store

    p = small_profile
    kv = synthetic_kv(80, seed=9).to(torch.float16)
    tokens = list(range(1000, 1080))
    keys = chunk_keys(p.model_id, tokens, 32)
    store = Store(None, 1 << 30, 0)
    store.open()
    for i, key in enumerate(keys):
        s, e = 32 * i, min(32 * i + 32, 80)
        part = kv[:, :, s:e].contiguous()
        data = codec.encode(part, "high", p, start=s)
        store.put(ChunkRecord(key, keys[i - 1] if i else None, i, s, p.model_id, tuple(tokens[s:e]), "float16",
                              tuple(part.shape), {"high": _damaged(data) if i == 1 else data}))
    fetch_plan = await plan(store, PeerDirectory(), p.model_id, tokens, 32)
    assert fetch_plan.found == 3 and fetch_plan.local == 3
    buffer = torch.zeros_like(kv)
    coder = Coder(1)
    try:
        opts = FetchOptions.of(FetchRequest(p.model_id, tokens, deadline_ms=10_000, levels=["high"]), Config(),
                               time.monotonic())
        job = FetchJob(fetch_plan, opts, PrefixKV.from_dense(buffer), store, None, coder, Metrics(),
                       stages=gpu.CudaStages(p, "cpu"))
        events = []

        async def emit(ev):
            events.append(ev)
        res = await job.run(emit)
    finally:
        coder.close()
    # chunk 1's stream is damaged (its CRC made whole again): it becomes TEXT, the others land
    assert res.levels == ["high", "text", "high"] and "chunk 1" in res.errors[0]
    assert [e.kind for e in events] == ["kv", "text", "kv"]
    for i in (0, 2):
        s, e = 32 * i, min(32 * i + 32, 80)
        ref = codec.decode(store.get(keys[i]).levels["high"], p)
        assert torch.allclose(buffer[:, :, s:e].float(), ref.float(), rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    assert coder.rate(gpu=True) != coder.rate()  # the device's own rate, for the senders
