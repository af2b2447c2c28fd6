# `make run` and `make test` create the virtual environment on first use from the pinned lock file.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIPELINE ?= train_deploy

# Kedro telemetry never prompts or phones home (settings.py also disables the plugin's hooks).
export KEDRO_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1

.PHONY: run test viz bench lock clean-data

$(STAMP): requirements.lock pyproject.toml setup.py src/train_deploy/corpus/_fast.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "pip==26.3"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

run: $(STAMP)
	$(BIN)/kedro run --pipeline $(PIPELINE)

test: $(STAMP)
	$(BIN)/python -m pytest

# The pipeline picture: a static Kedro-Viz site in build/ (view it with `python -m http.server -d build`).
# `kedro viz build` exits 0 even when the project fails to load, and draws a dataset it cannot build as a
# MemoryDataset, so every dataset of the pipeline is built first and the pipeline's page is checked after.
viz: $(STAMP)
	$(BIN)/kedro catalog describe-datasets --pipeline $(PIPELINE) > /dev/null
	rm -rf build
	$(BIN)/kedro viz build
	test -s build/api/deploy-viz-metadata && test -s build/api/pipelines/$(PIPELINE) \
		|| { echo "kedro viz build wrote no page for pipeline $(PIPELINE): see its ERROR above" >&2; exit 1; }

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_tokenize.py

# Re-resolve the lock file from requirements.in (maintainers only).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet -r requirements.in
	.venv-lock/bin/pip freeze --exclude-editable > requirements.lock
	rm -rf .venv-lock

clean-data:
	rm -rf data/04_feature/tokens data/06_models/tokenizer data/08_reporting/* mlruns.db mlartifacts
