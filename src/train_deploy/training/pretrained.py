"""Warm starts (``training.init_from``): a PaddleNLP Llama model folder, or the registered champion's bundle.

A model folder is what ``LlamaForCausalLM.save_pretrained(folder, safe_serialization=True)`` writes, plus a
tokenizer saved beside it::

    config.json                       the LlamaConfig: the model shape comes from here (the preset is ignored)
    model.safetensors                 the weights (or model-0000x-of-0000n.safetensors + model.safetensors.index.json)
    tokenizer_config.json, …          the tokenizer: the corpus stage encodes with it

Only safetensors are read: ``model_state.pdparams`` is a pickle, which could run code when loaded. The weights
have the structured names of PaddleNLP's ``LlamaForCausalLM``, which are those of ``LlamaForCausalLMNet`` the
workers train. ``init_from: champion`` uses the champion's bundle, whose ``pretrained/`` folder has this layout
(``train_deploy.export.bundle``), as any other folder: ``train_deploy.registry.champion`` finds and downloads it
and resolves ``init_from`` into an :class:`~train_deploy.handoffs.InitSource`. Warm starts load weights only: the
optimizer and the learning-rate schedule (with its warm-up) start afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any

from train_deploy.atomic import atomic_folder
from train_deploy.config import ConfigError, to_dict
from train_deploy.handoffs import InitSource
from train_deploy.hashing import digest, hash_folder
from train_deploy.training.config import Layout, ModelConfig, TrainingConfig, check_vocabulary, resolve_layout

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
    """:func:`hash_folder` of ``folder``, remembered by ``files`` (name, size, mtime): a champion's gigabytes are
    read once per process, not at every identity check."""
    return hash_folder(folder)


def init_identity(init_from: str) -> str:
    """What ``init_from`` contributes to a run's identity: the word, or a folder's content hash."""
    return init_from if init_from in (SCRATCH, CHAMPION) else f"folder:{folder_hash(Path(init_from))}"


def copy_tokenizer(folder: Path, target: Path) -> Path:
    """``target`` holding ``folder``'s files but its weights (the tokenizer and configuration), made once."""
    if not target.is_dir():
        with atomic_folder(target, "the pretrained folder's tokenizer") as staging:
            shutil.copytree(folder, staging, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.safetensors", WEIGHTS_INDEX, *PICKLED_WEIGHTS))
    return target


def tokenizer_config_fingerprint(corpus_config) -> str:
    """Digest of what makes a tokenizer besides the text: the cleaning and the tokenizer block (threads aside).
    Equal to the champion's tag: the champion's tokenizer is the one this configuration asks for."""
    tokenizer = {k: v for k, v in asdict(corpus_config.tokenizer).items() if k != "num_threads"}
    payload = {"cleaning": asdict(corpus_config.cleaning), "tokenizer": tokenizer}
    return digest(payload)


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


# --- a model folder as an init source --------------------------------------------------------------


def folder_source(folder: Path, requested: str, fingerprint: str, cache: Path) -> InitSource:
    """A model folder checked (configuration, safetensors weights, tokenizer) and hashed; its tokenizer copied
    alone under ``cache`` for the corpus stage."""
    content = folder_hash(folder)
    shape = model_config(folder)
    weight_files(folder)
    if not (folder / "tokenizer_config.json").is_file():
        raise ConfigError(f"{folder}: no tokenizer_config.json; save the model's tokenizer beside it with "
                          "tokenizer.save_pretrained(folder) (training.init_from)")
    tokenizer = copy_tokenizer(folder, cache / "tokenizers" / content)
    logger.info("Starting from %s (content hash %s): its weights, its tokenizer and its config.json's shape", folder,
                content[:12])
    return InitSource(requested=requested, path=str(folder), hash=content, tokenizer_path=str(tokenizer), shape=shape,
                      tokenizer_config_fingerprint=fingerprint)


# --- the training node's side ---------------------------------------------------------------------


def check_source_current(init_from: str, source: InitSource) -> None:
    """The init source the corpus stage resolved must be this configuration's (and a folder unchanged since)."""
    if source.requested != init_from:
        raise ConfigError(f"training.init_from: is {init_from!r} but the corpus stage resolved "
                          f"{source.requested!r} (init_source); run the corpus stage again")
    if source.path and init_from != CHAMPION and folder_hash(Path(source.path)) != source.hash:
        raise ConfigError(f"training.init_from: {source.path} changed since the corpus stage took its tokenizer; "
                          "run the corpus stage again")


def warm_start(config: TrainingConfig, source: InitSource) -> TrainingConfig:
    """The configuration the workers get: with a model folder, its ``config.json`` shape over the preset."""
    if not source.path:
        return config
    logger.info("training.model (%s) is ignored: the shape comes from %s", to_dict(config.model),
                Path(source.path) / CONFIG_FILE)
    return dataclasses.replace(config, model=ModelConfig(preset=config.model.preset, overrides=dict(source.shape)))


def check_layout(config: TrainingConfig, source: InitSource, vocab_size: int) -> Layout:
    """:func:`~train_deploy.training.config.resolve_layout` and the vocabulary check, a folder's ``config.json``
    named in front of the message when the shape is its."""
    shape = config.model.shape()
    try:
        check_vocabulary(vocab_size, shape.get("vocab_size", vocab_size))
        return resolve_layout(config, config.world_size, shape.get("vocab_size", vocab_size))
    except ConfigError as exc:
        if source.path:
            raise ConfigError(f"{Path(source.path) / CONFIG_FILE}: {exc}") from None
        raise
