# The two commands a user needs: `make demo` and `make test`.
# Each creates .venv and installs what it needs when missing.

PYTHON_FOR_VENV ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test lint demo proto bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON_FOR_VENV) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[worker,dev]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy daemon agent proto common trainer scripts

demo: $(STAMP)
	$(PY) scripts/demo.py

proto: $(STAMP)
	$(PY) -m proto.generate

clean:
	rm -rf $(VENV) run build *.egg-info
