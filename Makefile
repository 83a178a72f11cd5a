# Two commands a new user needs: `make demo` and `make test`.
# Each creates .venv and installs what it needs there: `make demo` the
# package's dependencies alone (a few seconds), `make test` the package
# (editable) with its test extra at the versions of constraints/test.txt.
# Both make sure PostgreSQL and Redis answer (starting them when installed
# but down), then run.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sa-fence-installed
# For `make demo`: the package's dependencies, none of the test extra.
DEMO_STAMP := $(VENV)/.sa-fence-demo-installed
# The exact versions the tests ran with (the extras give ranges only).
CONSTRAINTS := constraints/test.txt

.PHONY: demo test test-floors test-floors-suites test-floors-topologies lint typecheck bench dashboard chaos services topology-tools docs-tools docs dist clean sqlalchemy-suite sqlalchemy-suite-floors

# Fast on purpose (`make demo` from a fresh clone in about 15 s on a busy
# 2-core machine): the demo needs the package's dependencies and its source,
# not a build of it, so it gets the dependencies of pyproject.toml alone and
# runs the checkout's sa_fence (`python -m sa_fence demo`); building the
# editable wheel in an isolated environment took half of `pip install -e .`.
# The venv gets no pip of its own when $(PYTHON)'s pip can install into it
# (pip >= 22.3: --python), and modules are compiled when first imported.
DEPENDENCIES := $(PYTHON) -c 'import shlex, tomllib; print(*map(shlex.quote, tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))'

$(DEMO_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "sa-fence needs Python >= 3.11; set PYTHON=python3.11")'
	$(PYTHON) -m venv --without-pip $(VENV)
	@deps=$$($(DEPENDENCIES)) && \
	if $(PYTHON) -m pip --python $(PY) --version >/dev/null 2>&1; then \
	  echo "$(PYTHON) -m pip --python $(PY) install --quiet --no-compile $$deps"; \
	  eval "$(PYTHON) -m pip --python $(PY) install --quiet --no-compile $$deps"; \
	else \
	  echo "$(PY) -m ensurepip && $(PY) -m pip install --quiet --no-compile $$deps"; \
	  $(PY) -m ensurepip --default-pip >/dev/null && \
	  eval "$(PY) -m pip install --quiet --no-compile $$deps"; \
	fi
	@touch $(DEMO_STAMP)

# $(STAGE) runs a step under a name (.ci/stage): a failure says which step
# failed and the command that re-runs it alone; with -w, a step quiet for long
# (pip, mypy, apt-get) prints a line every 30 s while it runs.
STAGE := bash .ci/stage

$(STAMP): $(DEMO_STAMP) pyproject.toml $(CONSTRAINTS)
	@$(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip --default-pip >/dev/null
	$(STAGE) -w "upgrading pip in $(VENV)" $(PY) -m pip install --quiet --upgrade pip
	$(STAGE) -w "installing sa-fence (editable) with its test extra into $(VENV)" \
	  $(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	@touch $(STAMP)

services:
	@$(STAGE) services bash .ci/services

# redis-server, openssl and pgbouncer for tests/topologies (installed if missing).
topology-tools:
	@$(STAGE) -w topology-tools bash .ci/topology-tools

# chromium, for the browser test of the docs' diagrams (installed if missing).
docs-tools:
	@$(STAGE) -w docs-tools bash .ci/docs-tools

demo: $(DEMO_STAMP) services
	$(PY) -m sa_fence demo

lint: $(STAMP)
	$(STAGE) lint $(VENV)/bin/ruff check sa_fence tests docs/recipes docs_hooks.py
	$(STAGE) lint $(VENV)/bin/ruff format --check sa_fence tests docs/recipes docs_hooks.py

typecheck: $(STAMP)
	$(STAGE) -w typecheck $(VENV)/bin/mypy

# PYTEST_ARGS: e.g. -m "not slow" for the fast subset.  The suite runs on
# PYTEST_WORKERS processes (pytest-xdist; each creates and drops a database of
# its own), a test file to a worker: most of a test's time is spent waiting
# for the servers, so four workers on two cores take a third of the time of one
# (the longest files go out first: tests/conftest.py's LONGEST_FIRST).
# PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 4
XDIST = -n $(PYTEST_WORKERS) --dist loadfile
# Each step runs as a named stage ($(STAGE), test-floors' steps in there): a
# failure names the stage and the command that re-runs it alone, and pytest
# lists the failed tests' ids (tests/conftest.py).
# .ci/tests packs the test stages onto the cores: pytest, then test-floors' steps, while
# SQLAlchemy's suites (sqlalchemy-suite, sqlalchemy-suite-floors) run niced beside them.
test: lint typecheck services topology-tools docs-tools
	@PY=$(PY) FLOORS_PY=$(FLOORS_VENV)/bin/python FLOORS_STAMP=$(FLOORS_STAMP) \
	  bash .ci/tests $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The suites that exercise SQLAlchemy, psycopg, redis-py and Alembic, run
# again with the lowest versions pyproject.toml allows (constraints/floors.txt),
# in a venv of their own, without the test extra's frameworks, on PYTEST_WORKERS
# processes: about a minute and a half.
FLOORS_VENV := .venv-floors
FLOORS_STAMP := $(FLOORS_VENV)/.sa-fence-installed
FLOORS := constraints/floors.txt
FLOOR_TESTS := tests/orm/test_fenced_flush.py tests/scope/test_scope_trigger.py \
	tests/scope/test_scope_fallback.py tests/orm/test_session_binds.py tests/orm/test_upsert.py \
	tests/scope/test_lease_scope.py tests/db/test_guard.py tests/lease/test_lifecycle.py \
	tests/lease/test_async.py tests/lease/test_timeouts.py tests/db/test_token_connection.py \
	tests/integrations/test_decorator_sessions.py tests/db/test_register.py \
	tests/db/test_grant_checks.py tests/db/test_fitness.py tests/integrations/test_alembic.py \
	tests/lease/test_confirm_withdraw.py tests/orm/test_expression_properties.py \
	tests/orm/test_fence_assignment.py tests/orm/test_call_cache.py tests/db/test_create_guard.py \
	tests/lease/test_async_tasks.py tests/integrations/test_side_effects.py \
	tests/integrations/test_telemetry.py tests/orm/test_inheritance_shapes.py \
	tests/scope/test_scope_between.py

$(FLOORS_STAMP): pyproject.toml $(FLOORS)
	$(STAGE) -w "creating $(FLOORS_VENV)" $(PYTHON) -m venv $(FLOORS_VENV)
	$(STAGE) -w "installing the lowest versions ($(FLOORS)) into $(FLOORS_VENV)" \
	  $(FLOORS_VENV)/bin/python -m pip install --quiet -c $(FLOORS) -e '.[asyncio,otel,side-effects]' \
	  greenlet opentelemetry-sdk pytest pytest-asyncio pytest-timeout pytest-xdist hypothesis
	@touch $(FLOORS_STAMP)

# (redis-py's Cluster and Sentinel clients change most between releases: their
# topology tests run there too, on private servers, in about 45 s.)
# (make test runs the two apart: the topologies beside pytest, the suites after it.)
test-floors: test-floors-suites test-floors-topologies

test-floors-suites: $(FLOORS_STAMP) services
	$(STAGE) test-floors $(FLOORS_VENV)/bin/python -m pytest $(XDIST) -m "not slow" -p no:cacheprovider $(FLOOR_TESTS)

test-floors-topologies: $(FLOORS_STAMP) services topology-tools
	$(STAGE) test-floors-topologies $(FLOORS_VENV)/bin/python -m pytest -p no:cacheprovider tests/topologies/test_redis_topologies.py

# SQLAlchemy's own tests (from the sdist of the installed version, downloaded
# once into .venv/sqlalchemy-suite), run with sa-fence installed on every
# Session and compared with the plain run: any outcome that differs fails
# (tests/sqlalchemy_suite/).  The plain run's outcomes are recorded per
# SQLAlchemy version (tests/sqlalchemy_suite/recorded/; SQLA_ARGS=--record
# records them anew, SQLA_ARGS=--side-by-side runs both modes), and where the
# fenced run differs from the recording both modes run again side by side.
# About 2 minutes on one core.  `make test` runs them twice: with the pinned
# SQLAlchemy (.venv) and with the lowest one pyproject.toml allows
# (.venv-floors), since sa-fence's hooks meet different internals in each;
# `make sqlalchemy-suite-floors` is the second alone.
sqlalchemy-suite: $(STAMP) services
	$(STAGE) sqlalchemy-suite $(PY) -m tests.sqlalchemy_suite $(SQLA_ARGS)

sqlalchemy-suite-floors: $(FLOORS_STAMP) services
	$(STAGE) sqlalchemy-suite-floors $(FLOORS_VENV)/bin/python -m tests.sqlalchemy_suite $(SQLA_ARGS)

# The docs site (mkdocs-material) into site/; `make test` runs the same build
# with --strict (tests/project/test_docs_site.py).
# Mermaid (for the diagrams) is fetched once with npm into .cache/ and served
# with the site, so the diagrams render offline too.
docs: $(STAMP)
	$(PY) docs_hooks.py fetch-mermaid
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The sdist and the wheel into dist/, checked as a package index would check
# them (tests/project/test_packaging.py builds and checks the same in a temporary folder).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

# The peers (python-redis-lock, pottery) and matplotlib come from the `bench` extra.
BENCH_STAMP := $(VENV)/.sa-fence-bench-installed

$(BENCH_STAMP): $(STAMP) pyproject.toml $(CONSTRAINTS)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,bench]'
	@touch $(BENCH_STAMP)

# BENCH_ARGS go to `python -m tests.benchmarks` (e.g. BENCH_ARGS=--strict:
# exit 1 when a target is missed); --strict and --quick also go to the
# telemetry benchmark.  Both always run; the recipe fails with the first
# failure's status (make itself then exits 2).
BENCH_ARGS ?=
bench: $(BENCH_STAMP) services
	@status=0; \
	echo "$(PY) -m tests.benchmarks $(BENCH_ARGS)"; \
	$(PY) -m tests.benchmarks $(BENCH_ARGS) || status=$$?; \
	echo "$(PY) -m tests.benchmarks.telemetry $(filter --strict --quick,$(BENCH_ARGS))"; \
	$(PY) -m tests.benchmarks.telemetry $(filter --strict --quick,$(BENCH_ARGS)) || \
	  { rc=$$?; [ $$status -ne 0 ] || status=$$rc; }; \
	exit $$status

# The sample dashboard of docs/observability.md, from a 30 s run.
dashboard: $(BENCH_STAMP) services
	$(PY) -m tests.benchmarks.dashboard

# The Jepsen-style harness (tests/chaos/, docs/reliability.md): about 10,000
# fenced operations under faults, then the same run unfenced; private servers
# only (a PostgreSQL cluster and a redis-server of its own), a few minutes.
chaos: $(STAMP)
	$(PY) -m tests.chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) $(FLOORS_VENV) .pytest_cache .mypy_cache .ruff_cache site .cache
