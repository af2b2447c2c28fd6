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

import dataclasses
import importlib.metadata
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

import train_deploy
from train_deploy.export.integrity import verify_bundle
from train_deploy.export.runtime import BundleError, LanguageModel, TooLongError, read_bundle
from train_deploy.registry.config import ServingConfig
from train_deploy.run_control.signals import install_termination_handler

logger = logging.getLogger(__name__)

TASKS, BACKENDS = ("score", "generate"), ("auto", "paddle", "onnx")
PARAMS: dict[str, tuple[str, Any]] = {
    "task": ("string", "score"),             # score | generate
    "max_new_tokens": ("long", 32),          # generate: tokens to add at most
    "temperature": ("double", 1.0),          # generate: 0 decodes greedily; not negative
    "top_k": ("long", 50),                   # generate: sample among the k likeliest tokens (1: greedy, 0: all)
    "top_p": ("double", 1.0),                # generate: ... whose probabilities add up to top_p (0 < p <= 1)
    "seed": ("long", 0),                     # generate: the sampler's seed, per prompt (not negative)
    "backend": ("string", "auto"),           # auto (the fastest engine this host runs) | paddle | onnx
    "int8": ("boolean", False),              # onnx only: the int8-quantised model
}
"""Request parameters: MLflow type and default (the signature's ``ParamSchema``)."""
SCORE_COLUMNS = {"text": "string", "tokens": "long", "chars": "long", "log_prob": "double",
                 "mean_log_prob": "double", "perplexity": "double"}
GENERATE_COLUMNS = {"prompt": "string", "generated": "string"}
INPUT_EXAMPLE = ["今天天气很好。", "人民日报"]
SERVING_DISTRIBUTIONS = ("mlflow", "paddlepaddle", "paddlenlp", "sentencepiece", "onnxruntime", "numpy", "pandas",
                         "safetensors", "xxhash", "zstandard", "pydantic")
"""What serving imports (the model, its tokenizer, both backends, the configuration types); pinned to this
environment's versions."""
_PYTHON_TYPES = {"string": (str,), "long": (int,), "double": (int, float), "boolean": (bool,)}
_MODEL_SCRIPT = '''"""The train_deploy export bundle as an MLflow model (see train_deploy.registry.model)."""
import mlflow

from train_deploy.registry.model import BundleModel

mlflow.models.set_model(BundleModel())
'''


class Refusal(MlflowException):
    """An answer to a request that was not served (HTTP 400 for what the caller can fix, 503 when busy), whose
    message stays as written: MLflow's scoring server puts ``Failed to predict data '<the whole input>'`` before a
    model's error, which would echo every text sent."""

    @property
    def message(self) -> str:
        return self._reason

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_reason"):  # set once, by MlflowException's constructor
            self._reason = value


def bad_request(message: str) -> MlflowException:
    """The error a caller can fix; ``mlflow models serve`` answers it with HTTP 400 and ``message`` alone."""
    return Refusal(message, error_code=INVALID_PARAMETER_VALUE)


def unavailable(message: str) -> MlflowException:
    """A request the server could not serve within its time budget: HTTP 503 and ``message`` alone."""
    return Refusal(message, error_code=TEMPORARILY_UNAVAILABLE)


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What one request may hold: ``registry.max_batch`` texts and ``registry.serving``'s limits, as logged."""

    max_batch: int = 64
    serving: ServingConfig = dataclasses.field(default_factory=ServingConfig)

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any] | None) -> Limits:
        """The limits of a logged model's ``model_config`` (a model logged before ``registry.serving``: defaults)."""
        config = dict(config or {})
        names = [field.name for field in dataclasses.fields(ServingConfig)]
        return cls(max_batch=int(config.get("max_batch", 64)),
                   serving=ServingConfig(**{name: int(config[name]) for name in names if name in config}))

    def model_config(self) -> dict[str, int]:
        return {"max_batch": self.max_batch, **dataclasses.asdict(self.serving)}

    @property
    def max_request_bytes(self) -> int:
        """The largest JSON body a request within the limits can need: ``max_batch`` texts of ``max_chars``
        characters of 12 bytes (a character outside the BMP as JSON's two ``\\uXXXX`` escapes), 64 bytes of
        framing each, and 64 KiB for the rest (parameters, keys, indentation)."""
        return self.max_batch * (self.serving.max_chars * 12 + 64) + 65536


class _Lane:
    """One task's engines and the lock that runs its requests one at a time (a predictor is not thread-safe):
    scoring and generation each have their own, so a long generation never queues a scoring request. Each engine
    gets half the CPU threads the bundle was exported with (``export.server.cpu_threads``, at least 1), as both
    lanes run at once (measured in docs/serving.md: 2 threads each on 2 cores tripled scoring's p99 beside a
    generation and the generation's own time)."""

    def __init__(self, bundle: Path, task: str, threads: int) -> None:
        self.bundle, self.task, self.threads = bundle, task, threads
        self.models: dict[tuple[str, bool], LanguageModel] = {}
        self.lock = threading.Lock()

    def model(self, backend: str, int8: bool) -> LanguageModel:
        if (backend, int8) not in self.models:
            self.models[backend, int8] = LanguageModel.load(self.bundle, backend, int8=int8, threads=self.threads)
        return self.models[backend, int8]


class BundleModel(mlflow.pyfunc.PythonModel):
    """The export bundle as an MLflow model: load_context opens context.artifacts["bundle"] with LanguageModel.

    The engine ``LanguageModel.load`` picks for this host (backend ``auto``: the graph the CPU can run, the
    fastest engine) is opened when the model loads, once for scoring and once for generation (a broken bundle
    fails there, not at the first request); a pinned backend and int8 when a request first asks for them. The
    scoring server calls ``predict`` from several threads: requests of one task run one at a time on that task's
    engines, each waiting at most the model's ``time_budget_s`` (then HTTP 503); generation checks the budget
    after every token. :attr:`limits` (``max_batch`` and ``registry.serving`` as logged) bound every request.
    """

    def load_context(self, context) -> None:
        # Paddle's import must not take the server's SIGTERM (train_deploy.run_control.signals)
        install_termination_handler()
        self.limits = Limits.from_model_config(context.model_config)
        bundle = self.bundle = Path(context.artifacts["bundle"])
        threads = max(1, int(read_bundle(bundle).server["cpu_threads"]) // 2)
        self._lanes = {task: _Lane(bundle, task, threads) for task in TASKS}
        for lane in self._lanes.values():
            lane.model("auto", False)

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Score or continue each text; raises :func:`bad_request` for what the caller must change and
        :func:`unavailable` when the time budget runs out."""
        deadline = time.monotonic() + self.limits.serving.time_budget_s
        settings = request_params(params, self.limits.serving)
        texts = input_texts(model_input, self.limits.max_batch, allow_empty=settings["task"] == "generate",
                            max_chars=self.limits.serving.max_chars)
        return self.answer(texts, settings, deadline)

    def answer(self, texts: list[str], settings: dict[str, Any], deadline: float,
               stopped: Callable[[], bool] | None = None) -> pd.DataFrame:
        """The task's frame for checked ``texts`` and ``settings`` (:func:`request_params`) on its lane's engine,
        waiting for it until ``deadline`` (``time.monotonic()``; then :func:`busy`); ``stopped`` ends a generation
        early."""
        lane = self._lanes[settings["task"]]
        if not lane.lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise busy(lane.task, self.limits.serving.time_budget_s)
        try:
            return answer_frame(lane, texts, settings, self.limits, deadline, stopped)
        finally:
            lane.lock.release()

    def engine(self, task: str, backend: str = "auto", int8: bool = False) -> tuple[LanguageModel, threading.Lock]:
        """The ``task`` lane's engine for ``backend`` (opened on first use) and the lock its callers hold while they
        run it (a predictor is not thread-safe): the HTTP server's workers run the lanes themselves."""
        lane = self._lanes[task]
        if (backend, int8) not in lane.models:
            with lane.lock:
                lane.model(backend, int8)
        return lane.models[backend, int8], lane.lock


def answer_frame(lane: _Lane, texts: list[str], settings: dict[str, Any], limits: Limits, deadline: float,
                 stopped: Callable[[], bool] | None = None) -> pd.DataFrame:
    """The task's frame from ``lane``'s engine (its lock held by the caller), with the model's errors as
    :class:`Refusal`; ``stopped`` ends a generation early (a cancelled request)."""
    try:
        return _answer(lane.model(settings["backend"], settings["int8"]), texts, settings, limits, deadline, stopped)
    except TooLongError as exc:  # the client cannot load the model with too_long: it can send less
        raise bad_request(f"{exc.what}: {exc.tokens} tokens exceed the model's context of {exc.context}; "
                          "send a shorter text") from None
    except BundleError as exc:  # a form the bundle lacks or cannot load: named without the server's path
        raise bad_request(str(exc).replace(str(lane.bundle), "bundle")) from None
    except MlflowException:
        raise
    except Exception:  # logged here; the answer has no traceback, path or input
        logger.exception("%s request of %d texts failed", lane.task, len(texts))
        raise Refusal(f"{lane.task}: the model failed on this request (the server's log says why)",
                      error_code=INTERNAL_ERROR) from None


def busy(task: str, budget_s: int) -> MlflowException:
    """The answer to a request that found no free engine within its time budget (HTTP 503)."""
    return unavailable(f"{task}: busy; no {task} engine was free within the time budget of {budget_s} s "
                       "(time_budget_s); retry later")


def out_of_time(budget_s: int, new_tokens: int) -> MlflowException:
    """The answer to a generation still running at the end of its time budget (HTTP 503)."""
    return unavailable(f"generate: stopped at the time budget of {budget_s} s (time_budget_s) after {new_tokens} new "
                       "tokens; ask for fewer max_new_tokens or prompts")


def check_tokens(model: LanguageModel, texts: list[str], settings: dict[str, Any], limits: Limits) -> int:
    """The request's tokens (its texts', plus ``max_new_tokens`` per prompt when generating); raises
    :func:`bad_request` when they exceed ``max_tokens``."""
    tokens = sum(len(ids) + 1 for ids in model.tokenizer.encode([model.normalize(text) for text in texts]))
    if settings["task"] == "generate":
        tokens += len(texts) * settings["max_new_tokens"]
    if tokens > limits.serving.max_tokens:
        also = f", with {settings['max_new_tokens']} new per prompt," if settings["task"] == "generate" else ""
        raise bad_request(f"input: {tokens} tokens{also} exceed the limit of {limits.serving.max_tokens} per request "
                          "(max_tokens); send fewer or shorter texts")
    return tokens


def _answer(model: LanguageModel, texts: list[str], settings: dict[str, Any], limits: Limits, deadline: float,
            stopped: Callable[[], bool] | None = None) -> pd.DataFrame:
    """The task's frame, once the request's tokens are within ``max_tokens``."""
    check_tokens(model, texts, settings, limits)
    if settings["task"] == "score":
        return score_frame(model, texts)
    return generate_frame(model, texts, settings, deadline, limits.serving.time_budget_s, stopped)


def generate_frame(model: LanguageModel, prompts: list[str], settings: dict[str, Any], deadline: float,
                   budget_s: int, stopped: Callable[[], bool] | None = None) -> pd.DataFrame:
    """One row per prompt and its continuation, generated as one batch through the KV cache (each prompt with its
    own generator seeded by ``seed``); raises :func:`unavailable` when a token arrives after ``deadline``, and ends
    early (with the tokens so far) once ``stopped()`` is true."""
    new: list[list[int]] = [[] for _ in prompts]
    stream = model.generate_stream(prompts, settings["max_new_tokens"], settings["temperature"], settings["top_k"],
                                   settings["seed"], top_p=settings["top_p"])
    for event in stream:
        new[event.sequence].append(event.token)
        if time.monotonic() > deadline:
            stream.close()
            raise out_of_time(budget_s, sum(map(len, new)))
        if stopped is not None and stopped():
            stream.close()
            break
    return pd.DataFrame({"prompt": prompts, "generated": [model.tokenizer.decode(ids) for ids in new]})


def request_params(params: Mapping[str, Any] | None, serving: ServingConfig) -> dict[str, Any]:
    """The request's parameters over their defaults, checked against their types, ranges and ``serving``'s
    ``max_new_tokens``; raises :func:`bad_request` naming the parameter."""
    if params is not None and not isinstance(params, Mapping):
        raise bad_request(f"params: a {type(params).__name__}, not an object of names and values")
    unknown = sorted(map(str, set(params or {}) - set(PARAMS)))
    if unknown:
        shown = ", ".join(name if len(name) <= 40 else f"{name[:40]}…" for name in unknown[:5])
        raise bad_request(f"params: unknown {shown}{', …' if len(unknown) > 5 else ''}; expected some of "
                          f"{', '.join(PARAMS)}")
    settings = {name: default for name, (_, default) in PARAMS.items()} | dict(params or {})
    for name, (kind, _) in PARAMS.items():
        value = settings[name]
        if not isinstance(value, _PYTHON_TYPES[kind]) or (kind != "boolean" and isinstance(value, bool)):
            raise bad_request(f"params.{name}: {_shown(value)} is not a {kind}")
        if kind == "double" and not math.isfinite(value):
            raise bad_request(f"params.{name}: {value} is not a finite number")
    _check_ranges(settings, serving)
    return settings


def _check_ranges(settings: dict[str, Any], serving: ServingConfig) -> None:
    if settings["task"] not in TASKS:
        raise bad_request(f"params.task: {_shown(settings['task'])} is not one of {', '.join(TASKS)}")
    if settings["backend"] not in BACKENDS:
        raise bad_request(f"params.backend: {_shown(settings['backend'])} is not one of {', '.join(BACKENDS)}")
    if settings["int8"] and settings["backend"] != "onnx":
        raise bad_request("params.int8: the int8 model is ONNX; ask for backend 'onnx'")
    if not 0 <= settings["max_new_tokens"] <= serving.max_new_tokens:
        raise bad_request(f"params.max_new_tokens: {settings['max_new_tokens']} is outside 0 to "
                          f"{serving.max_new_tokens}, the limit per prompt (max_new_tokens)")
    for name, note in (("temperature", "0 decodes greedily"), ("top_k", "0 samples among all tokens"),
                       ("seed", "a seed is 0 or more")):
        if settings[name] < 0:
            raise bad_request(f"params.{name}: {settings[name]} is negative; {note}")
    if not 0 < settings["top_p"] <= 1:
        raise bad_request(f"params.top_p: {settings['top_p']} is outside (0, 1]")


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 40 characters: a parameter's value is never echoed whole."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}…"


def input_texts(model_input: Any, max_batch: int, *, allow_empty: bool = False,
                max_chars: int | None = None) -> list[str]:
    """The texts of a table's ``text`` column (or its only column) or of a list, at most ``max_batch`` of at most
    ``max_chars`` characters each (checked before anything reads them); raises :func:`bad_request`."""
    if isinstance(model_input, pd.DataFrame):
        if "text" in model_input.columns or len(model_input.columns) == 1:
            values = (model_input["text"] if "text" in model_input.columns else model_input.iloc[:, 0]).tolist()
        else:
            columns = ", ".join(map(str, model_input.columns))
            raise bad_request(f"input: no 'text' column among {columns if len(columns) <= 80 else columns[:80] + '…'}")
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
            raise bad_request(f"text {i}: {_shown(value)} is a {type(value).__name__}, not a string")
        if max_chars is not None and len(value) > max_chars:
            raise bad_request(f"text {i}: {len(value)} characters exceed the limit of {max_chars} (max_chars); "
                              "send a shorter text")
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


def log_bundle_model(bundle: Path, *, name: str = "model", max_batch: int = 64, serving: ServingConfig | None = None,
                     registered_model_name: str | None = None) -> mlflow.models.model.ModelInfo:
    """Log the bundle folder as an MLflow pyfunc model into the active run (artifacts={"bundle": folder}),
    with the :func:`signature`, an input example, the request limits as ``model_config`` (``max_batch`` and
    ``serving``'s fields: :class:`Limits`), the ``train_deploy`` package as ``code_paths`` and
    :func:`pinned_requirements`. Registers a new version of ``registered_model_name`` when given."""
    if max_batch < 1:
        raise bad_request(f"max_batch: {max_batch} must be at least 1")
    limits = Limits(max_batch=max_batch, serving=serving or ServingConfig())
    verify_bundle(bundle, read_bundle(bundle))  # no bundle, or a damaged one, fails here naming the file, before
    # anything is logged: a damaged bundle never becomes a version
    with tempfile.TemporaryDirectory(prefix="train_deploy-model-") as work:
        script = Path(work) / "bundle_model.py"
        script.write_text(_MODEL_SCRIPT, encoding="utf-8")
        return mlflow.pyfunc.log_model(
            name=name, python_model=str(script), artifacts={"bundle": str(bundle)},
            code_paths=[str(Path(train_deploy.__file__).parent)], signature=signature(),
            input_example=pd.DataFrame({"text": INPUT_EXAMPLE}), model_config=limits.model_config(),
            pip_requirements=pinned_requirements(), registered_model_name=registered_model_name)
