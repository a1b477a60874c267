"""A real vLLM engine in a process of its own (lab/vllm_driver.py run by vLLM's environment,
.venv-vllm, which `make install` builds), asked for greedy tokens: what the vLLM tests and
`kvstreamd bench vllm` drive. kvstreamd itself never imports vLLM."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
NEW_TOKENS = 8


def vllm_python() -> Path:
    """vLLM's environment's python: $KVSTREAMD_VLLM_PYTHON, else the checkout's .venv-vllm."""
    return Path(os.environ.get("KVSTREAMD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def connector_config(socket: str | Path, **extra) -> dict:
    """--kv-transfer-config for KvstreamdConnector beside the daemon at `socket`."""
    return {"kv_connector": "KvstreamdConnector", "kv_connector_module_path": "kvstreamd.engines.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": str(socket), **extra}}


class Engine:
    """One vLLM engine (its model folder, a connector config or None), built when made (20-40 s)."""

    def __init__(self, folder: Path, transfer: dict | None, log: Path, env: dict | None = None):
        python = vllm_python()
        if not python.is_file():
            raise FileNotFoundError(f"no vLLM environment at {python}: `make install` builds it")
        self.log = Path(log)
        self.proc = subprocess.Popen([str(python), str(DRIVER), str(folder), json.dumps(transfer) if transfer else ""],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                     text=True, cwd=self.log.parent,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        self._read()  # {"ready": true} once the engine is built

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM engine exited ({self.proc.wait()}):\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> dict:
        """{"tokens": [[ids] per prompt], "seconds": [per prompt, each run alone]}."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def said(self, pattern: str) -> bool:
        """Its log (vLLM's and the connector's lines) matches `pattern`."""
        return re.search(pattern, self.log.read_text()) is not None

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
