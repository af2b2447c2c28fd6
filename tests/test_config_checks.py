"""Every numeric key of every stage is checked at start-up, naming the key; a bad run is refused before any node.

The keys are found by walking the configuration dataclasses, so a new field is probed as soon as it exists: it
must either refuse 0, -1 and a huge value (and 1.0 for a float) with a message starting with its dotted key, or
say here which of them it accepts.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any

import mlflow
import pytest
from kedro.framework.session import KedroSession

from tests.helpers.project import tiny_runtime_params
from train_deploy.config import ConfigError
from train_deploy.run_control.preflight import STAGE_CONFIGS, check_run, check_validation_split

HUGE = 10**9
INT_PROBES = (0, -1, HUGE)
FLOAT_PROBES = (0.0, -1.0, 1.0, float(HUGE))

# Each stage's block the probes change one key of: valid, and with every key meaningful on its own (a master,
# so that a huge nnodes is judged by itself).
BASE: dict[str, dict[str, Any]] = {
    "corpus": {},
    "validation": {},
    "training": {"launch": {"master": "10.0.0.1:8090"}},
    "averaging": {},
    "export": {},
    "registry": {},
    "retention": {},
}

# The probes a key accepts; every other probe of every numeric key must be refused naming the key.
ACCEPTED: dict[str, tuple] = {
    "training.launch.cpu_threads": (0,),  # 0 = cores ÷ nproc_per_node
    "corpus.reader.lines_per_document": (HUGE,),
    "corpus.reader.max_bytes": (HUGE,),
    "corpus.reader.max_line_bytes": (HUGE,),
    "corpus.reader.chunk_bytes": (HUGE,),
    "corpus.cleaning.min_chars": (0,),  # at most max_chars
    "corpus.cleaning.max_chars": (HUGE,),  # null = no limit
    "corpus.cleaning.min_cjk_share": (0.0,),  # 0 = off
    "corpus.cleaning.max_repeated_line_share": (1.0,),  # 1 = off
    "corpus.cleaning.max_repeated_ngram_share": (1.0,),
    "corpus.cleaning.max_symbol_share": (1.0,),
    "corpus.tokenizer.character_coverage": (1.0,),
    "corpus.tokenizer.sample_bytes": (HUGE,),
    "corpus.tokenizer.num_threads": (0,),  # 0 = all cores; at most 1024
    "corpus.encoding.workers": (0, HUGE),  # 0 = all cores; never more than the input's chunks
    "corpus.encoding.validation_fraction": (0.0,),
    "corpus.encoding.split_seed": (0, -1, HUGE),  # a salt: any integer
    "corpus.encoding.batch_documents": (HUGE,),
    "corpus.encoding.num_cpus": (1.0,),  # (0, 1024] per Ray task
    "corpus.encoding.max_retries": (0,),  # 0 to 100
    "training.parallel.dp": (-1, HUGE),  # -1 = inferred; the world size is resolve_layout's
    "training.parallel.mp": (HUGE,),
    "training.parallel.sharding_stage": (0,),
    "training.batch.micro_batch_size": (HUGE,),
    "training.batch.global_batch_size": (HUGE,),
    "training.batch.seq_length": (HUGE,),  # resolve_layout caps it by the model's context
    "training.optimizer.learning_rate": (1.0, HUGE),
    "training.optimizer.reference_batch_size": (HUGE,),
    "training.optimizer.min_lr_ratio": (0.0, 1.0),
    "training.optimizer.warmup_steps": (0, HUGE),
    "training.optimizer.weight_decay": (0.0, 1.0, HUGE),
    "training.optimizer.beta1": (0.0,),
    "training.optimizer.beta2": (0.0,),
    "training.optimizer.epsilon": (1.0, HUGE),
    "training.optimizer.grad_clip": (0.0, 1.0, HUGE),  # 0 = off
    "training.schedule.max_steps": (HUGE,),
    "training.schedule.log_every": (HUGE,),
    "training.schedule.eval_every": (HUGE,),
    "training.schedule.eval_batches": (HUGE,),
    "training.schedule.checkpoint_every": (HUGE,),
    "training.schedule.keep_last": (0, HUGE),  # 0 keeps all
    "training.schedule.seed": (0, HUGE),
    "training.schedule.stop_after": (HUGE,),
    "training.device.peak_tflops": (1.0, HUGE),
    "training.launch.nproc_per_node": (HUGE,),
    "training.launch.nnodes": (HUGE,),
    "training.launch.node_rank": (0,),
    "training.launch.max_restart": (0, HUGE),
    "training.launch.stall_timeout": (1.0, HUGE),
    "training.launch.metrics_timeout": (0, 1.0, HUGE),
    "averaging.k": (HUGE,),
    "averaging.steps": (HUGE,),
    "averaging.max_step": (HUGE,),
    "averaging.decay": (1.0,),
    "export.server.cpu_threads": (),  # 1 to 1024
    "export.server.gc_batch_mb": (0.0, 1.0, HUGE),
    "export.server.gpu_memory_mb": (HUGE,),
    "export.server.tensorrt_max_batch": (HUGE,),
    "export.edge.threads": (),  # 1 to 1024
    "export.edge.convert_timeout": (1.0, HUGE),
    "export.parity.samples": (HUGE,),
    "export.parity.seq_length": (HUGE,),  # capped by the model's context
    "export.parity.max_logit_diff": (1.0, HUGE),
    "export.parity.max_fp16_logit_diff": (1.0, HUGE),
    "export.parity.max_fp16_perplexity_increase": (0.0, 1.0, HUGE),
    "export.parity.max_int8_perplexity_increase": (0.0, 1.0, HUGE),
    "export.latency.batch_sizes": (HUGE,),
    "export.latency.seq_length": (HUGE,),  # capped by the model's context
    "export.latency.warmup": (0, HUGE),
    "export.latency.repeats": (HUGE,),
    "export.latency.rounds": (HUGE,),  # at most repeats are used
    "export.latency.generate_tokens": (0, HUGE),  # 0 = not measured (the forward pass is compared)
    "registry.min_improvement": (0.0,),  # a fraction below 1; 0 = any improvement
    "registry.max_batch": (),  # 1 to 100000
    "registry.eval_set.documents": (),  # 1 to 100000
    "registry.eval_set.max_chars": (),  # 10 to 100000
    "registry.retries.attempts": (),  # 1 to 100
    "registry.retries.wait_seconds": (0.0, 1.0),  # 0 to 3600
    # the data gate's bounds: a share or a relative decrease in [0, 1], an increase or change 0 or more (0: any
    # change stops), a quantile factor 1 or more
    **dict.fromkeys(("validation.max_documents_decrease", "validation.max_characters_decrease",
                     "validation.max_cjk_share_change", "validation.max_duplicate_share",
                     "validation.max_byte_fallback_rate", "validation.max_drop_share_increase"), (0.0, 1.0)),
    **dict.fromkeys(("validation.max_documents_increase", "validation.max_characters_increase",
                     "validation.max_tokens_per_character_change"), (0.0, 1.0, float(HUGE))),
    "validation.max_length_quantile_factor": (1.0, float(HUGE)),
    "validation.max_nats_per_char_increase": (0.0, 1.0, float(HUGE)),  # issue 39: relative, 0 or more
    "validation.max_character_distance": (0.0, 1.0),  # a Jensen–Shannon distance
    "validation.max_document_nats_factor": (1.0, float(HUGE)),
    "validation.max_flagged_share": (0.0, 1.0),  # a share of the sampled documents
    "registry.serving_check.timeout_seconds": (1.0, float(HUGE)),  # seconds, more than 0
    # retention: 0 keeps all; a grace period of 0 days removes at once; sizes in bytes, 0 or more
    **dict.fromkeys(("retention.checkpoints.keep_runs", "retention.training_logs.keep_runs",
                     "retention.bundles.keep_last", "retention.disk.budget", "retention.disk.run_estimate"), (0, HUGE)),
    "retention.mlflow.grace_days": (0.0, 1.0, float(HUGE)),
}


def numeric_keys(cls: type, where: str) -> list[tuple[str, type, bool]]:
    """(dotted key, int or float, whether the key holds a list of them) of every numeric field, nested too."""
    found = []
    for field in dataclasses.fields(cls):
        hint, key = typing.get_type_hints(cls)[field.name], f"{where}.{field.name}"
        if dataclasses.is_dataclass(hint):
            found += numeric_keys(hint, key)
            continue
        origin = typing.get_origin(hint)
        is_list = origin is list
        args = typing.get_args(hint) if origin in (list, typing.Union, types.UnionType) else (hint,)
        found += [(key, kind, is_list) for kind in (float, int) if kind in args][:1]
    return found


KEYS = [entry for stage, cls in STAGE_CONFIGS.items() for entry in numeric_keys(cls, stage)]
PROBES = [(key, value, is_list) for key, kind, is_list in KEYS
          for value in (INT_PROBES if kind is int else FLOAT_PROBES)]


def with_value(key: str, value: Any) -> tuple[str, dict[str, Any]]:
    """The stage and its base block with ``key`` (dotted, stage first) set to ``value``."""
    stage, *path = key.split(".")
    block = copy.deepcopy(BASE[stage])
    inner = block
    for name in path[:-1]:
        inner = inner.setdefault(name, {})
    inner[path[-1]] = value
    return stage, block


@pytest.mark.parametrize("key,value,is_list", PROBES, ids=[f"{key}={value}" for key, value, _ in PROBES])
def test_every_numeric_key_is_accepted_or_refused_naming_the_key(key, value, is_list):
    stage, block = with_value(key, [value] if is_list else value)
    try:
        STAGE_CONFIGS[stage].from_params(block)
        refusal = None
    except ConfigError as exc:
        refusal = str(exc)
    if value in ACCEPTED.get(key, ()):
        assert refusal is None, f"{key}: {value!r} is listed as accepted but refused: {refusal}"
    else:
        assert refusal is not None, f"{key}: {value!r} is accepted; check it or list it in ACCEPTED"
        assert refusal.startswith(key), refusal
        assert "\n" not in refusal


def test_the_table_names_only_keys_that_exist():
    assert set(ACCEPTED) - {key for key, _, _ in KEYS} == set()
    assert len(KEYS) > 50  # the walk finds nested blocks and optional and list fields


def test_the_base_blocks_are_valid():
    check_run(BASE, set(STAGE_CONFIGS))


@pytest.mark.parametrize("key,value,message", [
    ("training.launch.node_rank", 2, "must be 0 .. launch.nnodes - 1 = 0 (got 2)"),
    ("training.parallel.mp", -1, "only one of dp, mp, pp may be -1 (inferred from the world size); dp is -1 already"),
    ("training.optimizer.beta2", 1.0, "must be in [0, 1) (got 1.0)"),
    ("training.schedule.stop_after", 0, "must be at least 1 (got 0); null = the whole schedule"),
    ("corpus.tokenizer.vocab_size", 100, "must be in [261, 1000000] (got 100); byte_fallback: 256 byte pieces"),
    ("corpus.tokenizer.character_coverage", 0.5, "must be in [0.98, 1] (got 0.5); SentencePiece's range"),
    ("averaging.decay", 0.0, "must be in (0, 1] (got 0.0)"),
    ("export.latency.batch_sizes", [1, 0], "export.latency.batch_sizes[1]: must be at least 1 (got 0)"),
    ("registry.min_improvement", 1.0, "must be in [0, 1) (got 1.0); a fraction: 0.01 = 1% fewer nats per character"),
    ("registry.int8", True, "registry.int8: true needs backend: onnx"),
    ("registry.model_name", "my model", "registry.model_name: 'my model' is not a model name"),
])
def test_refusals_say_what_is_allowed(key, value, message):
    stage, block = with_value(key, value)
    with pytest.raises(ConfigError) as exc:
        STAGE_CONFIGS[stage].from_params(block)
    assert message in str(exc.value)


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
