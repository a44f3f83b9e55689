# aiohicache developer commands. `make test` works on a fresh clone: it builds .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install replay test test-gpu lint check-kernels demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,cuda]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -m "not gpu" -p no:cacheprovider

test-gpu: $(STAMP)
	$(BIN)/pytest -m gpu -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check aiohicache tests
	$(BIN)/mypy

# Compile every CUDA source as NVRTC would at run time, so a syntax error fails CI (no GPU needed).
check-kernels:
	@for f in kernels/*.cu; do \
		echo "nvcc $$f"; nvcc -std=c++17 -arch=sm_90 -cubin -o /tmp/aiohicache-$$(basename $$f).cubin $$f || exit 1; \
	done

replay: $(STAMP)
	$(BIN)/aiohicache replay

demo: $(STAMP)
	$(BIN)/aiohicache demo

bench: $(STAMP)
	$(BIN)/aiohicache bench core

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
