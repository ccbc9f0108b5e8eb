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

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The default comparison (docs/BENCHMARKS.md): 4 workers, 150 training seconds
# per strategy, about 12 minutes in all on 2 CPU cores. Emulated 4 hosts x
# 20 mbit when run as root (ip, tc); loopback, unshaped, otherwise.
# Each strategy issue adds its name to BENCH_STRATEGIES.
BENCH_STRATEGIES := ddp,torch-ddp,local,nosync,powersgd,diloco-h20
bench: $(STAMP)
	$(BIN)/shoal bench --task lm --strategies $(BENCH_STRATEGIES) --hosts 4 --bandwidth 20mbit \
		--time-budget 150 --seed 0 --run bench-$$(date +%Y%m%d-%H%M%S)

# A short bench (under 5 minutes): the same comparison, 30 training seconds per strategy.
demo: $(STAMP)
	$(BIN)/shoal bench --task lm --strategies $(BENCH_STRATEGIES) --hosts 4 --bandwidth 20mbit \
		--time-budget 30 --seed 0 --run demo-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf $(VENV) results .pytest_cache
