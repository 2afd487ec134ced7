# Two commands do all the set-up on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Both create .venv and install. TORCH selects the torch requirement installed before the package:
# the CPU wheel by default; set TORCH= (empty) to keep a torch you already have in .venv.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install browser demo test test-slow lint clean

$(BIN)/stratagem: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	if [ -n "$(TORCH)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -e ".[dev]"
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

test: lint browser
	$(BIN)/pytest -q

test-slow: install
	$(BIN)/pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
