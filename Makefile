# The two set-up commands of README: `make test` and `make demo`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: install test bench demo tiny-model clean

$(STAMP): setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade setuptools wheel
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet --no-build-isolation -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Tests, every benchmark once as a smoke check (no timings asserted), then the GPU suite's dry
# run (every stage on the CPU at tiny sizes).
test: install
	$(BIN)/python -m pytest -q tests
	$(BIN)/python -m pytest -q benchmarks --benchmark-disable
	PATH="$(CURDIR)/$(BIN):$$PATH" bash benchmarks/gpu/check.sh --dry-run

bench: install
	$(BIN)/python -m pytest benchmarks --benchmark --benchmark-columns=min,mean,rounds

demo: install
	$(BIN)/python -m rlvr_fast.demo

# Re-create the embedded default checkpoint (about 15 minutes on 2 CPU cores).
tiny-model: install
	$(BIN)/python scripts/train_tiny.py --out rlvr_fast/assets/tiny

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks
