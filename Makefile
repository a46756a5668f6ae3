# The two commands a user needs (see README.md):
#   make demo   set up (once) and run Maru's main job on the embedded default
#   make test   set up (once) and run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# Test processes (pytest-xdist, a whole test file to each): most of the suite waits on servers,
# engines and timeouts, so two overlap well even on a 2-core machine (806 s in one process, 447-524 s in two there).
TEST_WORKERS ?= 2

.PHONY: setup demo test lint bench-rpc clean

setup: $(VENV)/.maru-setup

$(VENV)/.maru-setup: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

demo: setup
	$(VENV)/bin/maru demo

test: setup
	$(PY) -m ruff check maru tests bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(PY) -m ruff check maru tests bench
	$(PY) -m ruff format --check maru tests bench

bench-rpc: setup
	$(PY) bench/rpc.py

clean:
	rm -rf $(VENV) build *.egg-info
