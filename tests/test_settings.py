"""Project settings as Kedro loads them: conf/base, conf/<env> and --params merge key by key."""

from __future__ import annotations

import copy

import yaml
from kedro.framework.session import KedroSession
from omegaconf import OmegaConf

from tests.helpers.config import BLOCKS
from tests.helpers.project import REPO

# One nested key per block set by conf/local and another by --params (and one both set: --params wins).
LOCAL = {
    "corpus": {"reader": {"source": "text", "paths": ["my_corpus.txt"]}, "tokenizer": {"vocab_size": 3000}},
    "training": {"optimizer": {"learning_rate": 5.0e-4}, "launch": {"nproc_per_node": 1}},
    "averaging": {"select": "best_k", "k": 2},
    "export": {"parity": {"samples": 3}},
    "registry": {"eval_set": {"documents": 32}},
    "run": {"lock": "wait"},
    "retrain": {"force": True},
    "notify": {"webhooks": ["env:TEAM_WEBHOOK"]},
    "validation": {"mode": "warn"},
    "retention": {"bundles": {"keep_last": 5}},
}
RUNTIME = {
    "corpus": {"tokenizer": {"vocab_size": 4000}, "encoding": {"workers": 1}},
    "training": {"schedule": {"max_steps": 7}},
    "export": {"parity": {"max_logit_diff": 1.0e-3}},
}


def _merged(*layers: dict) -> dict:
    return OmegaConf.to_container(OmegaConf.merge(*[OmegaConf.create(copy.deepcopy(layer)) for layer in layers]))


def test_local_files_and_params_change_only_the_keys_they_name(project):
    base = {}
    for name in BLOCKS:
        base |= yaml.safe_load((REPO / "conf" / "base" / f"parameters_{name}.yml").read_text(encoding="utf-8"))
    assert LOCAL.keys() == BLOCKS.keys()
    for name, block in LOCAL.items():  # one file per block, as the README suggests for the corpus
        (project / "conf" / "local" / f"parameters_{name}.yml").write_text(yaml.safe_dump({name: block}))
    with KedroSession.create(project_path=project, runtime_params=RUNTIME) as session:
        params = session.load_context().params
    expected = _merged(base, LOCAL, RUNTIME)
    for name in BLOCKS:
        assert params[name] == expected[name], name
        BLOCKS[name].from_params(params[name])  # and each is still a valid block
    assert params["corpus"]["tokenizer"]["vocab_size"] == 4000  # --params over conf/local over conf/base
    assert params["corpus"].get("cleaning") == base["corpus"].get("cleaning")  # untouched blocks stay whole
