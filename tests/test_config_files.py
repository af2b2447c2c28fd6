"""The parameter files against the configuration types: conf/base parses, sets only what differs from a default (a
default lives in the types alone), its commented example is a valid block, every field is documented, and the
reference in docs/configuration.md is the one the types generate."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.helpers.config import BLOCKS
from train_deploy.config import from_mapping, to_dict
from train_deploy.corpus.config import CorpusConfig
from train_deploy.training.config import TrainingConfig

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def _block(path: Path, name: str) -> dict[str, Any]:
    """The block as Kedro's OmegaConfigLoader reads it (OmegaConf's YAML, so `1.0e-3` is a float)."""
    parameters = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert list(parameters) == [name], f"{path.name} must hold exactly the block {name!r}"
    return parameters[name]


def _defaults_repeated(block: dict[str, Any], defaults: dict[str, Any], where: str) -> list[str]:
    """Every key of ``block`` whose value is the type's default (``defaults``: the default block as a dict)."""
    found = []
    for key, value in block.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            found += _defaults_repeated(value, defaults[key], f"{where}.{key}")
        elif value == defaults.get(key) and isinstance(value, bool) == isinstance(defaults.get(key), bool):
            found.append(f"{where}.{key}: {value!r} is the default; say it in the type only")
    return found


def test_every_stage_has_one_parameter_file():
    files = sorted(path.name for path in (CONF / "base").glob("parameters_*.yml"))
    assert files == sorted(f"parameters_{name}.yml" for name in BLOCKS)


@pytest.mark.parametrize("name", BLOCKS)
def test_parameter_file_parses_and_repeats_no_default(name):
    block = _block(CONF / "base" / f"parameters_{name}.yml", name)
    from_mapping(BLOCKS[name], block, name)  # right types, accepted values, invariants
    assert _defaults_repeated(block, to_dict(BLOCKS[name]()), name) == []


@pytest.mark.parametrize("name", BLOCKS)
def test_the_commented_example_of_each_file_is_a_valid_block(name):
    lines = (CONF / "base" / f"parameters_{name}.yml").read_text(encoding="utf-8").splitlines()
    start = lines.index(f"# {name}:")
    example = [line.removeprefix("#") for line in lines[start:] if line.startswith("# ")]
    from_mapping(BLOCKS[name], OmegaConf.to_container(OmegaConf.create("\n".join(example)))[name], name)


def test_a_repeated_default_is_found_with_its_key():
    defaults = to_dict(TrainingConfig())
    block = {"optimizer": {"learning_rate": defaults["optimizer"]["learning_rate"], "beta1": 0.8},
             "precision": {"amp": 0}, "schedule": {"seed": 1234}}
    assert _defaults_repeated(block, defaults, "training") == [
        f"training.optimizer.learning_rate: {defaults['optimizer']['learning_rate']!r} is the default; say it in "
        "the type only",
        "training.schedule.seed: 1234 is the default; say it in the type only",
    ]


def test_the_reference_in_the_docs_is_the_one_the_types_generate():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert reference.reference() in text, "docs/configuration.md: run .venv/bin/python tools/config_reference.py"
    assert "`training.optimizer.beta2` (number; default `0.95`; must be in [0, 1)): AdamW decay rate" in text
    assert "`notify.attempts` (integer; default `2`; must be at least 1): Tries of a webhook" in text  # run control too


def test_gpu_environment_overrides_only_known_keys():
    from_mapping(TrainingConfig, _block(CONF / "gpu" / "parameters_training.yml", "training"), "training")


def test_cluster_environment_overrides_only_known_corpus_keys_and_runs_on_ray():
    config = from_mapping(CorpusConfig, _block(CONF / "cluster" / "parameters_corpus.yml", "corpus"), "corpus")
    assert config.encoding.executor == "ray" and config.encoding.ray_address == "auto"


def _config_classes(cls: type) -> list[type]:
    """`cls` and every dataclass nested in it, outermost first."""
    nested = [hint for hint in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(hint)]
    return [cls] + [inner for hint in nested for inner in _config_classes(hint)]


CONFIG_CLASSES = [cls for root in BLOCKS.values() for cls in _config_classes(root)]


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda cls: cls.__name__)
def test_every_config_field_has_a_docstring(cls):
    module = ast.parse(Path(inspect.getsourcefile(cls)).read_text(encoding="utf-8"))
    (node,) = (n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    body = node.body
    undocumented = [
        statement.target.id
        for statement, following in zip(body, body[1:] + [None], strict=True)
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
        and not (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                 and isinstance(following.value.value, str) and following.value.value.strip())
    ]
    assert {f.name for f in dataclasses.fields(cls)} <= {
        s.target.id for s in body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }, f"{cls.__name__} inherits fields; check its bases too"
    assert not undocumented, f"{cls.__name__}: no docstring under {', '.join(undocumented)}"
