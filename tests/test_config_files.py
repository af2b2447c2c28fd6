"""The parameter files and the configuration dataclasses agree: same keys, same defaults, every field documented."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from pydantic.fields import FieldInfo

from tests.helpers.config import BLOCKS
from train_deploy.config import from_mapping
from train_deploy.corpus.config import CorpusConfig
from train_deploy.training.config import OptimizerConfig, ScheduleConfig, TrainingConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


def _block(path: Path, name: str) -> dict[str, Any]:
    """The block as Kedro's OmegaConfigLoader reads it (OmegaConf's YAML, so `1.0e-3` is a float)."""
    parameters = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert list(parameters) == [name], f"{path.name} must hold exactly the block {name!r}"
    return parameters[name]


def _default(field: dataclasses.Field) -> Any:
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    return default.get_default(call_default_factory=True) if isinstance(default, FieldInfo) else default


def _differences(cls: type, block: Any, where: str) -> list[str]:
    """Every key that is in only one of `block` and `cls`, or whose value differs from the default."""
    if not isinstance(block, dict):
        return [f"{where}: the file has {block!r}, the dataclass a block {cls.__name__}"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    found = [f"{where}.{key}: in the file, not in {cls.__name__}" for key in block if key not in fields]
    for name, field in fields.items():
        key = f"{where}.{name}"
        default = _default(field)
        if name not in block:
            found.append(f"{key}: in {cls.__name__} (default {default!r}), not in the file")
        elif dataclasses.is_dataclass(default):
            found += _differences(type(default), block[name], key)
        elif not _same(block[name], default):
            found.append(f"{key}: the file says {block[name]!r}, {cls.__name__} says {default!r}")
    return found


def _same(value: Any, default: Any) -> bool:
    """Equal, and not merely because `true == 1`."""
    return value == default and isinstance(value, bool) == isinstance(default, bool)


def _config_classes(cls: type) -> list[type]:
    """`cls` and every dataclass nested in it, outermost first."""
    nested = [hint for hint in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(hint)]
    return [cls] + [inner for hint in nested for inner in _config_classes(hint)]


def test_every_stage_has_one_parameter_file():
    files = sorted(path.name for path in (CONF / "base").glob("parameters_*.yml"))
    assert files == sorted(f"parameters_{name}.yml" for name in BLOCKS)


@pytest.mark.parametrize("name", BLOCKS)
def test_parameter_file_states_every_dataclass_default(name):
    block = _block(CONF / "base" / f"parameters_{name}.yml", name)
    differences = _differences(BLOCKS[name], block, name)
    assert not differences, "\n".join(differences)
    # The file is also a valid configuration: right types, accepted values, invariants.
    from_mapping(BLOCKS[name], block, name)


def test_gpu_environment_overrides_only_known_keys():
    from_mapping(TrainingConfig, _block(CONF / "gpu" / "parameters_training.yml", "training"), "training")


def test_cluster_environment_overrides_only_known_corpus_keys_and_runs_on_ray():

    config = from_mapping(CorpusConfig, _block(CONF / "cluster" / "parameters_corpus.yml", "corpus"), "corpus")
    assert config.encoding.executor == "ray" and config.encoding.ray_address == "auto"


def test_a_default_changed_in_one_place_is_a_difference():
    block = dataclasses.asdict(TrainingConfig())
    assert _differences(TrainingConfig, block, "training") == []
    block["optimizer"] = {**block["optimizer"], "learning_rate": 1.0, "typo": 1}
    block["precision"] = {**block["precision"], "amp": 0}
    del block["schedule"]["seed"]
    assert _differences(TrainingConfig, block, "training") == [
        "training.optimizer.typo: in the file, not in OptimizerConfig",
        f"training.optimizer.learning_rate: the file says 1.0, OptimizerConfig says {OptimizerConfig().learning_rate}",
        "training.precision.amp: the file says 0, PrecisionConfig says False",
        f"training.schedule.seed: in ScheduleConfig (default {ScheduleConfig().seed!r}), not in the file",
    ]


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
