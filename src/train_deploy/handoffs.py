"""Typed descriptions that cross stage boundaries, and their JSON form (:func:`to_json`, :func:`from_json`).

Each stage returns one of these instead of a dict: the corpus stage a :class:`TokenizerInfo` and a
:class:`TokenManifest`, training a :class:`TrainingResult` (its workers get a ``RunSpec``,
``train_deploy.training.spec``, which holds the stage's own configuration),
averaging a :class:`CheckpointRef` per candidate and a :class:`SelectedCheckpoint`, export a
:class:`Bundle`. :func:`to_json` / :func:`from_json` convert them; reading is pydantic's, as for the parameter
blocks (:data:`DESCRIPTION`: unknown keys refused, strict types), and its one-line error names the file and the key.
The descriptions stay plain dataclasses: stages build them from values they computed, so only JSON read back from
disk is validated.

A description of a folder has a ``path`` that is never written into its JSON: the folder is staged under
one name and published under another, and may be copied elsewhere (an MLflow artifact store).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config

from train_deploy import atomic
from train_deploy.config import ConfigError, error_text

T = TypeVar("T")

# The file in each artifact folder that describes it.
TOKENIZER_FILE, MANIFEST_FILE, STATE_FILE = "train_deploy_tokenizer.json", "manifest.json", "state.json"
BUNDLE_FILE, PARITY_FILE, LATENCY_FILE, CARD_FILE = "bundle.json", "parity.json", "latency.json", "MODEL_CARD.md"
METRICS_FILE = "metrics.jsonl"
"""Rank 0's per-step training metrics, one JSON object per line, in a run's log folder."""

_LOCAL = {"json": False}  # metadata of fields that describe this machine or this run, not the artifact

DESCRIPTION = ConfigDict(extra="forbid", strict=True)
"""How a description is read back (``@with_config(DESCRIPTION)`` on each): unknown keys refused, no coercion."""


class DescriptionError(ValueError):
    """A description file is missing, unreadable or not of the expected form; the message names the file."""


def to_json(obj: Any) -> Any:
    """The JSON form of a description dataclass (nested ones included), without its local fields."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.metadata.get("json", True)}
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_json(v) for v in obj]
    return obj


def from_json(cls: type[T], data: Any, where: str) -> T:
    """Build ``cls`` from its JSON form; ``where`` (a file) names the source in the error."""
    if not isinstance(data, Mapping):
        raise DescriptionError(f"{where}: expected a mapping, got {type(data).__name__}")
    try:  # as JSON: strict mode takes a nested configuration block (a RunSpec's training) only as an object there
        return _reader(cls).validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:  # an unknown key first: a misspelt key also leaves one missing
        first = min(exc.errors(), key=lambda error: error["type"] != "unexpected_keyword_argument")
        raise DescriptionError(f"{where}: {_problem(first)}") from None


@functools.cache
def _reader(cls: type[T]) -> TypeAdapter[T]:
    return TypeAdapter(cls)


def _problem(error: Mapping[str, Any]) -> str:
    """Pydantic's ``error`` as ``<key>: <what is wrong>`` (``splits.valid.tokens: expected an integer, got 'many'``)."""
    if error["type"] == "value_error" and isinstance(error["ctx"]["error"], ConfigError):
        return str(error["ctx"]["error"])  # a nested configuration block's own rule names its key
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).removeprefix(".")
    return f"{key}: {error_text(error)}" if key else error_text(error)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` (a description or plain JSON data) as indented UTF-8 JSON, atomically (``atomic.write_json``)."""
    atomic.write_json(Path(path), to_json(obj))


def read_json(cls: type[T], file: Path, **local: Any) -> T:
    """Read a description of type ``cls`` from ``file``; ``local`` sets its local fields (e.g. ``path``)."""
    file = Path(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DescriptionError(f"{file}: missing") from None
    except (OSError, ValueError) as exc:
        raise DescriptionError(f"{file}: unreadable ({exc})") from None
    if isinstance(data, dict):
        data = {**data, **local}
    return from_json(cls, data, str(file))


# --- corpus ------------------------------------------------------------------------------------------


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class TokenizerInfo:
    """What the encoder and later stages need to know about a saved tokenizer folder."""

    path: str = field(default="", metadata=_LOCAL)
    """The tokenizer folder (PaddleNLP ``LlamaTokenizer`` layout)."""
    vocab_size: int
    eos_id: int
    hash: str
    """blake2b of the files that define the tokenizer."""
    encoder: str
    """`sentencepiece` (fast path) or `paddlenlp` (any other PaddleNLP tokenizer)."""
    fingerprint: str
    """Inputs and configuration the tokenizer was built from; equal fingerprints allow reuse."""
    source: str
    """`trained` or the folder it was loaded from."""
    reused: bool = field(default=False, metadata=_LOCAL)
    """This run found an identical tokenizer already saved and kept it."""

    @classmethod
    def read_folder(cls, folder: Path) -> TokenizerInfo:
        return read_json(cls, Path(folder) / TOKENIZER_FILE, path=str(folder))


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class SplitInfo:
    """One split of the token files: ``<prefix>.bin`` and ``<prefix>.idx`` in the token folder."""

    prefix: str
    documents: int
    tokens: int
    bin_bytes: int = 0
    idx_bytes: int = 0


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class DocumentCounts:
    read: int
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    """By cleaning rule: too_short, duplicate, …"""
    skipped_bad_input: dict[str, int] = field(default_factory=dict)
    """By kind of bad input, with ``reader.on_error: skip``."""


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class TokenManifest:
    """The token folder: ``{train,valid}.{bin,idx}`` in PaddleNLP's mmap format, and how they were made."""

    path: str = field(default="", metadata=_LOCAL)
    reused: bool = field(default=False, metadata=_LOCAL)
    """This run found the same fingerprint already encoded and kept those files."""
    format: str
    fingerprint: str
    """Inputs, reading, cleaning, split and tokenizer: equal fingerprints, equal bytes."""
    created_at: str
    dtype: str
    """Token id dtype of the ``.bin`` files (uint16 or int32)."""
    tokenizer: TokenizerInfo
    splits: dict[str, SplitInfo]
    documents: DocumentCounts
    tokens: dict[str, int]
    input: dict[str, Any]
    config: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    workers: int
    compiled_kernels: bool
    peak_rss_mb: dict[str, Any]
    wall_time_seconds: float
    throughput: dict[str, float]

    @classmethod
    def read_folder(cls, folder: Path) -> TokenManifest:
        return read_json(cls, Path(folder) / MANIFEST_FILE, path=str(folder))

    def prefix(self, split: str) -> Path:
        """``<folder>/<prefix>`` of a split (``train`` or ``valid``), as PaddleNLP's readers take it."""
        return Path(self.path) / self.splits[split].prefix


# --- training ----------------------------------------------------------------------------------------


@with_config(DESCRIPTION)
@dataclass(frozen=True, slots=True)
class WorkFolder:
    """A folder that processes fill while a node runs (checkpoints, launcher logs); one sub-folder a run."""

    path: str

    def run(self, run_name: str) -> Path:
        return Path(self.path) / run_name


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class DataSpec:
    """The token files and tokenizer a training run reads."""

    train_prefix: str
    valid_prefix: str
    dtype: str
    vocab_size: int
    eos_id: int
    corpus_fingerprint: str
    tokenizer_hash: str

    @classmethod
    def of(cls, token_files: TokenManifest) -> DataSpec:
        """The token files ``token_files`` describes and the tokenizer they were encoded with."""
        tokenizer = token_files.tokenizer
        return cls(train_prefix=str(token_files.prefix("train")), valid_prefix=str(token_files.prefix("valid")),
                   dtype=token_files.dtype, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                   corpus_fingerprint=token_files.fingerprint, tokenizer_hash=tokenizer.hash)


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class InitSource:
    """Where training starts (``training.init_from``), resolved before the corpus stage, which takes the
    tokenizer from it; the training workers load its weights."""

    requested: str
    """``training.init_from`` as configured: ``scratch``, ``champion`` or a folder."""
    path: str = ""
    """The PaddleNLP model folder (``save_pretrained`` layout) whose weights and tokenizer are used; empty for
    scratch."""
    hash: str = ""
    """Content hash of that folder (its files, not its path)."""
    tokenizer_path: str = ""
    """The folder's tokenizer files alone, for the corpus stage (``corpus.tokenizer.mode: load`` from it)."""
    shape: dict[str, Any] = field(default_factory=dict)
    """The model configuration keys taken from the folder's ``config.json`` (the preset is ignored)."""
    champion_version: str = ""
    """``champion``: the registered version the weights come from."""
    reason: str = ""
    """Why a ``champion`` start fell back to scratch (no champion, another tokenizer configuration)."""
    tokenizer_config_fingerprint: str
    """Digest of this run's cleaning and tokenizer configuration (not its inputs): compared with the champion's
    version tag of the same name."""

    def result_fields(self) -> dict[str, str]:
        """The :class:`TrainingResult` fields that record this start."""
        return {"init_from": self.started_from, "init_from_hash": self.hash, "init_from_reason": self.reason,
                "tokenizer_config_fingerprint": self.tokenizer_config_fingerprint}

    @property
    def started_from(self) -> str:
        """``scratch``, ``champion`` or ``folder``: what the weights really start from."""
        if not self.path:
            return "scratch"
        return "champion" if self.requested == "champion" else "folder"


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class CurveDiagnosis:
    """What a training run's own loss curves say (``training.diagnosis.diagnose``, which states the rule)."""

    kind: Literal["overfitting", "underfitting", "converged", "unknown"]
    """The case the curves show; ``unknown`` when they are too short or fit none."""
    summary: str
    """One sentence: the case and the figures of the curves that show it."""
    advice: str = ""
    """What could do better, for the case (empty when unknown)."""
    best_step: int | None = None
    """The evaluation step where validation loss was lowest (None without two evaluations)."""
    best_val_loss: float | None = None
    """The validation loss at ``best_step``, nats/token."""
    last_val_loss: float | None = None
    """The validation loss of the last evaluation, nats/token."""


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class TrainingResult:
    """Where a training run ended: its last checkpoint and the numbers rank 0 saw."""

    run_name: str
    """Corpus and configuration digest: checkpoints of equal runs share a folder."""
    step: int
    consumed_samples: int
    finished: bool
    """False when stopped early by ``schedule.stop_after``."""
    checkpoints: str
    checkpoint: str
    """The last checkpoint's folder."""
    val_loss: float | None
    seq_length: int
    """Tokens per training window (``training.batch.seq_length``)."""
    eval_windows: int
    """Validation windows every evaluation of this run used (the first ones of the split)."""
    parameters: int
    layout: dict[str, int]
    init_from: str = "scratch"
    """What the weights started from: ``scratch``, ``champion`` or ``folder`` (``training.init_from``)."""
    init_from_hash: str = ""
    """Content hash of the model folder the weights started from."""
    init_from_reason: str = ""
    """Why ``init_from: champion`` fell back to scratch."""
    tokenizer_config_fingerprint: str = ""
    """The run's cleaning and tokenizer configuration digest (:class:`InitSource`), tagged on the version."""
    diagnosis: CurveDiagnosis | None = None
    """What the run's loss curves say (the training node's reading of ``metrics.jsonl``); None from the workers."""


# --- averaging ---------------------------------------------------------------------------------------


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class FileRecord:
    """What ``state.json`` records of each other file of its checkpoint (``verify_checkpoint`` compares)."""

    bytes: int
    xxh3_128: str


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class AveragedSource:
    """One checkpoint an average was made of."""

    path: str
    step: int | None = None
    xxh3_128: str | None = None
    """Of its model file, as averaging read it."""


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class Averaging:
    """How an averaged checkpoint's weights were made (``state.json``'s ``averaged``)."""

    fingerprint: str | None = None
    """Of the sources and the method: equal fingerprints, equal weights."""
    method: str | None = None
    """``uniform`` or ``ema``."""
    decay: float | None = None
    """``ema``'s decay; None for ``uniform``."""
    weights: list[float] = field(default_factory=list)
    sources: list[AveragedSource] = field(default_factory=list)
    """Oldest first."""
    copied_from_newest: list[str] = field(default_factory=list)
    """Tensors taken from the newest source rather than averaged (integer and boolean ones)."""
    note: str = ""


_TRAINED_ORDER = ("step", "consumed_samples", "val_loss", "lr", "layout", "model_config", "training", "data",
                  "parameters", "files")
_AVERAGED_ORDER = ("step", "model_config", "data", "training", "parameters", "val_loss", "averaged", "files")


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class CheckpointState:
    """A checkpoint folder's ``state.json``, written by the training workers (rank 0) and by averaging, read
    (:meth:`read`) by resuming, averaging, export and evaluation. Keys a checkpoint does not have (an averaged one
    has no optimizer position; older ones may lack some) are None and left out of the file."""

    step: int
    consumed_samples: int | None = None
    """Global sample index of the next batch: where a resumed run continues."""
    val_loss: float | None = None
    """The last evaluation's, when the checkpoint was written (None: none yet, or an average)."""
    lr: float | None = None
    layout: dict[str, int] | None = None
    """The parallel layout that wrote it (``dp``, ``mp``, ``pp``, ``sharding_stage``); any layout reads it."""
    model_config: dict[str, Any] | None = None
    """PaddleNLP's ``LlamaConfig.to_dict()`` of the trained model."""
    training: dict[str, Any] | None = None
    """The run's ``TrainingConfig`` in its JSON form."""
    data: dict[str, Any] | None = None
    """The run's ``DataSpec`` in its JSON form (``corpus_fingerprint``: what it was trained on)."""
    parameters: int | None = None
    averaged: Averaging | None = None
    files: dict[str, FileRecord] | None = None
    """Every other file of the checkpoint by name: what it must be (None: written before files were recorded)."""

    @classmethod
    def read(cls, folder: Path) -> CheckpointState:
        """The state of checkpoint ``folder``; every key and type checked, the file named in the error."""
        path = Path(folder) / STATE_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # a missing file too: is the folder a checkpoint?
            raise DescriptionError(f"{path}: unreadable checkpoint state ({exc})") from None
        if not isinstance(data, dict) or "step" not in data:
            raise DescriptionError(f"{path}: unreadable checkpoint state (not a JSON object with a step)")
        return from_json(cls, data, str(path))

    def record(self) -> dict[str, Any]:
        """The JSON form, keys in the order each writer has always used (so checkpoints stay byte-identical)."""
        data = to_json(self)
        order = _AVERAGED_ORDER if self.averaged is not None else _TRAINED_ORDER
        return {key: data[key] for key in order if data[key] is not None or key == "val_loss"}

    def write(self, folder: Path) -> None:
        """Write ``folder/state.json`` (inside a folder still being staged: no atomic rename of its own)."""
        (Path(folder) / STATE_FILE).write_text(json.dumps(self.record(), indent=2), encoding="utf-8")


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class CheckpointRef:
    """One checkpoint folder (``model.safetensors`` + ``state.json``) and what its state says of it."""

    path: str
    step: int
    val_loss: float | None = None
    averaged_from: list[str] = field(default_factory=list)
    """Source checkpoints, oldest first, when these weights are an average."""
    method: str | None = None
    """``uniform`` or ``ema`` for an averaged checkpoint."""
    fingerprint: str | None = None
    """Of an averaged checkpoint: its sources and method; equal fingerprints, equal weights."""

    @classmethod
    def read_folder(cls, folder: Path) -> CheckpointRef:
        """The reference to a checkpoint folder, from its ``state.json``."""
        state = CheckpointState.read(folder)
        averaged = state.averaged or Averaging()
        return cls(path=str(folder), step=state.step, val_loss=state.val_loss,
                   averaged_from=[source.path for source in averaged.sources], method=averaged.method,
                   fingerprint=averaged.fingerprint)


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class SelectedCheckpoint:
    """The checkpoint export gets, and why."""

    checkpoint: CheckpointRef
    which: str
    """``averaged`` or ``last``."""
    reason: str
    validation_loss: float
    evaluated_on_windows: int


# --- export ------------------------------------------------------------------------------------------

OLDEST_BUNDLE_FORMAT = 7
"""The oldest ``bundle.json`` ``format`` read (``train_deploy.export.bundle.FORMAT`` says what each added); older
bundles are refused with a line that says to re-export them."""
HASHED_BUNDLE_FORMAT = 9
"""The first ``format`` whose ``files`` record each file's size and xxh3-128 hash (before: sizes only)."""


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class BundleSource:
    """What a bundle was exported from (``bundle.json`` ``source``)."""

    checkpoint: str
    """The checkpoint folder, as the exporting machine named it."""
    step: int
    val_loss: float | None = None
    """The checkpoint's validation loss; the evaluation node's for the selected weights when given."""
    averaged: str | None = None
    """``uniform`` or ``ema`` for averaged weights."""
    selection: str = ""
    """Why this checkpoint was selected."""
    val_baselines: dict[str, Any] | None = None
    """The n-gram baselines of the windows ``val_loss`` was measured on (``Baselines`` report)."""
    corpus: dict[str, Any] = field(default_factory=dict)
    """The corpus: ``fingerprint``, ``reader`` and each split's documents and tokens."""
    diagnosis: CurveDiagnosis | None = None
    """What the training run's loss curves said (bundles made before the diagnosis have none)."""


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class BundleModel:
    """The exported model's shape (``bundle.json`` ``model``)."""

    architecture: str
    parameters: int | None = None
    context: int
    """Tokens a sequence may hold (``max_position_embeddings``), the end-of-document id included."""
    vocab_size: int
    eos_id: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int | None = None


@with_config(DESCRIPTION)
@dataclass(frozen=True, slots=True)
class ServerGraph:
    """One Paddle Inference graph of a bundle (``bundle.json`` ``graphs.<folder>``)."""

    kernels: list[str] = field(default_factory=list)
    """The fused CPU kernels it calls (empty: portable operators only)."""
    needs: list[str] = field(default_factory=list)
    """What a host needs to run it: ``probe:<kernel>`` (the kernel probe passes on this CPU, or a GPU)."""


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class BundleMeta:
    """``bundle.json``: what a bundle is (``train_deploy.export.bundle``), read by :meth:`read` alone."""

    format: int
    """What the bundle holds (``train_deploy.export.bundle.FORMAT``); at least :data:`OLDEST_BUNDLE_FORMAT`."""
    version: str
    fingerprint: str
    """Of the checkpoint, tokenizer, export configuration and training curves: equal ones, equal bundles."""
    created_at: str
    source: BundleSource
    model: BundleModel
    tokenizer: dict[str, Any]
    """The tokenizer's :class:`TokenizerInfo` in its JSON form, ``path`` relative to the bundle."""
    too_long: str
    """``raise`` or ``truncate``: what a text longer than the context gets."""
    server: dict[str, Any]
    """The ``export.server`` settings (``ServerConfig``) the bundle was proven with and loads with."""
    edge: dict[str, Any]
    """The ``export.edge`` settings (``EdgeConfig``)."""
    software: dict[str, str]
    """Versions of what exported it: ``paddlepaddle``, ``paddle2onnx``, ``onnxruntime``."""
    graphs: dict[str, ServerGraph] | None = None
    """The Paddle Inference graphs by folder (None: format 7, the fused graph only)."""
    kernel_probe: dict[str, Any] | None = None
    """Whether the exporting machine ran the fused kernels (``runs``) and why (``reason``)."""
    plots: dict[str, str] = field(default_factory=dict)
    """Each picture's file, relative to the bundle."""
    training_curves: dict[str, Any] = field(default_factory=dict)
    """Where the training picture's curves came from, or why there are none."""
    files: dict[str, FileRecord | int] = field(default_factory=dict)
    """Every other file of the bundle by relative POSIX name: its size and xxh3-128 hash (format 9 on; before:
    its size alone), which loading checks (``train_deploy.export.integrity``)."""

    @classmethod
    def read(cls, folder: Path) -> BundleMeta:
        """``folder``'s ``bundle.json``, every key and type checked; an older format than this code reads is
        refused in one line that says to re-export."""
        path = Path(folder) / BUNDLE_FILE
        data = _bundle_part(path, Path(folder))
        found = data.get("format") if isinstance(data, dict) else None
        if not isinstance(found, int) or found < OLDEST_BUNDLE_FORMAT:
            raise DescriptionError(f"{path}: bundle format {found} is older than the graphs this runtime runs "
                                   f"(format {OLDEST_BUNDLE_FORMAT}); re-export it (kedro run --pipelines export)")
        return from_json(cls, data, str(path))

    def sizes(self) -> dict[str, int]:
        """Each recorded file's size in bytes, by relative name."""
        return {name: record.bytes if isinstance(record, FileRecord) else record for name, record in self.files.items()}


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class ParityReport:
    """``parity.json``: every form's logits against the trained model (``train_deploy.export.checks``)."""

    samples: int
    seq_length: int
    reference: str
    precision: dict[str, str] = field(default_factory=dict)
    """Each form's precision (``fp32``, ``fp16``, ``int8``)."""
    max_abs_logit_diff: dict[str, float]
    perplexity: dict[str, float]
    """Of the reference (``trained``) and of each form, on the parity windows."""
    limits: dict[str, float]
    baselines: dict[str, Any] | None = None
    """The n-gram baselines of the parity windows (``Baselines`` report; None before format 4)."""
    fp16_perplexity_increase: dict[str, float] | None = None
    int8_perplexity_increase: float | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: bool
    kv_cache: dict[str, Any] | None = None
    """Generation with the KV cache against full recomputation (``cache_parity_report``)."""
    not_shipped: dict[str, str] | None = None
    """Graphs the bundle does not ship, and why."""

    def record(self) -> dict[str, Any]:
        """The JSON form, without the keys a report does not have."""
        return {key: value for key, value in to_json(self).items() if value is not None}

    @classmethod
    def read(cls, folder: Path) -> ParityReport:
        path = Path(folder) / PARITY_FILE
        return from_json(cls, _bundle_part(path, Path(folder)), str(path))


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class LatencyReport:
    """``latency.json``: each form's forward pass (p50/p95 by batch) and generation speed, measured at export."""

    seq_length: int
    repeats: int
    unit: str
    forms: dict[str, dict[str, dict[str, float]]]
    """``forms.<form>.batch_<n>``: ``p50``, ``p95``, … in :attr:`unit`."""
    generation: dict[str, Any] | None = None
    """Milliseconds per new token of a short greedy generation (``forms.<form>.ms_per_token``)."""

    def record(self) -> dict[str, Any]:
        return {key: value for key, value in to_json(self).items() if value is not None}

    @classmethod
    def read(cls, folder: Path) -> LatencyReport:
        path = Path(folder) / LATENCY_FILE
        return from_json(cls, _bundle_part(path, Path(folder)), str(path))


def _bundle_part(path: Path, folder: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DescriptionError(f"{path}: missing; is {folder} an exported bundle?") from None
    except (OSError, ValueError) as exc:
        raise DescriptionError(f"{path}: unreadable ({exc})") from None


@with_config(DESCRIPTION)
@dataclass(kw_only=True, slots=True)
class Bundle:
    """An exported bundle folder (see ``train_deploy.export.bundle``) with its proofs."""

    path: str = field(default="", metadata=_LOCAL)
    reused: bool = field(default=False, metadata=_LOCAL)
    """This run found the same checkpoint, tokenizer and configuration already exported."""
    meta: BundleMeta
    """``bundle.json``: source, model shape, tokenizer, runtime settings, files and their records."""
    parity: ParityReport
    latency: LatencyReport
    card: str
    """``MODEL_CARD.md``."""

    @property
    def fingerprint(self) -> str:
        return self.meta.fingerprint

    @classmethod
    def read_folder(cls, folder: Path) -> Bundle:
        folder = Path(folder)
        meta, parity, latency = BundleMeta.read(folder), ParityReport.read(folder), LatencyReport.read(folder)
        try:
            card = (folder / CARD_FILE).read_text(encoding="utf-8")
        except OSError as exc:
            raise DescriptionError(f"{folder / CARD_FILE}: unreadable ({exc})") from None
        return cls(path=str(folder), meta=meta, parity=parity, latency=latency, card=card)
