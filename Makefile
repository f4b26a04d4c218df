# Every target works from a fresh clone with nothing but Python 3.11 installed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint smoke train-nmt eval-nmt train-amoebanet eval-amoebanet bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

lint: install
	$(VENV)/bin/ruff check gpipe_core tests
	$(VENV)/bin/mypy gpipe_core

bench: install
	$(PY) scripts/bench_overhead.py

clean:
	rm -rf $(VENV) .cache
