# Every target installs what it needs first (make setup), so each works on a fresh checkout.
PY ?= python3
VENV ?= .venv
# --system-site-packages lets a GPU machine reuse its own CUDA torch: make setup VENV_FLAGS=--system-site-packages
VENV_FLAGS ?=
# Installed only when the environment has no torch: the CPU build lies on the CI/dev disk.
TORCH_SPEC ?= torch==2.13.0
PYTHON := $(VENV)/bin/python
PYTEST := $(PYTHON) -m pytest
# make test's parallel pytest-xdist workers (each a torch process of up to ~2.5 GB)
TEST_WORKERS ?= 2
RESULTS ?= results
BENCH_JSON ?= $(RESULTS)/bench.json
# make compare: the base run (a JSON path, a stored run number, or latest = the newest autosaved run) and
# the tests to run; thresholds come from .benchmarks/<machine>/noise-<cpu>-<n>cpus.json (make noise)
COMPARE_WITH ?= latest
COMPARE_TESTS ?= perf_tests
NOISE_RUNS ?= 3
# make ab: the base tree (a git revision or a directory) for interleaved A-B-B-A runs
BASE ?= HEAD
AB_ROUNDS ?= 2
# NAME=VALUE settings for the candidate's runs only (e.g. AB_ENV=PCVR_PLANTED_CPU_SLOWDOWN=0.10 plants a slowdown)
AB_ENV ?=
# more pcvr compare options, e.g. AB_ROUNDS=8 AB_FLAGS="--side-by-side --until-clear 12" (CPU cases: notes/comparison.md)
AB_FLAGS ?=
REPORT_VIEW ?= summary
SMOKE_MODELS ?= all
SMOKE_SEEDS ?= 17,42,97
SMOKE_STEPS ?= 20
SMOKE_DEVICE ?= cpu
SMOKE_OUT ?= smoke_runs
# more `pcvr smoke` options, e.g. SMOKE_ARGS="--table-cap 0 --jobs 4" (0: the reference's full tables)
SMOKE_ARGS ?=

.PHONY: setup test bench accuracy smoke compare noise ab report data lint clean

setup: $(VENV)/.installed

# Each step says what it does before it starts; pip shows its own download bars on a terminal
# (--progress-bar off in CI keeps the logs to one line per package).
PIP_PROGRESS := $(if $(CI),--progress-bar off,)
$(VENV)/.installed: pyproject.toml
	@echo "setup [1/4] virtual environment $(VENV)"
	test -x $(PYTHON) || $(PY) -m venv $(VENV_FLAGS) $(VENV)
	@echo "setup [2/4] upgrading pip"
	$(PYTHON) -m pip install -q --upgrade pip
	@echo "setup [3/4] torch ($(TORCH_SPEC) unless the environment already has one; a large download, minutes)"
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(PIP_PROGRESS) "$(TORCH_SPEC)"
	@echo "setup [4/4] pcvr-bench and its test dependencies"
	$(PYTHON) -m pip install $(PIP_PROGRESS) -e ".[test]"
	@echo "setup done: $(VENV)"
	touch $@

# All tests: accuracy, model smoke tests and every benchmark case run once as a test (no timing), in
# TEST_WORKERS pytest-xdist processes; then the tests that time a GPU, which need it to themselves, one by one.
test: setup
	$(PYTEST) accuracy_tests smoke_tests perf_tests --benchmark-disable -q -n $(TEST_WORKERS) --dist worksteal \
		-m "not explore and not exclusive"
	$(PYTEST) accuracy_tests smoke_tests perf_tests --benchmark-disable -q -m "exclusive and not explore"

# The benchmark suite: pytest-benchmark JSON in $(BENCH_JSON), a copy stored under .benchmarks/, a summary.
# DATA_SCALE=300 runs the data cases on the seed's 300x data (300,000 rows; --data-scale full); ci/default too.
DATA_SCALE ?=
DATA_SCALE_FLAG = $(if $(filter 300,$(DATA_SCALE)),--data-scale full,$(if $(DATA_SCALE),--data-scale $(DATA_SCALE)))
bench: setup
	mkdir -p $(RESULTS)
	$(PYTEST) perf_tests --benchmark-only --benchmark-autosave --benchmark-json=$(BENCH_JSON) $(DATA_SCALE_FLAG) -q
	$(PYTHON) -m pcvr_lib report $(BENCH_JSON)

accuracy: setup
	$(PYTEST) accuracy_tests -q

smoke: setup
	$(PYTHON) -m pcvr_lib smoke --models $(SMOKE_MODELS) --seeds $(SMOKE_SEEDS) --steps $(SMOKE_STEPS) \
		--device $(SMOKE_DEVICE) --out $(SMOKE_OUT) $(SMOKE_ARGS)

# Runs the perf suite, then `pcvr diff` against a stored run of the same machine: device/CPU time gated with
# noise-floor thresholds, counted work exactly, host and per-call time reported; exit 1 on a regression or a
# missing (or not comparable) case, 2 when it refuses.
compare: setup
	$(PYTHON) -m pcvr_lib diff $(COMPARE_WITH) --run $(RESULTS)/compare.json --json $(RESULTS)/diff.json \
		--tests $(COMPARE_TESTS)

# Runs the suite NOISE_RUNS times and stores the spread per case and group in .benchmarks/<machine>/noise-<cpu>-<n>cpus.json.
noise: setup
	$(PYTHON) -m pcvr_lib noise --runs $(NOISE_RUNS) --work $(RESULTS)/noise $(COMPARE_TESTS)

# Interleaved A-B-B-A runs of BASE (git revision or directory) and this tree, bootstrap interval per case.
ab: setup
	$(PYTHON) -m pcvr_lib compare --base $(BASE) --rounds $(AB_ROUNDS) --work $(RESULTS)/ab \
		$(foreach e,$(AB_ENV),--candidate-env $(e)) $(AB_FLAGS) $(COMPARE_TESTS)

report: setup
	$(PYTHON) -m pcvr_lib report $(BENCH_JSON) --view $(REPORT_VIEW)

data: setup
	$(PYTHON) -m pcvr_lib generate --schema fixtures/sample_1000_raw.schema.json --rows 1000 --multiplier 30

# ruff, then the import contracts of pyproject.toml's [tool.importlinter], then the module-level import cycles
lint: setup
	$(PYTHON) -m ruff check .
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PYTHON) tools/check_import_cycles.py pcvr_lib

clean:
	rm -rf $(RESULTS) .cache .pytest_cache .hypothesis
