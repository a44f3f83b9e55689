# aiohicache developer commands. `make test` works on a fresh clone: it builds .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
# Where torch comes from: empty takes pip's configured index; on stock PyPI a Linux torch is
# the CUDA build (GBs): TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu".
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed
NATIVE := $(VENV)/.native

.PHONY: install replay test test-gpu gpu-wheels lint check-kernels demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_INDEX) "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,cuda,serve,metrics]"
	touch $(STAMP) $(NATIVE)

# The C extensions (storage/_spanread.c, transfer/_pagecopy.c) are built by the install;
# again when one changes.
$(NATIVE): aiohicache/storage/_spanread.c aiohicache/transfer/_pagecopy.c | $(STAMP)
	$(BIN)/pip install -q --no-deps -e .
	touch $(NATIVE)

install: $(STAMP) $(NATIVE)

test: $(STAMP) $(NATIVE)
	$(BIN)/pytest -m "not gpu" -p no:cacheprovider

# The CUDA engine against the CPU engine on a real GPU; fails (rather than skipping every
# test) on a machine without one. GPU_PY=python3 runs it without the venv (docs/performance.md).
GPU_PY ?= $(BIN)/python
test-gpu:
	@if [ "$(GPU_PY)" = "$(BIN)/python" ]; then $(MAKE) --no-print-directory install; fi
	@$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA device')"
	$(GPU_PY) -m pytest -m gpu -p no:cacheprovider

# Wheels the lent GPU machine lacks (it has torch, cupy, numpy, aiofiles, anyio, pytest), for
# its `carry` (.whl is git-ignored). Python 3.12 there; see docs/cuda.md.
GPU_WHEELS := pytest-asyncio pytest-timeout hypothesis attrs sortedcontainers uvloop click \
	tqdm xxhash redis
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

lint: $(STAMP) $(NATIVE)
	$(BIN)/ruff check aiohicache tests
	$(BIN)/mypy

# Compile every CUDA source as NVRTC would at run time, so a syntax error fails CI (no GPU needed).
check-kernels:
	@for f in kernels/*.cu; do \
		echo "nvcc $$f"; nvcc -std=c++17 -arch=sm_90 -cubin -o /tmp/aiohicache-$$(basename $$f).cubin $$f || exit 1; \
	done

replay: $(STAMP) $(NATIVE)
	$(BIN)/aiohicache replay

demo: $(STAMP) $(NATIVE)
	$(BIN)/aiohicache demo

bench: $(STAMP) $(NATIVE)
	$(BIN)/aiohicache bench core

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
