"""A retrain test's corpus and parameters."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.project import tiny_train_deploy_params
from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path


def _write_corpus(path: Path, start: int, stop: int, mode: str = "w") -> None:
    """People's Daily paragraphs ``start``..``stop`` as blank-line separated documents."""
    lines = strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines()[start:stop])
    with path.open(mode, encoding="utf-8") as file:
        file.write("".join(f"{line}\n\n" for line in lines if line.strip()))


def _params(corpus: Path, **blocks: dict) -> dict:
    params = tiny_train_deploy_params(1, **blocks)
    params["corpus"]["reader"] = {"source": "text", "paths": [str(corpus)], "chunk_bytes": 65536}
    return params
