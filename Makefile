# `make run` and `make test` create the virtual environment on first use from the pinned lock file.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIPELINE ?= train_deploy

# Paddle wheel flavour: DEVICE=cpu installs requirements.lock (paddlepaddle), DEVICE=gpu installs
# requirements-gpu.lock (paddlepaddle-gpu from Paddle's index for CUDA). A venv records the flavour it was
# built with (VENV_DEVICE, VENV_CUDA in $(VENV)/.flavour.mk), and that is the default afterwards, so a plain
# `make test` keeps a GPU venv a GPU venv instead of installing the CPU lock over it. A venv without the
# record is a CPU one (every venv before the record was).
-include $(VENV)/.flavour.mk
DEVICE ?= $(or $(VENV_DEVICE),cpu)
CUDA   ?= $(or $(VENV_CUDA),cu126)
# The CUDA builds Paddle 3.3 publishes, each on its own index.
PADDLE_CUDA_BUILDS := cu118 cu126 cu129 cu130
PADDLE_INDEX = https://www.paddlepaddle.org.cn/packages/stable/$(CUDA)/

ifeq ($(DEVICE),cpu)
LOCK         := requirements.lock
PADDLE       := paddlepaddle
OTHER_PADDLE := paddlepaddle-gpu
INDEX_ARGS   :=
else ifeq ($(DEVICE),gpu)
ifeq ($(filter $(CUDA),$(PADDLE_CUDA_BUILDS)),)
$(error CUDA=$(CUDA): Paddle 3.3's GPU wheel is built for CUDA=$(PADDLE_CUDA_BUILDS) (pick the newest your driver runs))
endif
LOCK         := requirements-gpu.lock
PADDLE       := paddlepaddle-gpu
OTHER_PADDLE := paddlepaddle
INDEX_ARGS   := --extra-index-url $(PADDLE_INDEX)
else
$(error DEVICE=$(DEVICE): DEVICE takes cpu or gpu)
endif

# Building another flavour than the venv's reinstalls it even when its stamp is newer than every lock.
flavour = $(1)$(if $(filter gpu,$(1)),-$(2))
ifneq ($(call flavour,$(DEVICE),$(CUDA)),$(call flavour,$(or $(VENV_DEVICE),cpu),$(VENV_CUDA)))
$(STAMP): FORCE
endif

# Kedro telemetry never prompts or phones home (settings.py also disables the plugin's hooks).
export KEDRO_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1

.PHONY: venv check-paddle run test viz bench lock clean-data airflow-dag airflow-check FORCE

# The stamp goes first and the flavour record is written before anything is installed, so an interrupted
# build is redone, as the same flavour, by the next make. Both Paddle wheels own paddle/: when the other
# flavour's wheel is there, neither copy is whole, so both are uninstalled before the lock installs one.
$(STAMP): $(LOCK) pyproject.toml setup.py src/train_deploy/corpus/_fast.c
	rm -f $@
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	printf 'VENV_DEVICE := %s\nVENV_CUDA := %s\n' $(DEVICE) $(CUDA) > $(VENV)/.flavour.mk
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "pip==26.3"
	if $(BIN)/python -m pip show --quiet $(OTHER_PADDLE) 2>/dev/null; then \
		$(BIN)/python -m pip uninstall --quiet --disable-pip-version-check --yes $(OTHER_PADDLE) $(PADDLE); fi
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r $(LOCK) $(INDEX_ARGS)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

# The GPU lock is the CPU lock with Paddle's GPU wheel in place of its CPU one. Both are committed and
# `make lock` rewrites both (tests/test_install.py checks they agree). requirements.lock is no prerequisite:
# a checkout that happens to write it after this file must not reinstall a GPU venv.
requirements-gpu.lock:
	{ echo "# Generated from requirements.lock by make (\`make lock\` rewrites both): do not edit."; \
	  echo "# paddlepaddle-gpu comes from Paddle's index for one CUDA build (make venv DEVICE=gpu CUDA=cu126), e.g."; \
	  echo "#   pip install -r requirements-gpu.lock --extra-index-url https://www.paddlepaddle.org.cn/packages/stable/cu126/"; \
	  sed 's/^paddlepaddle==/paddlepaddle-gpu==/' requirements.lock; } > $@.tmp
	grep -q '^paddlepaddle-gpu==' $@.tmp || { rm -f $@.tmp; echo "requirements.lock pins no paddlepaddle==" >&2; exit 1; }
	mv $@.tmp $@

# Build (or switch the flavour of) the venv without running anything: `make venv DEVICE=gpu CUDA=cu126`.
venv: check-paddle

# Refuses a venv holding the other flavour's Paddle wheel, e.g. pip-installed by hand (tools/check_paddle_wheel.py).
check-paddle: $(STAMP)
	@$(BIN)/python tools/check_paddle_wheel.py --device $(DEVICE)

run: check-paddle
	$(BIN)/kedro run --pipelines $(PIPELINE)

# The MLflow UI on the project's store (conf/base/mlflow.yml, conf/local/mlflow.yml or MLFLOW_TRACKING_URI; a
# tracking server is opened in the browser instead), at http://127.0.0.1:5000 (`make ui PORT=5001` for another
# port). kedro-mlflow starts `mlflow` from PATH: the venv's comes first, so nothing needs activating. The UI's
# processes (kedro, mlflow ui, its server and workers) run in a process group of their own that stops whole with
# make: Ctrl-C, a plain `kill` of make or of the wrapper (tools/process_group.py) leaves none of them behind.
.PHONY: ui
ui: $(STAMP)
	exec env PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python tools/process_group.py -- \
		$(BIN)/kedro mlflow ui $(if $(PORT),--port $(PORT))

# Two worker processes, a test file each (a file's module fixtures and servers stay in one process): much of the
# suite waits on servers and process start-up, so two workers on 2 cores halve its time (docs/benchmarks.md).
# Files go out longest first (tests/conftest.py: LONGEST_FILES, xdist's reordering by test count switched off);
# worksteal or load would split a file over both workers and start its module servers twice.
TEST_WORKERS ?= 2
test: check-paddle
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The edit-test loop (under 2 minutes on 2 cores: docs/development.md): the suite without its end-to-end runs,
# emulated CPUs, the team server, and the tests that need the session's trained tiny model (tests/conftest.py TRAINED).
.PHONY: test-quick
test-quick: check-paddle
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not team and not emulated and not trained"

# Mutation testing of the modules that decide something for the user ([tool.mutmut], docs/development.md).
.PHONY: mutation
mutation: check-paddle
	rm -rf mutants && $(BIN)/mutmut run --max-children 2 && $(BIN)/mutmut results

# The pipeline picture: a static Kedro-Viz site in build/; the last lines say how to serve and open it.
# `kedro viz build` exits 0 even when the project fails to load, and draws a dataset it cannot build as a
# MemoryDataset, so every dataset of the pipeline is built first and the pipeline's page is checked after.
viz: check-paddle
	$(BIN)/kedro catalog describe-datasets --pipeline $(PIPELINE) > /dev/null
	rm -rf build
	$(BIN)/kedro viz build
	test -s build/api/deploy-viz-metadata && test -s build/api/pipelines/$(PIPELINE) \
		|| { echo "kedro viz build wrote no page for pipeline $(PIPELINE): see its ERROR above" >&2; exit 1; }
	@echo "The pipeline picture is in build/: serve it with"
	@echo "  $(BIN)/python -m http.server --bind 127.0.0.1 --directory build 4141"
	@echo "and open http://127.0.0.1:4141"

bench: check-paddle
	$(BIN)/python benchmarks/bench_tokenize.py

# VisualDL over every training run's visualdl/ folder, on 127.0.0.1 (VISUALDL_PORT, default 8040); prints the URL.
.PHONY: visualdl
VISUALDL_PORT ?= 8040
visualdl: $(STAMP)
	$(BIN)/python -m train_deploy.training.monitoring --logdir data/08_reporting/training_logs --port $(VISUALDL_PORT)

# The Airflow DAG of train_deploy, committed in deploy/airflow/: kedro-airflow renders the project's template,
# one task per group of nodes joined by in-memory datasets (--group-by memory; the training node is one task).
AIRFLOW_DAG_ARGS := --pipelines train_deploy --group-by memory --jinja-file deploy/airflow/dag_template.j2
airflow-dag: check-paddle
	$(BIN)/kedro airflow create $(AIRFLOW_DAG_ARGS) --target-dir deploy/airflow

# Optional: Airflow's own pins conflict with the project's lock (apache-airflow-core 3.1.8 needs fastapi<0.118,
# the lock has 0.165), so Airflow lives in a venv of its own (git-ignored) and the DAG's tasks run in the
# project's venv. The DAG tests import the generated DAG there too (Airflow parses it without the project), and
# run it twice with `airflow dags test` on a tiny configuration (a few minutes): it trains, then skips.
AIRFLOW_VENV    ?= .venv-airflow
AIRFLOW_VERSION ?= 3.1.8
$(AIRFLOW_VENV)/.installed:
	rm -f $@
	test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "apache-airflow==$(AIRFLOW_VERSION)"
	touch $@

airflow-check: check-paddle $(AIRFLOW_VENV)/.installed
	AIRFLOW_VENV=$(AIRFLOW_VENV) TRAIN_DEPLOY_AIRFLOW_RUN=1 $(BIN)/python -m pytest -q tests/test_airflow_dag.py

# Re-resolve the lock file from requirements.in (maintainers only). --all keeps setuptools and wheel, the build
# backend requirements.in pins (for `python -m build --no-isolation`); pip is pinned by the venv recipe above.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet -r requirements.in
	.venv-lock/bin/pip freeze --all --exclude-editable | grep -v "^pip==" > requirements.lock
	rm -rf .venv-lock
	$(MAKE) --no-print-directory --always-make requirements-gpu.lock

clean-data:
	rm -rf data/04_feature/tokens data/04_feature/tokens.by_fingerprint data/06_models/tokenizer \
	  data/06_models/tokenizer.by_fingerprint data/08_reporting/* mlruns.db mlartifacts

FORCE:
