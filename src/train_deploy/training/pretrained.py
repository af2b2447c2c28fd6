"""Warm starts (``training.init_from``): a PaddleNLP Llama model folder, or the registered champion's bundle.

A model folder is what ``LlamaForCausalLM.save_pretrained(folder, safe_serialization=True)`` writes, plus a
tokenizer saved beside it::

    config.json                       the LlamaConfig: the model shape comes from here (the preset is ignored)
    model.safetensors                 the weights (or model-0000x-of-0000n.safetensors + model.safetensors.index.json)
    tokenizer_config.json, …          the tokenizer: the corpus stage encodes with it

Only safetensors are read: ``model_state.pdparams`` is a pickle, which could run code when loaded. The weights
have the structured names of PaddleNLP's ``LlamaForCausalLM``, which are those of ``LlamaForCausalLMNet`` the
workers train. ``init_from: champion`` downloads the champion's bundle, whose ``pretrained/`` folder has this
layout (``train_deploy.export.bundle``), and uses it as any other folder. Warm starts load weights only: the
optimizer and the learning-rate schedule (with its warm-up) start afresh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any

from train_deploy.config import ConfigError
from train_deploy.handoffs import InitSource

logger = logging.getLogger(__name__)

SCRATCH, CHAMPION = "scratch", "champion"
CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
PICKLED_WEIGHTS = ("model_state.pdparams", "pytorch_model.bin")
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")
"""What is taken from ``config.json``: the shape and every setting that changes what the weights compute."""
SHAPE_KEYS = CONFIG_KEYS[1:7]
"""Required in ``config.json``: the keys of a preset."""
TOKENIZER_TAG = "tokenizer.config_fingerprint"
"""The version tag holding :func:`tokenizer_config_fingerprint` of the run that trained it."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder`` (one, or the shards its index names); refuse pickled weights."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index}: not a safetensors index ({exc!r})") from None
        outside = [name for name in names if not _inside(name)]
        if outside:
            raise ConfigError(f"{index}: names {str(outside[0])[:80]!r}, which is not a .safetensors file of the "
                              "folder itself (no absolute path, no '..'); refusing to read it (training.init_from)")
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ConfigError(f"{index}: names {missing[0]}, which is not in {folder}")
        return [folder / name for name in names]
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    pickled = [name for name in PICKLED_WEIGHTS if (folder / name).is_file()]
    if pickled:
        raise ConfigError(f"{folder / pickled[0]}: pickled weights are not loaded (a pickle can run code); re-save "
                          "the model with save_pretrained(folder, safe_serialization=True) (training.init_from)")
    raise ConfigError(f"{folder}: no {WEIGHTS_FILE} nor {WEIGHTS_INDEX}; save the model with "
                      "save_pretrained(folder, safe_serialization=True) (training.init_from)")


def _inside(name: object) -> bool:
    """Whether a weight index's file name stays in its folder: a relative ``.safetensors`` path without ``..``
    (a shard may sit in a sub-folder; links are followed as the folder's owner laid them out)."""
    if not isinstance(name, str) or not name.endswith(".safetensors") or "\\" in name or "\0" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts and path.parts[:1] != ("",)


def model_config(folder: Path) -> dict[str, Any]:
    """The :data:`CONFIG_KEYS` of ``folder``'s ``config.json``, checked to describe a Llama-family model."""
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; training.init_from needs a folder written by save_pretrained") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    family = str(config.get("model_type", "")) + " ".join(map(str, config.get("architectures") or []))
    if "llama" not in family.lower():
        raise ConfigError(f"{path}: model_type {config.get('model_type')!r} is not a Llama-family causal LM, the "
                          "only kind train_deploy trains")
    for key in ("vocab_size", *SHAPE_KEYS):
        value = config.get(key)
        if type(value) is not int or value < 1:
            raise ConfigError(f"{path}: {key} must be a positive integer (got {value!r})")
    return {key: config[key] for key in CONFIG_KEYS if key in config}


def folder_hash(folder: Path) -> str:
    """Content hash of every file of ``folder`` (names and bytes), remembered while no file changes."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise ConfigError(f"{folder}: training.init_from is not scratch, champion nor a folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return _hash(folder, tuple((p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                               for p in files))


@functools.lru_cache(maxsize=8)
def _hash(folder: Path, files: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name, _, _ in files:
        digest.update(name.encode() + b"\0")
        with open(folder / name, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def init_identity(init_from: str) -> str:
    """What ``init_from`` contributes to a run's identity: the word, or a folder's content hash."""
    return init_from if init_from in (SCRATCH, CHAMPION) else f"folder:{folder_hash(Path(init_from))}"


def copy_tokenizer(folder: Path, target: Path) -> Path:
    """``target`` holding ``folder``'s files but its weights (the tokenizer and configuration), made once."""
    if not target.is_dir():
        staging = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(folder, staging, ignore=shutil.ignore_patterns("*.safetensors", WEIGHTS_INDEX,
                                                                       *PICKLED_WEIGHTS))
        staging.rename(target)
    return target


def tokenizer_config_fingerprint(corpus_config) -> str:
    """Digest of what makes a tokenizer besides the text: the cleaning and the tokenizer block (threads aside).
    Equal to the champion's tag: the champion's tokenizer is the one this configuration asks for."""
    tokenizer = {k: v for k, v in asdict(corpus_config.tokenizer).items() if k != "num_threads"}
    payload = {"cleaning": asdict(corpus_config.cleaning), "tokenizer": tokenizer}
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()


def load_pretrained_weights(model, folder: Path) -> None:
    """Set every parameter of ``model`` (built, not yet parallelised) from ``folder``'s safetensors, cast to the
    model's dtypes; a missing tensor or another shape is refused naming the file and the tensor."""
    from train_deploy.training.checkpoint import CheckpointError, read_tensors

    expected = dict(model.state_dict())
    weights: dict[str, Any] = {}
    files = weight_files(folder)
    for path in files:
        weights.update({name: tensor for name, tensor in read_tensors(path).items() if name in expected})
    where = files[0] if len(files) == 1 else Path(folder) / WEIGHTS_INDEX
    for name, target in expected.items():
        if name not in weights:
            raise CheckpointError(f"{where}: no tensor {name!r}, which {type(model).__name__} needs "
                                  "(training.init_from)")
        if list(weights[name].shape) != list(target.shape):
            raise CheckpointError(f"{where}: {name!r} has shape {list(weights[name].shape)}, the model built from "
                                  f"its config.json needs {list(target.shape)}")
    model.set_state_dict({name: weights[name].astype(target.dtype) for name, target in expected.items()})


# --- resolving training.init_from ------------------------------------------------------------------


def resolve_init_source(init_from: str, corpus_config, registry, cache: Path) -> InitSource:
    """Where this run's weights and tokenizer come from: nothing (scratch), a model folder, or the champion's
    ``pretrained/`` downloaded into ``cache`` (``registry``: the ``RegistryConfig`` naming the model and how often
    to try the tracking server); the champion falls back to scratch, with the reason, when there is none or its
    tokenizer configuration differs."""
    fingerprint = tokenizer_config_fingerprint(corpus_config)
    if init_from == SCRATCH:
        return InitSource(requested=init_from, tokenizer_config_fingerprint=fingerprint)
    if init_from == CHAMPION:
        folder, version, reason = champion_folder(registry, fingerprint, Path(cache))
        if folder is None:  # record_init_source says so in the log and on the run
            return InitSource(requested=init_from, reason=reason, tokenizer_config_fingerprint=fingerprint)
        source = folder_source(folder, init_from, fingerprint, Path(cache))
        source.champion_version = version
        return source
    return folder_source(Path(init_from).expanduser().resolve(), init_from, fingerprint, Path(cache))


def folder_source(folder: Path, requested: str, fingerprint: str, cache: Path) -> InitSource:
    """A model folder checked (configuration, safetensors weights, tokenizer) and hashed; its tokenizer copied
    alone under ``cache`` for the corpus stage."""
    digest = folder_hash(folder)
    shape = model_config(folder)
    weight_files(folder)
    if not (folder / "tokenizer_config.json").is_file():
        raise ConfigError(f"{folder}: no tokenizer_config.json; save the model's tokenizer beside it with "
                          "tokenizer.save_pretrained(folder) (training.init_from)")
    tokenizer = copy_tokenizer(folder, cache / "tokenizers" / digest)
    logger.info("Starting from %s (content hash %s): its weights, its tokenizer and its config.json's shape", folder,
                digest[:12])
    return InitSource(requested=requested, path=str(folder), hash=digest, tokenizer_path=str(tokenizer), shape=shape,
                      tokenizer_config_fingerprint=fingerprint)


def champion_folder(registry, fingerprint: str, cache: Path) -> tuple[Path | None, str, str]:
    """The champion version's ``pretrained/`` folder, downloaded once into ``cache``, and its version; or None
    and why the run starts from scratch."""
    import mlflow
    from mlflow import MlflowClient

    from train_deploy.registry.history import CHAMPION as ALIAS
    from train_deploy.registry.history import alias_version
    from train_deploy.registry.retry import Retrying

    client, model_name = MlflowClient(), registry.model_name
    retry = Retrying(registry.retries, client.tracking_uri)
    version = retry("find the champion", lambda: alias_version(client, model_name, ALIAS))
    if version is None:
        return None, "", f"registered model {model_name} has no {ALIAS} yet"
    tags = retry("read the champion's tags", lambda: client.get_model_version(model_name, version).tags)
    if tags.get(TOKENIZER_TAG) != fingerprint:
        return None, version, (f"the tokenizer configuration (corpus.cleaning and corpus.tokenizer) is not the one "
                               f"{ALIAS} version {version} was trained with ({TOKENIZER_TAG} "
                               f"{tags.get(TOKENIZER_TAG, 'missing')}, this run {fingerprint})")
    target = cache / "champion" / f"{model_name}-v{version}"
    if not (target / CONFIG_FILE).is_file():
        staging = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            downloaded = mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{model_name}/{version}/artifacts/bundle/pretrained", dst_path=str(staging))
        except mlflow.exceptions.MlflowException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            return None, version, (f"{ALIAS} version {version}'s bundle has no pretrained/ folder (exported before "
                                   f"train_deploy wrote one?): {exc.message.splitlines()[0]}")
        shutil.rmtree(target, ignore_errors=True)
        Path(downloaded).rename(target)
        shutil.rmtree(staging, ignore_errors=True)
        logger.info("Downloaded %s version %s's pretrained/ into %s", model_name, version, target)
    return target, version, ""


# --- the training node's side ---------------------------------------------------------------------


def check_source_current(init_from: str, source: InitSource) -> None:
    """The init source the corpus stage resolved must be this configuration's (and a folder unchanged since)."""
    if source.requested != init_from:
        raise ConfigError(f"training.init_from: is {init_from!r} but the corpus stage resolved "
                          f"{source.requested!r} (init_source); run the corpus stage again")
    if source.path and init_from != CHAMPION and folder_hash(Path(source.path)) != source.hash:
        raise ConfigError(f"training.init_from: {source.path} changed since the corpus stage took its tokenizer; "
                          "run the corpus stage again")


def warm_start_training(training: dict[str, Any], source: InitSource) -> dict[str, Any]:
    """The ``training`` block the workers get: with a model folder, its ``config.json`` shape over the preset."""
    if not source.path:
        return training
    model = training.get("model") or {}
    if model:
        logger.info("training.model (%s) is ignored: the shape comes from %s", model, Path(source.path) / CONFIG_FILE)
    return {**training, "model": {"preset": model.get("preset", "small"), "overrides": dict(source.shape)}}


def check_layout(config, source: InitSource, vocab_size: int):
    """:func:`~train_deploy.training.config.resolve_layout` and the vocabulary check, a folder's ``config.json``
    named in front of the message when the shape is its."""
    from train_deploy.training.config import check_vocabulary, resolve_layout

    shape = config.model.shape()
    try:
        check_vocabulary(vocab_size, shape.get("vocab_size", vocab_size))
        return resolve_layout(config, config.world_size, shape.get("vocab_size", vocab_size))
    except ConfigError as exc:
        if source.path:
            raise ConfigError(f"{Path(source.path) / CONFIG_FILE}: {exc}") from None
        raise


def record_init_source(source: InitSource) -> None:
    """What the weights start from, on the active MLflow run if any (the corpus and the training stage both record
    it, so either run alone has it): params ``init_from`` (as configured) and ``init_from.hash``,
    tags ``init_from`` (scratch, champion or folder) and, when a champion start fell back to scratch, the reason."""
    import mlflow

    if source.reason:
        logger.warning("training.init_from: %s: starting from scratch: %s", source.requested, source.reason)
    if mlflow.active_run() is None:
        return
    mlflow.log_params({"init_from": source.requested, "init_from.hash": source.hash or "none"})
    tags = {"init_from": source.started_from}
    tags |= {"init_from.reason": source.reason} if source.reason else {}
    tags |= {"init_from.champion_version": source.champion_version} if source.champion_version else {}
    mlflow.set_tags(tags)
