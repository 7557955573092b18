# `make demo` and `make test` build .venv on first use and reuse it after.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch goes in first, then the lock file's exact versions of everything
# else (requirements/dev.lock, which leaves torch out), then trainstack itself, editable.
# On a GPU machine: make TORCH_SPEC=torch (any torch inside pyproject's range).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.trainstack-installed
LOCK := requirements/dev.lock
# uv installs the venv (cold caches: 16 s, where pip took 42 s resolving and installing the
# same lock; docs/installing.md). It reads none of pip's configuration, so the local wheel
# folders pip is pointed at (find-links: torch's CPU build lies in one on this project's
# machines) are handed to it too.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
FIND_LINKS := $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_LINKS := $(foreach folder,$(FIND_LINKS),--find-links $(folder))
# pip's notes about unreadable local index folders are noise here.
QUIET_PIP := { grep -v '^WARNING: Location' || true; }
# Bytecode is written as modules are first imported, in the venv and the tree alike: with
# PYTHONDONTWRITEBYTECODE set (as on some CI images) every process would compile what it
# imports from source again (torch's modules alone: 1 s a process; a test run starts
# hundreds). Python writes each file atomically, so processes importing side by side are
# safe.
unexport PYTHONDONTWRITEBYTECODE
# torch.compile's cache (inductor's generated code, 1.6 GB after a few suites) in the
# checkout, not in /tmp/torchinductor_$USER: a clean clone's `make test` compiles what CI
# compiles, instead of finding another checkout's kernels. One set in the environment wins.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/torchinductor

.PHONY: venv demo demo-stdlib test test-fast test-compat lock lint clean browser grafana

venv: $(STAMP)

# uv itself comes from PyPI through the venv's own pip. Nothing is compiled at install
# (uv compiles no bytecode unless asked); the first process to import a module writes its
# bytecode (the unexport above).
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv==$(UV_VERSION) 2>&1 | $(QUIET_PIP)
	$(UV) pip install -q --python $(PY) $(UV_LINKS) '$(TORCH_SPEC)'
	$(UV) pip install -q --python $(PY) $(UV_LINKS) -r $(LOCK)
	$(UV) pip install -q --python $(PY) --no-deps -e .
	$(PY) -c 'import torch, ray, deepspeed, mlflow, trainstack' >/dev/null 2>&1
	touch $(STAMP)

# The lock files, from pyproject.toml's ranges (needs the package index): dev.lock the
# newest release of each inside its range (against the CPU torch of requirements/dev.in),
# floor.lock the floors (requirements/floor.in), torch-top.lock the newest torch.
LOCK_FOR := --python-version 3.11 --python-platform x86_64-manylinux_2_28 --extra dev --extra hf -q
lock: $(STAMP)
	$(UV) pip compile pyproject.toml -c requirements/dev.in --no-emit-package torch \
		$(UV_LINKS) $(LOCK_FOR) -o $(LOCK)
	$(UV) pip compile pyproject.toml requirements/floor.in $(LOCK_FOR) -o requirements/floor.lock
	$(UV) pip compile pyproject.toml requirements/torch-top.in $(LOCK_FOR) \
		-o requirements/torch-top.lock

# A fresh demo each time: a rerun of a finished run would only report it.
demo: $(STAMP)
	rm -rf .cache/demo_runs/demo
	$(VENV)/bin/trainstack run jobs/configs/demo.yaml \
		--set checkpoint.storage_path=.cache/demo_runs --summary-json .cache/demo_summary.json

# A byte-level GPT on the standard library's sources, against gzip -9 and xz -9.
demo-stdlib: $(STAMP)
	rm -rf .cache/demo_runs/stdlib-gpt
	$(VENV)/bin/trainstack run jobs/configs/stdlib_gpt.yaml \
		--set checkpoint.storage_path=.cache/demo_runs --summary-json .cache/stdlib_summary.json

# ruff skips folders named dist unless they are named: tests/dist is.
LINTED := platform jobs tune tests tests/dist benchmarks examples dashboards

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy platform/trainstack

# Headless Chromium and its driver from Debian's packages, for the dashboard browser test
# (about 10 s as root; elsewhere, or without the packages, that test skips and says why).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	    { apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1; }; }; } || \
	  echo "make: no chromium/chromedriver here: the dashboard browser test will skip"

# mypy (about 45 s from a cold cache) beside a pytest run on every core (pytest-xdist).
WITH_MYPY = mkdir -p .cache; $(VENV)/bin/mypy platform/trainstack > .cache/mypy.log 2>&1 & typing=$$!; \
	  tests=0; $(PY) -m pytest $(1) || tests=$$?; \
	  typed=0; wait $$typing || typed=$$?; cat .cache/mypy.log; \
	  test $$tests -eq 0 && test $$typed -eq 0
# The unit tests need no Ray.
UNIT := $(call WITH_MYPY,tests/unit -n auto)

# `make test` runs the suite in two lanes side by side. The Ray lane (the tests that start
# Ray: tests/cluster, tests/e2e, tests/ray) runs one test at a time, on the console, at
# normal priority. The CPU lane (mypy and tests/unit, then the gloo processes of tests/dist
# and tests/gpu) runs at nice 19: it takes the CPU the Ray lane leaves idle while its
# actors start, poll and wait, and yields it whenever a Ray test wants it (side by side at
# equal priority both lanes slowed and the pair gained 8%; reniced, 20%). Its log is
# shown after the Ray lane's; each lane lists its own slowest tests. The Ray lane ends
# with two gloo-process modules (convergence runs, about 130 s on an idle machine): the
# CPU lane had grown the longer by more than that, and the Ray lane leaves its CPU idle
# while its actors wait.
IN_RAY_LANE := tests/dist/test_compression_training.py tests/dist/test_example_dpo.py
RAY_LANE := tests/cluster tests/e2e tests/ray $(IN_RAY_LANE)
CPU_LANE := first=0; { $(UNIT); } || first=$$?; \
	  gloo=0; $(PY) -m pytest tests/dist tests/gpu $(addprefix --ignore=,$(IN_RAY_LANE)) || gloo=$$?; \
	  test $$first -eq 0 && test $$gloo -eq 0
CPU_LOG := .cache/test-cpu-lane.log

test: $(STAMP) browser
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/lint-imports
	mkdir -p .cache
	nice -n 19 bash -eu -o pipefail -c '$(CPU_LANE)' > $(CPU_LOG) 2>&1 & cpu=$$!; \
	  echo "make: the CPU lane (mypy, tests/unit, tests/dist, tests/gpu) runs beside this one at nice 19; its log, $(CPU_LOG), follows"; \
	  ray=0; $(PY) -m pytest $(RAY_LANE) -o cache_dir=.cache/pytest-ray-lane || ray=$$?; \
	  cpu_rc=0; wait $$cpu || cpu_rc=$$?; \
	  echo "make: the CPU lane (exit $$cpu_rc):"; cat $(CPU_LOG); \
	  echo "make: Ray lane exit $$ray, CPU lane exit $$cpu_rc"; \
	  test $$ray -eq 0 && test $$cpu_rc -eq 0

# The inner loop: lint, types, and in one pytest run on every core the unit tests and the
# gloo-process layer less its tests marked slow (whole-run properties of engines whose
# equivalence tests stay: pyproject.toml's marker; `make test` runs them), a module's
# tests on one worker, which trains the module's reference runs once (the gloo layer's
# modules first: the many short unit modules then even out the workers' ends). Measured:
# docs/tests.md.
test-fast: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/lint-imports
	$(call WITH_MYPY,tests/dist tests/unit -m "not slow" -n auto --dist loadfile)

# The compatibility lane: tests/compat/smoke.txt's tests again in a venv of every floor
# (requirements/floor.lock) and, their [gloo] part, in one of the newest torch
# (requirements/torch-top.lock), each printing `trainstack doctor`'s table of what it runs.
# The two run side by side, the newest torch's at nice 19 (as `make test`'s lanes), its log
# printed after. Measured: docs/installing.md.
COMPAT := .cache/compat

# A venv of exactly a lock file's versions, its own torch among them, and trainstack
# editable.
$(COMPAT)/%/.installed: requirements/%.lock pyproject.toml | $(STAMP)
	rm -rf $(COMPAT)/$*
	$(PYTHON) -m venv $(COMPAT)/$*
	$(UV) pip install -q --python $(COMPAT)/$*/bin/python -r $<
	$(UV) pip install -q --python $(COMPAT)/$*/bin/python --no-deps -e .
	touch $@

# $(call COMPAT_RUN,venv,kinds): pytest on the smoke's lines of those kinds (a pytest
# argument file), DeepSpeed's ops and inductor's kernels in caches of the venv's own torch.
COMPAT_RUN = sed -n 's/^\[\($(2)\)\] //p' tests/compat/smoke.txt > $(COMPAT)/$(1).args; \
	export TORCH_EXTENSIONS_DIR=$(CURDIR)/$(COMPAT)/$(1)/torch_extensions \
	  TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/$(COMPAT)/$(1)/torchinductor; \
	$(COMPAT)/$(1)/bin/trainstack doctor | sed -n '/^libraries here/,/^$$/p'; \
	$(COMPAT)/$(1)/bin/python -m pytest -p no:cacheprovider @$(COMPAT)/$(1).args

test-compat: $(COMPAT)/floor/.installed $(COMPAT)/torch-top/.installed
	nice -n 19 bash -eu -o pipefail -c "$(call COMPAT_RUN,torch-top,gloo)" \
	  > $(COMPAT)/torch-top.log 2>&1 & top=$$!; \
	  echo "make: the floors' venv; the newest torch's runs beside it, its log follows"; \
	  floor=0; $(call COMPAT_RUN,floor,gloo\|ray) || floor=$$?; \
	  top_rc=0; wait $$top || top_rc=$$?; \
	  echo "make: the newest torch (exit $$top_rc):"; cat $(COMPAT)/torch-top.log; \
	  echo "make: floors exit $$floor, newest torch exit $$top_rc"; \
	  test $$floor -eq 0 && test $$top_rc -eq 0

# trainstack's Grafana dashboard into the newest Ray session's provisioning (ray start first).
grafana: $(STAMP)
	$(PY) dashboards/provision.py

clean:
	rm -rf $(VENV) .cache
