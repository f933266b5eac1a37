# The two set-up commands of README: `make test` and `make demo`. Each creates .venv on first use.
# The C++ extension compiles (setup.py build_ext --inplace, next to its sources) while pip installs
# the dependencies and the package in editable mode around it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: install test test-compat bench demo sweep-demo tiny-model clean

$(STAMP): setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade setuptools wheel
	$(BIN)/pip install --quiet $(TORCH_PIN) ninja
	$(BIN)/python setup.py --quiet build_ext --inplace > $(VENV)/build_ext.log 2>&1 & build=$$!; \
	RLVR_FAST_EXTENSION=inplace $(BIN)/pip install --quiet --no-build-isolation -e '.[dev]'; \
	deps=$$?; wait $$build || { tail -n 30 $(VENV)/build_ext.log; exit 1; }; exit $$deps
	touch $(STAMP)

install: $(STAMP)

# Lint and format checks; the tests, in one process per core (pytest-xdist), each with one
# OpenMP thread (the tests' operators are tiny: two processes keep two cores busy where one
# process with two threads leaves one waiting; work stealing, so that a worker left with the
# long tests hands some to the other); every benchmark collected (imports and
# parametrisation; their bodies run in `make bench`, and the CPU cases of the fused ops and of
# decode run in the GPU suite's dry run); then, side by side, the C++ extension built without its
# AVX2 path (what aarch64 compiles) and checked against the installed one, and the GPU suite's
# dry run (every stage on the CPU at tiny sizes), then that of its first-lease part (--first).
# A fresh clone's make test stays under 15 minutes on a 2-core machine: the benchmark bodies
# (about 3 minutes) are what no longer fits.
TEST_WORKERS ?= auto
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests
	$(BIN)/python -m pytest -q --collect-only benchmarks > /dev/null
	$(BIN)/python scripts/check_scalar_build.py & scalar=$$!; \
	PATH="$(CURDIR)/$(BIN):$$PATH" bash benchmarks/gpu/check.sh --dry-run; dry_run=$$?; \
	PATH="$(CURDIR)/$(BIN):$$PATH" bash benchmarks/gpu/check.sh --first --dry-run || dry_run=1; \
	wait $$scalar && exit $$dry_run

# The whole suite again under the GPU machine's versions (torch 2.11, triton 3.6, transformers
# 5.17) in a side virtualenv, deleted afterwards (scripts/test_compat.sh; not part of make test:
# its install alone downloads gigabytes). The result goes to benchmarks/results/.
test-compat:
	bash scripts/test_compat.sh

bench: install
	$(BIN)/python -m pytest benchmarks --benchmark --benchmark-columns=min,mean,rounds

# One OpenMP thread, as sweep-demo below (a second thread waiting for a busy core stalls every
# operator of the embedded model on a shared 2-core machine); README's figures were measured so.
demo: install
	OMP_NUM_THREADS=1 $(BIN)/python -m rlvr_fast.demo

# Three flat arms (1, 2, 4) x two seeds on the embedded default with make demo's settings, then
# compare + report (tables in runs/sweep-demo/compare.md, figures in runs/sweep-demo/report/).
# Run it again to finish an interrupted sweep; finished runs are skipped. One OpenMP thread: the
# embedded model's operators are too small to gain from a second one, and on a shared 2-core
# machine a thread waiting for a busy core stalls every operator (15 steps: 8-10 s vs 38-62 s).
SWEEP_DEMO_OUT ?= runs/sweep-demo
sweep-demo: install
	OMP_NUM_THREADS=1 $(BIN)/rlvr-fast sweep --arms baseline,zg_flat,ra_flat --seeds 42,101 --steps 50 \
		--eval held_out=synthetic:test:200 --set lr=1e-4 --set eval_max_new_tokens=256 \
		--out $(SWEEP_DEMO_OUT)

# Re-create the embedded default checkpoint (about 15 minutes on 2 CPU cores).
tiny-model: install
	$(BIN)/python scripts/train_tiny.py --out rlvr_fast/assets/tiny

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .benchmarks .ruff_cache
