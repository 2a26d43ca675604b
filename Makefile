# One set of commands for humans, hooks and CI.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Python 3.13: pyenv's newest 3.13.x when present, else python3.13 on PATH; each must answer -V
# (pyenv's shim is on PATH even when it has no 3.13 to run).
PYTHON313 ?= $(shell for p in $$(ls -d $$HOME/.pyenv/versions/3.13*/bin/python3.13 2>/dev/null | sort -V | tail -1) $$(command -v python3.13); do "$$p" -V >/dev/null 2>&1 && { echo "$$p"; break; }; done)

.PHONY: help venv constraints system-deps run bench-report test test-unit test-integration test-e2e test-faults lint fmt typecheck bench clean

help:
	@echo "make run        the whole system on this machine (RabbitMQ + MongoDB or its stand-in + 5 services)"
	@echo "make test       lint, type check and the whole test suite"
	@echo "make bench      the benchmark (not part of make test)"

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -n "$(PYTHON313)" || { echo "Python 3.13 not found (set PYTHON313=/path/to/python3.13)"; exit 1; }
	test -x $(PY) || $(PYTHON313) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

# After changing dependencies: the versions installed now become every fresh install's.
constraints: venv
	{ sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^py-spy=='; } > constraints.tmp
	mv constraints.tmp constraints.txt

venv: $(VENV)/.installed

run: venv
	$(PY) -m devtools.stack run

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: venv
	$(VENV)/bin/mypy

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-integration: venv
	$(PY) -m pytest tests/integration -q

test-e2e: venv
	$(PY) -m pytest tests/e2e -q

# The fault tests, slow ones included, then their figures into the README's reliability section.
test-faults: venv
	SCOREBOX_SLOW_TESTS=1 $(PY) -m pytest tests/faults -q
	$(PY) -m devtools.reliability

# Debian's docker-compose checks compose.yaml (no Docker engine needed); skipped with a reason
# by the test when it cannot be installed.
system-deps:
	@command -v docker-compose >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose) >/dev/null 2>&1; } || \
	  echo "note: docker-compose not installed; the compose check will be skipped"

test: lint typecheck system-deps
	SCOREBOX_SLOW_TESTS=1 $(PY) -m pytest -q

$(VENV)/.bench-installed: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $@

# The benchmark (not part of make test), then its figures into the README's performance section.
bench: $(VENV)/.bench-installed
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.report

bench-report: venv
	$(PY) -m bench.report

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .run
