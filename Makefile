# The two commands a user needs: `make demo` and `make test`.
# Each creates .venv and installs what it needs when missing.

PYTHON_FOR_VENV ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast test-mindformers lint docs demo proto bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON_FOR_VENV) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[worker,dev]'
	@touch $(STAMP)

# Every test, on three pytest-xdist workers: two run the integration tests' two lanes (tests/conftest.py), the
# third the rest beside them, a file at a time (each file is a group: its module fixtures are made once).
# --no-loadscope-reorder: the groups in collection order, lanes first (else the largest group goes first).
# --basetemp: a short directory, as an agent's unix sockets live in its work directory under a test's tmp_path,
# and a socket's path has at most 107 bytes. A fixed one, which pytest empties as each run starts: a run leaves
# up to ~9 GB of clusters' files there (etcd preallocates 64 MB WALs), kept for a look after a failure; a
# directory per run filled this machine's disk within a day. (Two runs of one target at once would share it.)
TEST_TMP = /tmp/trainerd-tests
test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadgroup --no-loadscope-reorder --durations=40 --basetemp=$(TEST_TMP) tests

# The inner loop: every test that starts no MindSpore process (not marked `mindspore`). Four workers whatever
# the cores: much of these tests' time is waiting (timeouts, leases, backoffs), so on 2 cores four workers
# take 2 minutes where two take 3.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 4 --dist loadgroup -m "not mindspore" --basetemp=$(TEST_TMP)-fast tests

# Opt-in, and not in CI's `make test`: MindFormers 2.0.0 cannot be resolved by pip (it requires hyper-parallel,
# which is not on PyPI), so it goes into a venv of its own without its dependencies, after the extra that lists
# them (docs/jobs/mindformers.md). About 3.5 GB; the suite takes ~2.5 min on 2 cores.
MF_VENV := .venv-mindformers
MF_PY := $(MF_VENV)/bin/python
MF_STAMP := $(MF_VENV)/.installed

$(MF_STAMP): pyproject.toml
	@test -x $(MF_PY) || python3.11 -m venv $(MF_VENV)
	$(MF_PY) -m pip install --quiet --upgrade pip
	$(MF_PY) -m pip install --quiet -e '.[worker,mindformers,dev]'
	$(MF_PY) -m pip install --quiet --no-deps mindformers==2.0.0
	@touch $(MF_STAMP)

test-mindformers: $(MF_STAMP)
	$(MF_PY) -m pytest -q tests/mindformers_real

lint: docs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy daemon agent proto common trainer scripts

# The documentation site (mkdocs.yml, docs/), into build/site. --strict: a dead link, a missing anchor or a page
# left out of the navigation fails it (not with --quiet, which hides the warnings --strict counts). The reference
# pages are generated from the code as it builds.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d build/site

demo: $(STAMP)
	$(PY) scripts/demo.py

proto: $(STAMP)
	$(PY) -m proto.generate

clean:
	rm -rf $(VENV) $(MF_VENV) run build *.egg-info
