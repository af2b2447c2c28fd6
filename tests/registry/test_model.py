"""The bundle as an MLflow model: what is logged, and predictions in a fresh process away from the checkout."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import math
import shutil
import sys
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import yaml
from mlflow.exceptions import MlflowException

from tests.helpers.project import REPO
from tests.helpers.registry import REGISTERED_MODEL, run_fresh
from train_deploy.export.runtime import LanguageModel, read_bundle
from train_deploy.registry.config import ServingConfig
from train_deploy.registry.model import (
    INPUT_EXAMPLE,
    PARAMS,
    SERVING_DISTRIBUTIONS,
    BundleModel,
    Limits,
    _Lane,
    generate_frame,
    log_bundle_model,
    nats_per_char,
    request_params,
)

TEXTS = ["今天天气很好。", "人民日报社论", "中国人民银行宣布"]
PROMPTS = ["中国", "今天"]
FORMS = {"paddle": ("paddle", False), "onnx": ("onnx", False), "onnx-int8": ("onnx", True)}

FRESH_SCRIPT = """
import json, sys
import mlflow, pandas as pd
texts, prompts, forms, uri, checkout = json.loads(sys.argv[1] if len(sys.argv) > 1 else {args!r})
model = mlflow.pyfunc.load_model(uri)
results = {{}}
for key, (backend, int8) in forms.items():
    base = {{"backend": backend, "int8": int8}}
    score = model.predict(pd.DataFrame({{"text": texts}}), params=base)
    generate = model.predict(pd.DataFrame({{"text": prompts}}),
                             params={{**base, "task": "generate", "temperature": 0.0, "max_new_tokens": 6}})
    results[key] = {{"score": score.to_dict("records"), "generate": generate.to_dict("records")}}
modules = {{name: getattr(module, "__file__", None) or "" for name, module in sys.modules.items()}}
print(json.dumps({{"results": results, "package": sys.modules["train_deploy"].__file__,
                  "train_deploy": sorted(f for name, f in modules.items() if name.split(".")[0] == "train_deploy"),
                  "loaded": sorted({{name.split(".")[0] for name in modules}}),
                  "from_checkout": sorted(name for name, file in modules.items() if file.startswith(checkout))}}))
"""


@pytest.fixture(scope="module")
def fresh(tiny_model, model_store, tmp_path_factory) -> dict:
    """Both tasks on every form, predicted by the registered model loaded in a new process in an empty folder."""
    uri = f"models:/{REGISTERED_MODEL}/{tiny_model.registered_model_version}"
    args = json.dumps([TEXTS, PROMPTS, FORMS, uri, str(REPO / "src")])
    return run_fresh(FRESH_SCRIPT.format(args=args), model_store, tmp_path_factory.mktemp("fresh") / "empty")


@pytest.fixture(scope="module")
def downloaded(tiny_model, model_store, tmp_path_factory) -> Path:
    """The logged model's folder, as a client downloads it."""
    with model_store.active():
        return Path(mlflow.artifacts.download_artifacts(tiny_model.model_uri,
                                                        dst_path=str(tmp_path_factory.mktemp("downloaded"))))


@pytest.fixture(scope="module")
def loaded(tiny_model, model_store):
    with model_store.active():
        return mlflow.pyfunc.load_model(tiny_model.model_uri)


def test_a_fresh_process_in_an_empty_folder_runs_the_package_logged_with_the_model(fresh):
    assert fresh["from_checkout"] == []
    assert Path(fresh["package"]).parts[-3:] == ("code", "train_deploy", "__init__.py")
    assert any(file.endswith("code/train_deploy/registry/model.py") for file in fresh["train_deploy"])


@pytest.mark.parametrize("form", list(FORMS))
def test_fresh_process_scores_like_the_bundle_loaded_directly(fresh, tiny_bundle, form):
    backend, int8 = FORMS[form]
    expected = LanguageModel.load(tiny_bundle, backend, int8=int8).score(TEXTS)
    rows = fresh["results"][form]["score"]
    assert [row["text"] for row in rows] == TEXTS
    for row, want in zip(rows, expected, strict=True):
        assert row["tokens"] == len(want.tokens) > 0
        assert row["chars"] == len(want.text)
        assert row["log_prob"] == pytest.approx(sum(want.log_probs), rel=1e-5)
        assert row["mean_log_prob"] == pytest.approx(row["log_prob"] / row["tokens"], rel=1e-12)
        assert row["perplexity"] == pytest.approx(want.perplexity, rel=1e-5)
        assert math.exp(-row["mean_log_prob"]) == pytest.approx(row["perplexity"], rel=1e-9)


@pytest.mark.parametrize("form", list(FORMS))
def test_fresh_process_generates_greedily_like_the_bundle_loaded_directly(fresh, tiny_bundle, form):
    backend, int8 = FORMS[form]
    model = LanguageModel.load(tiny_bundle, backend, int8=int8)
    expected = [model.generate(prompt, max_new_tokens=6, temperature=0) for prompt in PROMPTS]
    assert fresh["results"][form]["generate"] == [{"prompt": p, "generated": g} for p, g in zip(PROMPTS, expected,
                                                                                              strict=True)]
    assert any(expected), "greedy decoding produced nothing for every prompt: the comparison proves little"


def test_logged_model_holds_the_package_as_code_and_no_serialised_object(downloaded):
    code = downloaded / "code" / "train_deploy"
    assert (code / "registry" / "model.py").read_text() == (REPO / "src/train_deploy/registry/model.py").read_text()
    assert (code / "export" / "runtime.py").is_file()
    flavor = yaml.safe_load((downloaded / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["code"] == "code" and flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    assert (downloaded / Path(flavor["model_code_path"]).name).is_file()
    assert sorted(p.suffix for p in downloaded.rglob("*.pkl")) == []
    assert read_bundle(downloaded / "artifacts" / "bundle").model.context > 0


def test_logged_model_pins_this_environments_versions(downloaded):
    pins = (downloaded / "requirements.txt").read_text().split()
    assert pins == [f"{name}=={importlib.metadata.version(name)}" for name in SERVING_DISTRIBUTIONS]
    python_env = yaml.safe_load((downloaded / "python_env.yaml").read_text())
    assert python_env["python"] == ".".join(map(str, sys.version_info[:3]))


def test_requirements_cover_every_library_the_served_package_imports(fresh):
    # Libraries that train_deploy's modules import (anywhere in them) and that the fresh process loaded while
    # serving both tasks on every form: each must come from a pinned distribution (pip resolves the rest).
    imported = set()
    for file in fresh["train_deploy"]:
        if not file.endswith(".py"):  # the corpus stage's C extension imports nothing
            continue
        path = REPO / "src" / Path(*Path(file).parts[Path(file).parts.index("code") + 1 :])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            imported.update(name.split(".")[0] for name in names)
    used = (imported & set(fresh["loaded"])) - set(sys.stdlib_module_names) - {"train_deploy"}
    distributions = importlib.metadata.packages_distributions()
    unpinned = {top: distributions[top] for top in used if not set(distributions[top]) & set(SERVING_DISTRIBUTIONS)}
    assert {"paddle", "onnxruntime", "sentencepiece", "numpy", "pandas", "mlflow"} <= used
    assert unpinned == {}


def test_signature_declares_the_text_column_every_parameter_and_an_input_example(tiny_model, downloaded):
    signature = tiny_model.signature
    assert signature.inputs.input_names() == ["text"] and signature.inputs.input_types()[0].name == "string"
    assert {p.name: (p.dtype.name, p.default) for p in signature.params} == {
        name: (kind, default) for name, (kind, default) in PARAMS.items()}
    assert {"text", "tokens", "chars", "log_prob", "mean_log_prob", "perplexity", "prompt", "generated"} == set(
        signature.outputs.input_names())
    example = json.loads((downloaded / "serving_input_example.json").read_text())
    assert example == {"dataframe_split": {"columns": ["text"], "data": [[text] for text in INPUT_EXAMPLE]}}
    assert yaml.safe_load((downloaded / "MLmodel").read_text())["flavors"]["python_function"]["config"] == {
        "max_batch": 64, "max_chars": 2000, "max_tokens": 8192, "max_new_tokens": 256, "time_budget_s": 30}


def test_registers_a_new_version_of_the_named_model(tiny_model, model_store, tiny_bundle):
    again = model_store.log(tiny_bundle, registered_model_name=REGISTERED_MODEL)
    assert int(again.registered_model_version) == int(tiny_model.registered_model_version) + 1
    with model_store.active():
        version = mlflow.MlflowClient().get_model_version(REGISTERED_MODEL, again.registered_model_version)
    assert version.run_id == again.run_id


def test_the_python_model_accepts_a_list_of_strings_or_a_one_column_table(loaded):
    model = loaded.unwrap_python_model()
    by_list = model.predict(None, TEXTS[:2])
    by_table = loaded.predict(pd.DataFrame({"text": TEXTS[:2]}))
    by_other_column = model.predict(None, pd.DataFrame({"sentence": TEXTS[:2]}))
    pd.testing.assert_frame_equal(by_list, by_table)
    pd.testing.assert_frame_equal(by_other_column, by_table)


def test_nats_per_char_divides_the_summed_log_likelihood_by_the_characters(loaded, tiny_bundle):
    frame = loaded.predict(pd.DataFrame({"text": TEXTS}))
    scores = LanguageModel.load(tiny_bundle).score(TEXTS)
    expected = -sum(sum(s.log_probs) for s in scores) / sum(len(text) for text in TEXTS)
    assert nats_per_char(frame) == pytest.approx(expected, rel=1e-6)


def _long_text(bundle: Path) -> str:
    return "中华人民共和国" * read_bundle(bundle).model.context


BAD_REQUESTS = {
    "empty input": (lambda b: pd.DataFrame({"text": pd.Series([], dtype=object)}), {}, r"input: no texts"),
    "non-string": (lambda b: pd.DataFrame({"text": ["今天", 7]}), {}, r"text 1: 7 is a int, not a string"),
    "missing value": (lambda b: pd.DataFrame({"text": ["今天", None]}), {},
                      r"text 1: missing; every row needs a string"),
    "empty text": (lambda b: pd.DataFrame({"text": [""]}), {}, r"text 0: empty; there is nothing to score"),
    "too many texts": (lambda b: pd.DataFrame({"text": ["今天"] * 65}), {},
                       r"input: 65 texts exceed max_batch 64; send at most 64"),
    "too long": (lambda b: pd.DataFrame({"text": [_long_text(b)]}), {}, r"text 0: \d+ tokens exceed the model's "
                                                                        r"context of \d+"),
    "too long prompt": (lambda b: pd.DataFrame({"text": [_long_text(b)]}), {"task": "generate"},
                        r"prompt 0: \d+ tokens exceed"),
    "unknown task": (lambda b: pd.DataFrame({"text": ["今天"]}), {"task": "translate"},
                     r"params.task: 'translate' is not one of score, generate"),
    "unknown backend": (lambda b: pd.DataFrame({"text": ["今天"]}), {"backend": "tensorrt"},
                        r"params.backend: 'tensorrt' is not one of auto, paddle, onnx"),
    "int8 on paddle": (lambda b: pd.DataFrame({"text": ["今天"]}), {"int8": True},
                       r"params.int8: the int8 model is ONNX; ask for backend 'onnx'"),
    "negative max_new_tokens": (lambda b: pd.DataFrame({"text": ["今天"]}), {"task": "generate", "max_new_tokens": -1},
                                r"^params.max_new_tokens: -1 is outside 0 to 256, the limit per prompt"),
    "max_new_tokens over the limit": (lambda b: pd.DataFrame({"text": ["今天"]}), {"max_new_tokens": 10**9},
                                      r"^params.max_new_tokens: 1000000000 is outside 0 to 256, the limit per prompt "
                                      r"\(max_new_tokens\)$"),
    "NaN temperature": (lambda b: pd.DataFrame({"text": ["今天"]}), {"temperature": float("nan")},
                        r"^params.temperature: nan is not a finite number$"),
    "negative temperature": (lambda b: pd.DataFrame({"text": ["今天"]}), {"temperature": -0.5},
                             r"^params.temperature: -0.5 is negative; 0 decodes greedily$"),
    "negative top_k": (lambda b: pd.DataFrame({"text": ["今天"]}), {"top_k": -1},
                       r"^params.top_k: -1 is negative; 0 samples among all tokens$"),
    "negative seed": (lambda b: pd.DataFrame({"text": ["今天"]}), {"seed": -3}, r"^params.seed: -3 is negative"),
    "text over max_chars": (lambda b: pd.DataFrame({"text": ["今天", "今" * 2001]}), {},
                            r"^text 1: 2001 characters exceed the limit of 2000 \(max_chars\); send a shorter text$"),
    "mistyped parameter": (lambda b: pd.DataFrame({"text": ["今天"]}), {"top_k": "many"}, r"top_k"),
    "top_p out of range": (lambda b: pd.DataFrame({"text": ["今天"]}), {"task": "generate", "top_p": 1.5},
                           r"top_p: 1.5 is outside \(0, 1\]"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_raise_invalid_parameter_value_naming_the_problem(loaded, tiny_bundle, case):
    model_input, params, message = BAD_REQUESTS[case]
    with pytest.raises(MlflowException, match=message) as raised:
        loaded.predict(model_input(tiny_bundle), params=params)
    assert raised.value.error_code == "INVALID_PARAMETER_VALUE"
    assert raised.value.get_http_status_code() == 400


def test_the_python_model_refuses_unknown_parameters_and_other_inputs(loaded):
    model = loaded.unwrap_python_model()
    with pytest.raises(MlflowException, match=r"params: unknown temprature; expected some of task, ") as raised:
        model.predict(None, ["今天"], params={"temprature": 0.5})
    assert raised.value.error_code == "INVALID_PARAMETER_VALUE"
    with pytest.raises(MlflowException, match=r"input: dict is not a table with a 'text' column or a list"):
        model.predict(None, {"text": "今天"})
    with pytest.raises(MlflowException, match=r"input: no 'text' column among a, b"):
        model.predict(None, pd.DataFrame({"a": ["x"], "b": ["y"]}))


def test_a_request_over_max_tokens_is_refused_naming_the_limit(loaded, monkeypatch):
    model = loaded.unwrap_python_model()
    monkeypatch.setattr(model, "limits", Limits(serving=ServingConfig(max_tokens=40)))
    with pytest.raises(MlflowException, match=r"^input: \d+ tokens, with 32 new per prompt, exceed the limit of 40 per "
                                              r"request \(max_tokens\); send fewer or shorter texts$"):
        model.predict(None, ["今天", "中国"], params={"task": "generate"})
    assert len(model.predict(None, ["今天"], params={"task": "generate", "max_new_tokens": 4})) == 1


def test_scoring_runs_while_a_generation_holds_its_engine_and_waits_only_the_time_budget(loaded, monkeypatch):
    model = loaded.unwrap_python_model()
    monkeypatch.setattr(model, "limits", Limits(serving=ServingConfig(time_budget_s=1)))
    with model._lanes["generate"].lock:  # a generation in progress
        started = time.monotonic()
        assert model.predict(None, ["今天天气很好。"])["tokens"][0] > 0
        assert time.monotonic() - started < 1
        with pytest.raises(MlflowException, match=r"^generate: busy; no generate engine was free within the time "
                                                  r"budget of 1 s \(time_budget_s\); retry later$") as raised:
            model.predict(None, ["今天"], params={"task": "generate"})
    assert raised.value.get_http_status_code() == 503 and 1 <= time.monotonic() - started < 10


def test_a_form_the_bundle_cannot_load_is_refused_without_the_servers_path(loaded, tiny_bundle, tmp_path,
                                                                          monkeypatch):
    copy = tmp_path / "served" / "bundle"
    shutil.copytree(tiny_bundle, copy)
    (copy / "edge" / "model.int8.onnx").unlink()
    model = loaded.unwrap_python_model()
    monkeypatch.setattr(model, "_lanes", {task: _Lane(copy, task, 1) for task in ("score", "generate")})
    with pytest.raises(MlflowException) as raised:
        model.predict(None, ["今天"], params={"backend": "onnx", "int8": True})
    assert raised.value.get_http_status_code() == 400 and "model.int8.onnx" in raised.value.message
    assert str(tmp_path) not in raised.value.message, raised.value.message


def test_a_generation_past_its_time_budget_stops_with_503(tiny_bundle):
    settings = request_params({"task": "generate", "temperature": 0.0, "max_new_tokens": 50}, ServingConfig())
    with pytest.raises(MlflowException, match=r"^generate: stopped at the time budget of 1 s \(time_budget_s\) after "
                                              r"1 new tokens; ask for fewer max_new_tokens or prompts$") as raised:
        generate_frame(LanguageModel.load(tiny_bundle), PROMPTS, settings, time.monotonic(), 1)  # the budget is spent
    assert raised.value.get_http_status_code() == 503


def test_a_model_logged_before_the_serving_limits_gets_their_defaults():
    assert Limits.from_model_config({"max_batch": 8}) == Limits(max_batch=8)
    assert Limits.from_model_config(None) == Limits()
    assert Limits.from_model_config(Limits(3, ServingConfig(max_chars=7)).model_config()).serving.max_chars == 7


def test_logging_a_folder_that_is_no_bundle_names_the_file_and_logs_nothing(tmp_path, model_store):
    with model_store.active(), mlflow.start_run() as run, pytest.raises(ValueError, match=rf"{tmp_path}/bundle.json: "
                                                                                         r"missing"):
        log_bundle_model(tmp_path)
    with model_store.active():
        assert mlflow.MlflowClient().list_artifacts(run.info.run_id) == []
    assert isinstance(BundleModel(), mlflow.pyfunc.PythonModel)
