# Two commands do all the set-up on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create .venv and install. TORCH selects the torch requirement installed before the package:
# the CPU wheel by default; set TORCH= (empty) to keep a torch you already have in .venv.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install browser postgres automodel demo test test-integration test-all test-slow lint clean wheelhouse wheelhouse-calibrate

$(BIN)/stratagem: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	if [ -n "$(TORCH)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -e ".[dev,postgres,cluster]"
	touch $(BIN)/stratagem

install: $(BIN)/stratagem

demo: install
	$(BIN)/stratagem search examples/demo-cpu.yaml --real-runs 6

lint: install
	$(BIN)/ruff check stratagem tests bench
	$(BIN)/mypy

# The report's browser tests use Debian's chromium; installed when missing and we are root, else they skip.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium not installed: browser tests will skip"

# The storage/claims tests start a throw-away PostgreSQL server (tests/search/conftest.py) from Debian's
# postgresql: installed here when missing and we are root, else those tests skip saying why.
postgres:
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) || \
	  echo "postgresql not installed: PostgreSQL tests will skip"

# The automodel export test runs NeMo Automodel 0.7.0's own config parsers: its wheel without its dependencies
# (transformers, Transformer Engine, DeepEP: the parsers import none of them); the test skips without it.
automodel: install
	@$(BIN)/python -c "import nemo_automodel" 2>/dev/null || $(BIN)/pip install -q --no-deps "nemo-automodel==0.7.0" || \
	  echo "nemo-automodel not installed: its parser test will skip"

# `make test`: lint and the default suite on two pytest-xdist workers, each test file on one worker (`--dist loadfile`:
# a file's module fixtures start once), under 10 minutes on 2 cores (714 s on one worker, 413 s on two, quiet);
# the 25 slowest tests are listed. The integration suites stay on one worker: their runs use every core.
# `make test-all`: that, then the integration and slow suites (tests/conftest.py INTEGRATION; what CI runs).
test: lint browser postgres automodel
	$(BIN)/pytest -q -n 2 --dist loadfile --durations=25

test-integration: install browser postgres automodel
	$(BIN)/pytest -q -m "integration or slow" --durations=25

test-all: test test-integration

test-slow: install
	$(BIN)/pytest -q -m slow

# Offline installs (scripts/wheelhouse.sh): `make wheelhouse PY=3.12` downloads wheels of every dependency except
# torch for that Python version; wheelhouse-calibrate only what `stratagem calibrate` needs (for gpu_check.sh).
# Here PY is a version (3.12); any other value of PY means 3.12.
WHEEL_PY = $(if $(filter 3.%,$(PY)),$(PY),3.12)
wheelhouse:
	scripts/wheelhouse.sh --python-version $(WHEEL_PY)

wheelhouse-calibrate:
	scripts/wheelhouse.sh --calibrate --python-version $(WHEEL_PY)

clean:
	rm -rf $(VENV) build *.egg-info
