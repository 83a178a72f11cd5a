# Two commands a new user needs: `make demo` and `make test`.
# Each creates .venv, installs the package with its test deps, makes sure
# PostgreSQL and Redis answer (starting them when installed but down), then runs.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sa-fence-installed

.PHONY: demo test lint typecheck bench dashboard chaos services topology-tools docs clean sqlalchemy-suite

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "sa-fence needs Python >= 3.11; set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

services:
	@bash .ci/services

# redis-server, openssl and pgbouncer for tests/topologies (installed if missing).
topology-tools:
	@bash .ci/topology-tools

demo: $(STAMP) services
	$(VENV)/bin/sa-fence demo

lint: $(STAMP)
	$(VENV)/bin/ruff check sa_fence tests docs/recipes docs_hooks.py
	$(VENV)/bin/ruff format --check sa_fence tests docs/recipes docs_hooks.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck services topology-tools
	$(PY) -m pytest
	$(PY) -m tests.sqlalchemy_suite

# SQLAlchemy's own tests (from the sdist of the installed version, downloaded
# once into .venv/sqlalchemy-suite), run plain and with sa-fence installed on
# every Session: any outcome that differs fails (tests/sqlalchemy_suite/).
# About 3 minutes on 2 idle cores (both modes run side by side).
sqlalchemy-suite: $(STAMP) services
	$(PY) -m tests.sqlalchemy_suite

# The docs site (mkdocs-material) into site/; `make test` runs the same build
# with --strict (tests/test_docs_site.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The peers (python-redis-lock, pottery) and matplotlib come from the `bench` extra.
BENCH_STAMP := $(VENV)/.sa-fence-bench-installed

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) services
	$(PY) -m tests.benchmarks
	$(PY) -m tests.benchmarks.telemetry

# The sample dashboard of docs/observability.md, from a 30 s run.
dashboard: $(BENCH_STAMP) services
	$(PY) -m tests.benchmarks.dashboard

# The Jepsen-style harness (tests/chaos/, docs/reliability.md): about 10,000
# fenced operations under faults, then the same run unfenced; private servers
# only (a PostgreSQL cluster and a redis-server of its own), a few minutes.
chaos: $(STAMP)
	$(PY) -m tests.chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
