"""The export bundle as an MLflow pyfunc model, served by ``mlflow models serve`` without the project checkout.

>>> with mlflow.start_run():
...     info = log_bundle_model(Path("data/07_model_output/bundle/<version>/bundle"),
...                             registered_model_name="train_deploy_lm")
>>> model = mlflow.pyfunc.load_model(info.model_uri)
>>> model.predict(pd.DataFrame({"text": ["今天天气很好。"]}))     # score: log-probability, perplexity per text
>>> model.predict(pd.DataFrame({"text": ["中国"]}), params={"task": "generate", "temperature": 0.0})  # greedy

``mlflow.pyfunc`` checks inputs against the signature first, so give it a table; ``BundleModel.predict`` itself
also takes a list of strings, and so does ``mlflow models serve`` (``{"inputs": [...]}``; MLflow's JSON parser
casts those values to strings before the model sees them, so a non-string is refused only in the table forms
``dataframe_split`` and ``dataframe_records``).

The model is saved as "models from code": a three-line script that builds :class:`BundleModel`, the
``train_deploy`` package as ``code_paths`` (MLflow copies the folder to ``code/train_deploy`` and puts
``code/`` first on ``sys.path`` when it loads the model), and the bundle folder as the artifact ``bundle``.
No Python object is serialised (MLflow 3.17 refuses to load a serialised model object unless told to), and
loading needs no project checkout.
"""

from __future__ import annotations

import importlib.metadata
import math
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

import train_deploy
from train_deploy.export.integrity import verify_bundle
from train_deploy.export.runtime import BundleError, LanguageModel, TooLongError, read_bundle
from train_deploy.signals import install_termination_handler

TASKS, BACKENDS = ("score", "generate"), ("auto", "paddle", "onnx")
PARAMS: dict[str, tuple[str, Any]] = {
    "task": ("string", "score"),             # score | generate
    "max_new_tokens": ("long", 32),          # generate: tokens to add at most
    "temperature": ("double", 1.0),          # generate: <= 0 decodes greedily
    "top_k": ("long", 50),                   # generate: sample among the k likeliest tokens (1: greedy)
    "top_p": ("double", 1.0),                # generate: ... whose probabilities add up to top_p (0 < p <= 1)
    "seed": ("long", 0),                     # generate: the sampler's seed, per prompt
    "backend": ("string", "auto"),           # auto (the fastest engine this host runs) | paddle | onnx
    "int8": ("boolean", False),              # onnx only: the int8-quantised model
}
"""Request parameters: MLflow type and default (the signature's ``ParamSchema``)."""
SCORE_COLUMNS = {"text": "string", "tokens": "long", "chars": "long", "log_prob": "double",
                 "mean_log_prob": "double", "perplexity": "double"}
GENERATE_COLUMNS = {"prompt": "string", "generated": "string"}
INPUT_EXAMPLE = ["今天天气很好。", "人民日报"]
SERVING_DISTRIBUTIONS = ("mlflow", "paddlepaddle", "paddlenlp", "sentencepiece", "onnxruntime", "numpy", "pandas",
                         "safetensors", "xxhash", "zstandard")
"""What serving imports (the model, its tokenizer, both backends); pinned to this environment's versions."""
_PYTHON_TYPES = {"string": (str,), "long": (int,), "double": (int, float), "boolean": (bool,)}
_MODEL_SCRIPT = '''"""The train_deploy export bundle as an MLflow model (see train_deploy.registry.model)."""
import mlflow

from train_deploy.registry.model import BundleModel

mlflow.models.set_model(BundleModel())
'''


class BadRequest(MlflowException):
    """A request the caller can fix (HTTP 400), whose message stays as written: MLflow's scoring server puts
    ``Failed to predict data '<the whole input>'`` before a model's error, which would echo every text sent."""

    @property
    def message(self) -> str:
        return self._reason

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_reason"):  # set once, by MlflowException's constructor
            self._reason = value


def bad_request(message: str) -> MlflowException:
    """The error a caller can fix; ``mlflow models serve`` answers it with HTTP 400 and ``message`` alone."""
    return BadRequest(message, error_code=INVALID_PARAMETER_VALUE)


class BundleModel(mlflow.pyfunc.PythonModel):
    """The export bundle as an MLflow model: load_context opens context.artifacts["bundle"] with LanguageModel.

    The engine ``LanguageModel.load`` picks for this host (backend ``auto``: the graph the CPU can run, the
    fastest engine) is opened when the model loads (a broken bundle fails there, not at the first request);
    a pinned backend and int8 when a request first asks for them. Opened models are kept, and requests run
    one at a time (the scoring server calls ``predict`` from several threads; a predictor is not thread-safe).
    """

    def load_context(self, context) -> None:
        install_termination_handler()  # Paddle's import must not take the server's SIGTERM (train_deploy.signals)
        self._bundle = Path(context.artifacts["bundle"])
        self._max_batch = int((context.model_config or {}).get("max_batch", 64))
        self._models: dict[tuple[str, bool], LanguageModel] = {}
        self._lock = threading.Lock()
        self._model("auto", False)

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Score or continue each text; raises :func:`bad_request` errors for what the caller must change."""
        settings = request_params(params)
        texts = input_texts(model_input, self._max_batch, allow_empty=settings["task"] == "generate")
        with self._lock:
            try:
                model = self._model(settings["backend"], settings["int8"])
                if settings["task"] == "score":
                    return score_frame(model, texts)
                # one batch through the KV cache; each prompt keeps its own generator seeded by seed
                return pd.DataFrame({"prompt": texts, "generated": model.generate(
                    texts, settings["max_new_tokens"], settings["temperature"], settings["top_k"], settings["seed"],
                    top_p=settings["top_p"])})
            except TooLongError as exc:  # the client cannot load the model with too_long: it can send less
                raise bad_request(f"{exc.what}: {exc.tokens} tokens exceed the model's context of {exc.context}; "
                                  "send a shorter text") from None
            except BundleError as exc:  # a negative max_new_tokens, a form the bundle lacks
                raise bad_request(str(exc)) from None

    def _model(self, backend: str, int8: bool) -> LanguageModel:
        if (backend, int8) not in self._models:
            self._models[backend, int8] = LanguageModel.load(self._bundle, backend, int8=int8)
        return self._models[backend, int8]


def request_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request's parameters over their defaults, checked; raises :func:`bad_request` naming the parameter."""
    unknown = sorted(set(params or {}) - set(PARAMS))
    if unknown:
        raise bad_request(f"params: unknown {', '.join(unknown)}; expected some of {', '.join(PARAMS)}")
    settings = {name: default for name, (_, default) in PARAMS.items()} | dict(params or {})
    for name, (kind, _) in PARAMS.items():
        value = settings[name]
        if not isinstance(value, _PYTHON_TYPES[kind]) or (kind != "boolean" and isinstance(value, bool)):
            raise bad_request(f"params.{name}: {value!r} is not a {kind}")
    if settings["task"] not in TASKS:
        raise bad_request(f"params.task: {settings['task']!r} is not one of {', '.join(TASKS)}")
    if settings["backend"] not in BACKENDS:
        raise bad_request(f"params.backend: {settings['backend']!r} is not one of {', '.join(BACKENDS)}")
    if settings["int8"] and settings["backend"] != "onnx":
        raise bad_request("params.int8: the int8 model is ONNX; ask for backend 'onnx'")
    return settings


def input_texts(model_input: Any, max_batch: int, *, allow_empty: bool = False) -> list[str]:
    """The texts of a table's ``text`` column (or its only column) or of a list; raises :func:`bad_request`."""
    if isinstance(model_input, pd.DataFrame):
        if "text" in model_input.columns or len(model_input.columns) == 1:
            values = (model_input["text"] if "text" in model_input.columns else model_input.iloc[:, 0]).tolist()
        else:
            raise bad_request(f"input: no 'text' column among {', '.join(map(str, model_input.columns))}")
    elif isinstance(model_input, pd.Series | list | tuple):
        values = list(model_input)
    else:
        raise bad_request(f"input: {type(model_input).__name__} is not a table with a 'text' column or a list "
                          "of strings")
    if not values:
        raise bad_request("input: no texts")
    if len(values) > max_batch:
        raise bad_request(f"input: {len(values)} texts exceed max_batch {max_batch}; send at most {max_batch}")
    for i, value in enumerate(values):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise bad_request(f"text {i}: missing; every row needs a string")
        if not isinstance(value, str):
            raise bad_request(f"text {i}: {value!r} is a {type(value).__name__}, not a string")
        if not value and not allow_empty:
            raise bad_request(f"text {i}: empty; there is nothing to score")
    return values


def score_frame(model: LanguageModel, texts: list[str]) -> pd.DataFrame:
    """One row per text: its token and character counts, summed and mean natural-log probability, perplexity.

    Tokens are scored after the end-of-document id, of the text normalised as the corpus was (the policy the
    bundle's tokenizer records: :meth:`LanguageModel.normalize`, so ``１２３，`` scores as ``123，``); ``chars``
    counts the characters of the text as given, so :func:`nats_per_char` compares models with different tokenizers.
    """
    rows = []
    for i, scored in enumerate(model.score(texts)):
        if not scored.tokens:  # a tokenizer without byte fallback may encode a text to nothing
            raise bad_request(f"text {i}: no tokens; there is nothing to score")
        log_prob = float(sum(scored.log_probs))
        rows.append({"text": scored.text, "tokens": len(scored.tokens), "chars": len(scored.text),
                     "log_prob": log_prob, "mean_log_prob": log_prob / len(scored.tokens),
                     "perplexity": scored.perplexity})
    return pd.DataFrame(rows, columns=list(SCORE_COLUMNS))


def nats_per_char(frame: pd.DataFrame) -> float:
    """Negative log-likelihood per character of a ``score`` frame: ``-sum(log_prob) / sum(chars)`` (nats)."""
    return -float(frame["log_prob"].sum()) / float(frame["chars"].sum())


def signature() -> ModelSignature:
    """Input: a ``text`` string column; params: :data:`PARAMS`; output: the columns of either task."""
    outputs = {**SCORE_COLUMNS, **GENERATE_COLUMNS}
    return ModelSignature(
        inputs=Schema([ColSpec("string", "text")]),
        outputs=Schema([ColSpec(kind, name, required=False) for name, kind in outputs.items()]),
        params=ParamSchema([ParamSpec(name, kind, default) for name, (kind, default) in PARAMS.items()]))


def pinned_requirements() -> list[str]:
    """:data:`SERVING_DISTRIBUTIONS` at the versions installed here (Paddle's GPU wheel where it is the one)."""
    pins = []
    for name in SERVING_DISTRIBUTIONS:
        candidates = (name, "paddlepaddle-gpu") if name == "paddlepaddle" else (name,)
        for candidate in candidates:
            try:
                pins.append(f"{candidate}=={importlib.metadata.version(candidate)}")
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        else:
            raise MlflowException(f"{name}: not installed here, so the served model's requirement cannot be pinned")
    return pins


def log_bundle_model(bundle: Path, *, name: str = "model", max_batch: int = 64,
                     registered_model_name: str | None = None) -> mlflow.models.model.ModelInfo:
    """Log the bundle folder as an MLflow pyfunc model into the active run (artifacts={"bundle": folder}),
    with the :func:`signature`, an input example, ``model_config={"max_batch": max_batch}``, the
    ``train_deploy`` package as ``code_paths`` and :func:`pinned_requirements`. Registers a new version of
    ``registered_model_name`` when given."""
    if max_batch < 1:
        raise bad_request(f"max_batch: {max_batch} must be at least 1")
    verify_bundle(bundle, read_bundle(bundle))  # no bundle, or a damaged one, fails here naming the file, before
    # anything is logged: a damaged bundle never becomes a version
    with tempfile.TemporaryDirectory(prefix="train_deploy-model-") as work:
        script = Path(work) / "bundle_model.py"
        script.write_text(_MODEL_SCRIPT, encoding="utf-8")
        return mlflow.pyfunc.log_model(
            name=name, python_model=str(script), artifacts={"bundle": str(bundle)},
            code_paths=[str(Path(train_deploy.__file__).parent)], signature=signature(),
            input_example=pd.DataFrame({"text": INPUT_EXAMPLE}), model_config={"max_batch": max_batch},
            pip_requirements=pinned_requirements(), registered_model_name=registered_model_name)
