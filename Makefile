# The two commands of the README. Both create .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shoal-installed

.PHONY: demo test bench clean

# torch is installed first, pinned, from the local CPU wheel, so that the
# project's `torch>=2.1` is already satisfied and pip never pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m shoal.bench.overhead --workers 2 --steps 10 --rounds 2

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) results .pytest_cache
