# specrouter: `make demo` runs the product on the simulator; `make test` installs and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: test demo bench lint typecheck check redis clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

# `make bench` also needs the peer router of the `peer` scenario (sglang-router).
$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PIP) install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

redis:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = "0" ]; then \
		echo "installing Debian's redis-server"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; \
	else \
		echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server) and rerun make test" >&2; \
		exit 1; \
	fi

# The whole suite against the simulator speaking SGLang 0.5.23 (its default), then the
# integration suite again against 0.5.10: the router meets both releases. Two workers
# (pytest-xdist): most tests wait on processes and sockets, not on the CPU.
test: $(STAMP) redis
	$(VENV)/bin/pytest -q -n 2
	SPECROUTER_SIM_SGLANG_VERSION=0.5.10 $(VENV)/bin/pytest -q -n 2 tests/integration

lint: $(STAMP)
	$(VENV)/bin/ruff check specrouter tests loadtest
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(VENV)/bin/specrouter demo

bench: $(BENCH_STAMP) redis
	$(PY) -m loadtest.bench --report docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
