"""A real vLLM engine in a process of its own (lab/vllm_driver.py run by vLLM's environment,
.venv-vllm, which `make install` builds), asked for greedy tokens, and a real OpenAI-compatible
vLLM server: what the vLLM tests and `kvstreamd bench vllm` drive. kvstreamd itself never
imports vLLM."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .daemons import free_port

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
NEW_TOKENS = 8
# vLLM's CPU backend on this machine's loopback, with a KV cache that fits beside another engine
# (GiB of KV cache), and the same cores for every engine: vLLM's CPU build reserves one more core
# for the scheduler's side when any KV connector is configured (meant for NIXL), which on a
# 2-core machine reserves none and gives a connected engine's worker both cores against a plain
# engine's one.
VLLM_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
# An Engine made `in_process` runs its engine core in the driver's own process, as vLLM's V1 does
# with VLLM_ENABLE_V1_MULTIPROCESSING=0: the scheduler's and the worker's connectors then share one
# process. That saves two processes importing vLLM and torch: an engine built in 9.7 s, not 24 s,
# on an idle machine (2026-12-07); the tests' engines are. `kvstreamd bench vllm` times engines as
# a deployment runs them, in vLLM's default processes, and so does the OpenAI server (Server).
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SERVER_START_S = 180  # a server builds in 20-40 s on an idle machine; far longer on a loaded one


def vllm_python() -> Path:
    """vLLM's environment's python: $KVSTREAMD_VLLM_PYTHON, else the checkout's .venv-vllm."""
    return Path(os.environ.get("KVSTREAMD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def connector_config(socket: str | Path, **extra) -> dict:
    """--kv-transfer-config for KvstreamdConnector beside the daemon at `socket`."""
    return {"kv_connector": "KvstreamdConnector", "kv_connector_module_path": "kvstreamd.engines.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": str(socket), **extra}}


class Engine:
    """One vLLM engine (its model folder, a connector config or None), built when made (20-40 s;
    about 10 s `in_process`, IN_PROCESS_ENV)."""

    def __init__(self, folder: Path, transfer: dict | None, log: Path, env: dict | None = None,
                 max_model_len: int = 8192, in_process: bool = False):
        python = vllm_python()
        if not python.is_file():
            raise FileNotFoundError(f"no vLLM environment at {python}: `make install` builds it")
        self.log = Path(log)
        self.proc = subprocess.Popen([str(python), str(DRIVER), str(folder), json.dumps(transfer) if transfer else "",
                                      str(max_model_len)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                     text=True, cwd=self.log.parent,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), **VLLM_ENV,
                                          **(IN_PROCESS_ENV if in_process else {}), **(env or {})})
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


class Server:
    """One OpenAI-compatible vLLM server on 127.0.0.1 (its model folder, a connector config or
    None), its stdout and stderr in `log`. It is run as vLLM's api_server module: the `vllm`
    command of vllm-cpu cannot start (it asks for the version of a package named "vllm", which
    vllm-cpu is not); the module takes the same arguments as `vllm serve`."""

    def __init__(self, folder: Path, transfer: dict | None, log: Path, port: int | None = None,
                 env: dict | None = None, args: list[str] | None = None, max_model_len: int = 4096):
        self.folder, self.log = Path(folder), Path(log)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.folder),
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(max_model_len),
                     "--enforce-eager", "--no-enable-prefix-caching", *(args or [])]
        if transfer:
            self.argv += ["--kv-transfer-config", json.dumps(transfer)]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **VLLM_ENV, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, wait: float = SERVER_START_S) -> "Server":
        python = vllm_python()
        if not python.is_file():
            raise FileNotFoundError(f"no vLLM environment at {python}: `make install` builds it")
        with open(self.log, "ab") as log:
            # a session of its own: its engine-core process is stopped with it (stop)
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.log.parent, start_new_session=True)
        if wait:
            self.wait_ready(wait)
        return self

    def wait_ready(self, timeout: float = SERVER_START_S) -> None:
        """Until GET /health answers 200; the log's tail in the error if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the vLLM server did not answer /health within {timeout} s:\n{self.tail()}")

    def post(self, path: str, body: dict, timeout: float = 300.0) -> dict:
        """POST a JSON body; the JSON answer."""
        with urllib.request.urlopen(self._request(path, body), timeout=timeout) as r:
            return json.loads(r.read())

    def stream(self, path: str, body: dict, timeout: float = 300.0):
        """POST with "stream": true; yields (seconds since the request was sent, event) per
        server-sent event, up to [DONE]."""
        t0 = time.perf_counter()
        with urllib.request.urlopen(self._request(path, {**body, "stream": True}), timeout=timeout) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    return
                yield time.perf_counter() - t0, json.loads(data)

    def complete(self, prompt: list[int], max_tokens: int = NEW_TOKENS) -> dict:
        """A streamed greedy completion of the token ids `prompt` (/v1/completions): {"ttft":
        seconds to its first event, "tokens": ids, "text": str, "prompt": the ids the server saw}."""
        body = {"model": str(self.folder), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        events = list(self.stream("/v1/completions", body))
        if not events:
            raise RuntimeError(f"no completion from {self.url}:\n{self.tail()}")
        choices = [e["choices"][0] for _, e in events if e.get("choices")]
        return {"ttft": events[0][0], "tokens": [t for c in choices for t in c.get("token_ids") or ()],
                "text": "".join(c["text"] for c in choices), "prompt": choices[0].get("prompt_token_ids")}

    def _request(self, path: str, body: dict) -> urllib.request.Request:
        return urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                      headers={"Content-Type": "application/json"})

    def said(self, pattern: str) -> bool:
        """Its log (vLLM's and the connector's lines) matches `pattern`."""
        return re.search(pattern, self.log.read_text(errors="replace")) is not None

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def account(self, chars: int = 3000) -> str:
        """What a failed test shows of this server: the connector's own lines (its misses and
        failed fetches, each said once), then the log's last lines (vLLM's shutdown fills them)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        ours = "\n".join(ln for ln in text.splitlines() if "kvstreamd" in ln)[-chars:]
        return f"--- {self.log.name}: the connector's lines ---\n{ours}\n" \
               f"--- {self.log.name}, last lines ---\n{text[-chars:]}"

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (vLLM stops its engine core), then SIGKILL to the server's whole session;
        returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its session (an orphaned engine core)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
