"""`kvstreamd bench gpu` at a toy size on the CPU (the C library standing in for the CUDA
kernel): it runs as `python -m kvstreamd.cli bench gpu`, writes the report scripts/gpu_check.sh
collects, and checks the batch decoder against the CPU codec; and its synthetic KV carries the
statistics it claims."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import system_fixture

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--layers", "2", "--heads", "2", "--head-dim", "32", "--tokens", "96",
        "--chunk-tokens", "32", "--reps", "2", "--workers", "1", "--quiet"]
# What the GPU machine lacks: the module must run without them.
OPTIONAL = ("transformers", "aiohttp", "uvloop", "psutil", "prometheus_client", "matplotlib", "gguf",
            "accelerate", "tokenizers")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
@system_fixture
def report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench_gpu") / "gpu_bench.json"
    res = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "bench", "gpu", *TINY, "--json", str(path)], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(path.read_text())


def test_report_describes_the_run(report):
    assert report["device"] == "cpu" and report["gpu_name"] == "cpu"
    assert report["shape"] == {"layers": 2, "heads": 2, "head_dim": 32}
    assert (report["tokens"], report["chunk_tokens"], report["level"], report["reps"]) == (96, 32, "high", 2)
    assert len(report["runs"]) == 2
    for key in ("decode_GBps", "decode_GBps_end_to_end"):
        assert report[key] > 0
    assert report["output_bytes"] == 2 * 2 * 96 * 2 * 32 * 2


def test_device_decode_matches_the_cpu_codec(report):
    assert report["symbols_identical"] is True
    assert 0 <= report["max_rel_err"] < 1e-3


def test_synthetic_kv_compresses_like_real_kv(report):
    # SmolLM2's own KV takes ~2.8 bits at `high`; a toy shape has fewer, smaller components.
    assert 1.0 < report["bits_per_element"] < 4.0
    assert report["compressed_bytes"] * 8 == pytest.approx(report["bits_per_element"] * report["output_bytes"] / 2,
                                                           rel=1e-3)


def test_fitted_profile_recovers_the_source_spectra():
    from codec import profile as profiles
    from kvstreamd.bench import gpu as bench

    synth = bench.SyntheticKV(profiles.Profile.load(bench.SOURCE_PROFILE), layers=2, heads=2, head_dim=32)
    prof = synth.fit(512, 128, seed=3)
    ratio = prof.tensors["pca_sigma"] / synth.sigma.numpy()
    # Each component's spread is what was asked, to sampling error; the trailing ones, which
    # a PCA of few tokens sees least well, come out somewhat narrower.
    lead = ratio[..., :32]
    assert np.median(lead) == pytest.approx(1.0, abs=0.03)
    assert np.all(np.abs(lead - 1) < 0.2)
    assert np.all((ratio > 0.7) & (ratio < 1.2))
    # ...and the steps are SmolLM2's, interpolated, whatever the shape.
    assert np.allclose(prof.base_step, synth.steps, rtol=1e-5)
    # The file holds the same profile (safetensors stores strided arrays transposed).
    again = profiles.Profile.from_bytes(prof.to_bytes())
    assert all(np.array_equal(again.tensors[k], v) for k, v in prof.tensors.items())


@pytest.mark.system  # a Python subprocess
def test_module_needs_none_of_the_optional_dependencies():
    code = ("import sys, kvstreamd.bench.gpu, kvstreamd.cli; "
            f"print([m for m in {OPTIONAL!r} if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_gpu_check_script_is_valid_bash_and_executable():
    script = ROOT / "scripts" / "gpu_check.sh"
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert os.access(script, os.X_OK)
