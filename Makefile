# The README's two commands: `make quickstart` and `make test`. Each installs first if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
QUICKSTART := examples/quickstart.yaml

.PHONY: install quickstart test test-fast test-unit lint benchmark experiment clean runners-install flink-up flink-down

install: $(STAMP)

# Python is often told not to write bytecode (PYTHONDONTWRITEBYTECODE, as on the machines this is
# tested on): then every process (a CLI run, an SDK worker) compiles each module it imports again,
# ~1-2 s of the project's own and minutes of torch's and Beam's. So the install compiles the
# libraries' and each command the project's (Python ignores a .pyc whose source changed since).
BYTECODE := $(BIN)/python -m compileall -q -j 0 pipeline schemas trainer examples benchmarks

# Idempotent: re-runs only when the dependency declarations change. constraints.txt pins torch
# (PyPI's 2.13.0 is its CUDA build, ~3 GB with its libraries, and runs on a CPU as well) and uv,
# which installs the rest from its per-machine cache (~/.cache/uv) and compiles it: ~1.5 min once the
# machine has the wheels, where pip took ~6 min.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -c constraints.txt -e '.[dev,report,onnx,openvino]'
	touch $(STAMP)

# Beam's Flink and Spark runners on this machine (deploy/local/runners.py; versions pinned there):
# the jars once through Maven and PyPI, sha256-checked. flink-up starts a Flink session cluster
# (1 JobManager, 2 TaskManagers, on loopback) and prints, as its last line, the Beam options that
# submit to it; `$(RUNNERS) spark-options` prints those for Spark (which runs in its job server).
RUNNERS := $(BIN)/python deploy/local/runners.py

# Idempotent: returns at once when the pinned jars are in place.
runners-install: install
	$(RUNNERS) install

flink-up: runners-install
	$(RUNNERS) up

flink-down:
	$(RUNNERS) down

quickstart: install
	@$(BYTECODE)
	$(BIN)/ratrain-pipeline run --config $(QUICKSTART)
	$(BIN)/ratrain-pipeline validate out/quickstart
	$(BIN)/ratrain-pipeline inspect out/quickstart/shards --n 1
	$(BIN)/ratrain-train --shards out/quickstart/shards --steps 20 --log-every 5 \
		--dim 128 --depth 4 --heads 4 --batch-size 4 --checkpoint out/quickstart/model.pt
	$(BIN)/ratrain-eval --checkpoint out/quickstart/model.pt --shards out/quickstart/shards \
		--max-sequences 64 --json out/quickstart/eval.json
	$(BIN)/ratrain-pipeline report out/quickstart --eval out/quickstart/eval.json

# Tests live in tests/<package>/ as pipeline/ does (plus trainer/, schemas/, cli/, deploy/, and
# e2e/ for whole-pipeline runs). Each carries one marker of its kind (pyproject.toml): unit (plain
# functions: no Beam pipeline, no CLI subprocess or dry run, no service), beam (runs a Beam
# pipeline over a stage), e2e (whole jobs, the CLI, the built sample output, the GCS emulator,
# the real encoder); slow (over ~30 s) comes on top. Select with -m, e.g.
# PYTEST_ARGS='-m "beam and not slow"'.
# PYTEST_ARGS="--embedding-precision float32|bfloat16": the encoder path this CPU would not choose.
# The tests run in TEST_WORKERS pytest processes (pytest-xdist), a test file to a process, so a
# module's fixtures are built once (the session's built output once per process): run one at a
# time, most tests keep one of two cores busy. TEST_WORKERS=0 runs them in this process. The files go
# out in the order tests/conftest.py sorts them (xdist would send the files with most tests first,
# leaving the long single tests, Flink's and the own_process one, for the end).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: install runners-install
	@$(BYTECODE)
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# Everything but the tests marked slow (each over ~30 s); `make test` (and CI) runs them all.
test-fast: install
	@$(BYTECODE)
	$(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# The unit tests only: under a minute on 2 cores, for the edit-test loop.
test-unit: install
	@$(BYTECODE)
	$(BIN)/python -m pytest -m unit $(PYTEST_ARGS)

# ruff (lint and format, pyproject.toml [tool.ruff]) over the tree, mypy over pipeline/, schemas/ and
# trainer/, and the house rules (tests/house/: the layers, no import cycle, no module over 400 lines,
# every module in docs/design.md §2).
# mypy's cache per machine, not per clone: `make lint` on a clean clone took 13 s with it warm, ~2 min
# cold; mypy re-checks any module whose contents differ from the cached one
MYPY_CACHE ?= $(HOME)/.cache/ratrain-pipeline/mypy
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	MYPY_CACHE_DIR=$(MYPY_CACHE) $(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 0 tests/house

# The quickstart with every encoder setting (~10 min on 2 cores), then ~50k chunks of real text
# where the per-job costs no longer dominate, every setting again (~40 min on 2 cores with AMX).
benchmark: install
	$(BIN)/python benchmarks/embed_vs_encoder.py
	$(BIN)/python benchmarks/embed_vs_encoder.py --docstring-chunks 50000

experiment: install
	$(BIN)/python examples/retrieval_experiment.py --out out/experiment

clean:
	rm -rf out .pytest_cache
