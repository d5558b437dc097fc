# The README's two commands: `make run` (the demo on the embedded stack) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench fuzz chaos install clean

# Exact versions from constraints.txt; the package itself declares compatible ranges.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[server,test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/agent-radar demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The linter and formatter (ruff, with import sorting) over the tree, and the type checker
# (mypy) over the rules, the adapters and the models; CI runs this before the suite.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# A long hostile-input campaign (Hypothesis) on both backends, and the fence's random walks
# (AGENT_RADAR_WALK_SCHEDULES per backend); the suite runs short ones.
fuzz: $(STAMP)
	AGENT_RADAR_FUZZ_EXAMPLES=$${AGENT_RADAR_FUZZ_EXAMPLES:-2000} \
	AGENT_RADAR_WALK_SCHEDULES=$${AGENT_RADAR_WALK_SCHEDULES:-2000} \
	$(BIN)/python -m pytest -q --timeout=0 tests/faults/test_fuzz.py tests/faults/test_fuzz_headers.py tests/faults/test_fuzz_control.py tests/faults/test_fuzz_broker.py \
		tests/faults/test_fence_walk.py $(PYTEST_ARGS)

# Server nodes lost under load at scale: a PostgreSQL primary killed and its replica promoted,
# a RabbitMQ cluster node killed and restarted (tests/chaos/); the suite runs short forms.
chaos: $(STAMP)
	AGENT_RADAR_CHAOS=full $(BIN)/python -m pytest -q --timeout=0 tests/chaos $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/agent-radar bench

clean:
	rm -rf $(VENV) .agent-radar .pytest_cache
