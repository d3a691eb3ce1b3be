# ebpfprofiler: `make setup`, `make run`, `make test`, `make bench`: as root.
# `make lint` and `make unit` also work as an ordinary user in a venv of `pip install -e '.[dev]'`
# (docs/development.md).
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= deploy/agent.yaml
# more options for `ebpfprofiler run` (e.g. RUN_ARGS="--run-dir DIR --state-dir DIR")
RUN_ARGS ?=
# KERNEL=VER[,VER...]: set up the header trees of these kernels, not the running one's
# (a chroot or an image that will boot them; deploy/setup.sh --kernel)
KERNEL ?=
SETUP_ARGS := $(if $(KERNEL),--kernel "$(KERNEL)")

.PHONY: setup test-setup run record test test-assets lint unit integration bench clean

## setup: install what running the agent needs (idempotent; Debian 12, as root)
setup:
	@bash deploy/setup.sh $(SETUP_ARGS)

## test-setup: setup, plus the test tools: Debian packages (runtimes, browser, qemu, ...) and requirements-dev.txt
test-setup:
	@bash deploy/setup.sh --test $(SETUP_ARGS)

## run: profile this host with every stage in the foreground (Ctrl-C stops)
run: setup
	$(VENV)/bin/ebpfprofiler run --config $(CONFIG) $(RUN_ARGS)

## record: profile the whole host for 30 s into profile.html (RECORD_ARGS: other `ebpfprofiler record` options)
RECORD_ARGS ?= -d 30 -o profile.html
record: setup
	$(VENV)/bin/ebpfprofiler record $(RECORD_ARGS)

## test-assets: fetch the runtimes and Debian roots the tests profile, side by side (cached)
test-assets: test-setup
	$(PY) -m tests.assets

## test: every test, unit and integration (real BPF, real processes)
test: test-setup test-assets
	$(PY) -m pytest -v --durations=40 tests

## lint: ruff check, ruff format --check and mypy on the whole tree (no root, no set-up beyond the dev venv)
lint: dev-venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

## unit: the unit tests (no root, no BPF; recorded data and real files only)
unit: dev-venv
	$(PY) -m pytest -q tests/unit

# The venv lint and unit run in: make test-setup's (as root), or an ordinary user's
# `python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'`.
.PHONY: dev-venv
dev-venv:
	@test -x $(VENV)/bin/ruff -a -x $(VENV)/bin/mypy -a -x $(VENV)/bin/pytest || { \
	  echo "no dev venv: python3 -m venv $(VENV) && $(VENV)/bin/pip install -e '.[dev]'  (or, as root, make test-setup)" >&2; \
	  exit 2; }

integration: test-setup test-assets
	$(PY) -m pytest -v tests/integration

## bench: speed and overhead figures into bench/results/, and a table
bench: test-setup
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) build *.egg-info

## install: the agent as systemd units in the standard places (as root; see README, "Deployment with systemd")
.PHONY: install uninstall
install:
	@bash deploy/install.sh

## uninstall: stop the agent and remove what install put in place; PURGE=1 also removes config and state
uninstall:
	@PURGE=$(PURGE) bash deploy/uninstall.sh

## test-kernels: boot Debian's kernels under qemu (TCG here; 4-6 min each) and run a smoke test of the
## agent in each; a table, one row per kernel (KERNELS=bullseye,bookworm for a subset; results in
## bench/results/kernels/)
KERNELS ?= bullseye,bookworm,bookworm-backports,trixie,sid
.PHONY: test-kernels
test-kernels: test-setup
	$(PY) -m tests.kernels --kernels $(KERNELS)
