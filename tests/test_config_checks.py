"""Every numeric key of every block is checked at start-up, naming the key; a bad run is refused before any node.

The probes come from the blocks' JSON schema (``train_deploy.config.schema``): each numeric key is tried at each
bound it states (accepted) and just past it (refused with one line that starts with its dotted key and says the
range), so a new field is probed as soon as it exists, and a range stated in the docs is the range enforced.
"""

from __future__ import annotations

import copy
from typing import Any

import mlflow
import pytest
from kedro.framework.session import KedroSession

from tests.helpers.config import BLOCKS
from tests.helpers.project import tiny_runtime_params
from train_deploy.config import ConfigError, numeric_part, schema
from train_deploy.run_control.preflight import STAGE_CONFIGS, check_run, check_validation_split

# Each block the probes change one key of: valid, and with every key meaningful on its own (a master, so
# that nnodes is judged by itself).
BASE: dict[str, dict[str, Any]] = {
    "corpus": {},
    "validation": {},
    "training": {"launch": {"master": "10.0.0.1:8090"}},
    "averaging": {},
    "export": {},
    "registry": {},
    "retention": {},
    "retrain": {},
    "run": {},
    "notify": {},
}

# Numeric keys the schema leaves unbounded on purpose.
UNBOUNDED = {"corpus.encoding.split_seed"}  # a salt: any integer

# Bound probes that a rule across keys refuses, and the key its message starts with.
REFUSED_AT_BOUND = {
    ("training.parallel.mp", -1): "training.parallel.mp",  # only one degree is inferred: dp is -1 by default
    ("training.parallel.pp", -1): "training.parallel.pp",  # pp must be 1 (PIPELINE_UNSUPPORTED)
    ("corpus.reader.max_line_bytes", 1024): "corpus.reader.html_split_chars",  # at most max_line_bytes
    ("corpus.cleaning.max_chars", 1): "corpus.cleaning.min_chars",  # at most max_chars (8 by default)
    ("corpus.tokenizer.vocab_size", 32): "corpus.tokenizer.vocab_size",  # 261 with byte_fallback (the default)
}


def numeric_keys(stage: str) -> list[tuple[str, dict[str, Any], bool]]:
    """(dotted key, its numeric schema, whether the key holds a list of numbers) of every numeric field of the
    block, nested blocks too."""
    root = schema(BLOCKS[stage])
    definitions = root.get("$defs", {})

    def walk(node: dict[str, Any], where: str) -> list[tuple[str, dict[str, Any], bool]]:
        found = []
        for name, field in node.get("properties", {}).items():
            refs = [member["$ref"] for member in [field, *field.get("anyOf", ())] if "$ref" in member]
            if refs:  # a nested block, or an optional one (Block | None)
                found += walk(definitions[refs[0].rsplit("/", 1)[1]], f"{where}.{name}")
            elif (numeric := numeric_part(field)) is not None and "enum" not in numeric:  # enums: Literal
                found.append((f"{where}.{name}", numeric, field.get("type") == "array"))
        return found

    return walk(root, stage)


KEYS = [entry for stage in BLOCKS for entry in numeric_keys(stage)]


def _probes(key: str, numeric: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(value, accepted) at and just past each bound of ``numeric``."""
    step = 1 if numeric["type"] == "integer" else 0.5
    probes = []
    for closed, exclusive, sign in (("minimum", "exclusiveMinimum", -1), ("maximum", "exclusiveMaximum", 1)):
        if closed in numeric:
            probes += [(numeric[closed], True), (numeric[closed] + sign * step, False)]
        elif exclusive in numeric:
            inside = numeric[exclusive] - sign * (1 if step == 1 else min(0.5, abs(numeric[exclusive]) / 2 or 0.5))
            probes += [(numeric[exclusive], False), (inside, True)]
    return probes


PROBES = [(key, value, accepted, is_list) for key, numeric, is_list in KEYS
          for value, accepted in _probes(key, numeric)]


def with_value(key: str, value: Any) -> tuple[str, dict[str, Any]]:
    """The stage and its base block with ``key`` (dotted, stage first) set to ``value``."""
    stage, *path = key.split(".")
    block = copy.deepcopy(BASE[stage])
    inner = block
    for name in path[:-1]:
        inner = inner.setdefault(name, {})
    inner[path[-1]] = value
    return stage, block


@pytest.mark.parametrize("key,value,accepted,is_list", PROBES,
                         ids=[f"{key}={value}" for key, value, _, _ in PROBES])
def test_every_numeric_key_accepts_its_bounds_and_refuses_past_them_naming_the_key(key, value, accepted, is_list):
    stage, block = with_value(key, [value] if is_list else value)
    try:
        BLOCKS[stage].from_params(block)
        refusal = None
    except ConfigError as exc:
        refusal = str(exc)
    if (key, value) in REFUSED_AT_BOUND:
        assert refusal is not None and refusal.startswith(f"{REFUSED_AT_BOUND[key, value]}: "), refusal
    elif accepted:
        assert refusal is None, f"{key}: {value!r} is within the schema's range but refused: {refusal}"
    else:
        assert refusal is not None, f"{key}: {value!r} is past the schema's range but accepted"
        assert refusal.startswith(f"{key}{'[0]' if is_list else ''}: must "), refusal
        assert "\n" not in refusal and f"(got {value!r})" in refusal


def test_every_numeric_key_states_a_range_in_the_schema():
    unbounded = {key for key, numeric, _ in KEYS
                 if not {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"} & set(numeric)}
    assert unbounded == UNBOUNDED
    assert len(KEYS) > 100  # the walk finds nested blocks and optional and list fields
    assert {key for key, _ in REFUSED_AT_BOUND} <= {key for key, _, _ in KEYS}


def test_the_base_blocks_are_valid():
    check_run(BASE, set(STAGE_CONFIGS))


@pytest.mark.parametrize("key,value,message", [
    ("training.launch.node_rank", 2, "must be 0 .. launch.nnodes - 1 = 0 (got 2)"),
    ("training.parallel.mp", -1, "only one of dp, mp, pp may be -1 (inferred from the world size); dp is -1 already"),
    ("training.optimizer.beta2", 1.0, "must be in [0, 1) (got 1.0)"),
    ("training.schedule.stop_after", 0, "must be at least 1 (got 0)"),
    ("corpus.tokenizer.vocab_size", 100, "must be in [261, 1000000] (got 100); byte_fallback: 256 byte pieces"),
    ("corpus.tokenizer.character_coverage", 0.5, "must be in [0.98, 1] (got 0.5)"),
    ("averaging.decay", 0.0, "must be in (0, 1] (got 0.0)"),
    ("export.latency.batch_sizes", [1, 0], "export.latency.batch_sizes[1]: must be at least 1 (got 0)"),
    ("registry.min_improvement", 1.0, "registry.min_improvement: must be in [0, 1) (got 1.0)"),
    ("registry.int8", True, "registry.int8: true needs backend: onnx"),
    ("registry.model_name", "my model", "registry.model_name: 'my model' is not a model name"),
    ("run.wait_timeout", 0, "run.wait_timeout: must be a positive number of seconds or null (got 0)"),
    ("notify.timeout_seconds", 0, "notify.timeout_seconds: must be a positive number of seconds (got 0)"),
    ("notify.events", ["failed", "exploded"], "notify.events[1]: 'exploded' is not one of 'failed', 'skipped', "),
])
def test_refusals_say_what_is_allowed(key, value, message):
    stage, block = with_value(key, value)
    with pytest.raises(ConfigError) as exc:
        BLOCKS[stage].from_params(block)
    assert message in str(exc.value)


@pytest.mark.parametrize("key,value,message", [
    ("registry.backend", "x" * 500, f"registry.backend: '{'x' * 38}… is not one of 'paddle', 'onnx'"),
    ("corpus.reader.paths", "/data/" + "a" * 300, f"corpus.reader.paths: expected a list, got '/data/{'a' * 32}…"),
    ("training.schedule.seed", "1", "training.schedule.seed: expected an integer, got '1'"),
    ("training.precision.amp", 1, "training.precision.amp: expected true or false, got 1"),
    ("export.parity.max_logit_diff", True, "export.parity.max_logit_diff: expected a number, got True"),
    ("averaging.typo", 1, "averaging.typo: unknown key (known: choose, decay, k, max_step, method, select, steps, "
                          "too_few)"),
])
def test_a_wrong_value_is_one_line_naming_the_key_and_at_most_40_characters_of_it(key, value, message):
    stage, block = with_value(key, value)
    with pytest.raises(ConfigError) as exc:
        BLOCKS[stage].from_params(block)
    assert str(exc.value) == message


def test_a_vocabulary_without_byte_fallback_may_be_small():
    check_run({"corpus": {"tokenizer": {"vocab_size": 100, "byte_fallback": False}}}, {"corpus"})


@pytest.mark.parametrize("stages,refused", [
    ({"corpus", "training"}, False),
    ({"corpus", "training", "averaging", "export"}, True),
    ({"averaging"}, True),
    ({"export"}, True),
])
def test_no_validation_split_is_refused_when_averaging_or_export_runs(stages, refused):
    params = {"corpus": {"encoding": {"validation_fraction": 0}}}
    if not refused:
        check_run(params, stages)
        return
    with pytest.raises(ConfigError, match=r"^corpus\.encoding\.validation_fraction: 0 writes no validation split"):
        check_run(params, stages)


def test_the_validation_split_check_names_the_stages_that_need_it():
    configs = check_run({"corpus": {"encoding": {"validation_fraction": 0}}}, set())
    with pytest.raises(ConfigError, match="but averaging compares checkpoints on it and export checks parity on it;"):
        check_validation_split(configs["corpus"], configs["averaging"], configs["export"])
    check_validation_split(configs["corpus"], None, None)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline,params,message", [
    ("corpus", {"training": {"schedule": {"log_every": 0}}}, "training.schedule.log_every: must be at least 1"),
    ("train_deploy", {"corpus": {"encoding": {"validation_fraction": 0.0}}},
     "corpus.encoding.validation_fraction: 0 writes no validation split"),
])
def test_a_kedro_run_with_a_bad_value_is_refused_before_any_node_runs(project, tmp_path, pipeline, params, message):
    runtime = tiny_runtime_params()
    for name, block in params.items():
        runtime[name] = {**runtime.get(name, {}), **block}
    with KedroSession.create(project_path=project, runtime_params=runtime) as session:
        with pytest.raises(ConfigError) as exc:
            session.run(pipeline_names=[pipeline])
    assert str(exc.value).startswith(message)
    # Nothing was written: no layer of the data folder, no MLflow run.
    assert sorted((project / "data").glob("0*")) == []
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlruns.db'}")
    assert mlflow.search_runs(search_all_experiments=True, output_format="list") == []


@pytest.mark.slow
def test_a_run_builds_its_configuration_once_and_hands_the_nodes_those_blocks(project, tmp_path, monkeypatch):
    """The corpus stage reads the training and registry blocks in three nodes: they get the blocks the run's preflight
    built (``RunLife.before_node_run``), not their parameter mappings to parse again."""
    import train_deploy.registry.config as registry_config
    import train_deploy.training.config as training_config

    built = []
    for module in (training_config, registry_config):
        def counting(cls, data, where, _build=module.from_mapping):
            if not isinstance(data, cls):
                built.append(where)
            return _build(cls, data, where)
        monkeypatch.setattr(module, "from_mapping", counting)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    with KedroSession.create(project_path=project, runtime_params=tiny_runtime_params()) as session:
        session.run(pipeline_names=["corpus"])
    assert sorted(built) == ["registry", "training"]
