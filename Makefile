# The two commands: `make quickstart` and `make test`. Each sets up .venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: quickstart test test-fast lint venv lock clean

# Reinstall only when the dependency pins change; otherwise this is a no-op.
$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (lowcomm needs Python 3.11)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing lowcomm and its pinned dependencies into $(VENV) (a few minutes, once)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(PY) -m pip check
	@# compile lowcomm's CPU kernels now rather than in a run's first step (a failure only warns)
	$(VENV)/bin/lowcomm-build-kernels
	@touch $(STAMP)

venv: $(STAMP)

quickstart: $(STAMP)
	$(PY) -m lowcomm.cli.quickstart

# The suite on TEST_WORKERS pytest processes (pytest-xdist), a test file to each at a time: its
# end-to-end runs wait on process start-up, SLURM and links, and two of them fill two cores.
# Files start in collection order (--no-loadscope-reorder: xdist would start the files with the
# most tests first, leaving the long few-test ones for last), longest first (tests/conftest.py).
# TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# The suite without multi-process end-to-end runs and the local SLURM, for the edit loop (within
# 90 s on two cores): its tests are short and independent, so they go to the workers one by one.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not slurm" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist load) $(PYTEST_ARGS)

# Style, and the layer contract in pyproject.toml (which part of lowcomm may import which).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks analysis
	$(VENV)/bin/lint-imports

lock: $(STAMP)
	{ head -2 constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; \
	  echo "torch==2.13.0"; } > constraints.txt.tmp && mv constraints.txt.tmp constraints.txt

clean:
	rm -rf $(VENV) runs
