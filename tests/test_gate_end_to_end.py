"""Issue 36's acceptance through whole `train_deploy` runs (a Kedro session, as `kedro run` makes it) on a corpus
that leaks: two editions of a manual, the second revising most chapters of the first (two new paragraphs before each
kept chapter) and adding new ones, so that a chapter of one edition holds the text of its twin in the other.

- the model's evaluation set holds no text that a training document holds (the corpus stage's containment check);
- a first version worse than a unigram is not made champion, the refusal names the baseline and both figures;
- an undecided comparison keeps the champion, with its interval in the history (`train-deploy-registry history`) and
  in the alert."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kedro.framework.session import KedroSession
from mlflow import MlflowClient

from tests.helpers.project import tiny_train_deploy_params
from tests.http_receiver import Receiver
from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path
from train_deploy.corpus.tokenizer import TokenEncoder
from train_deploy.handoffs import TokenizerInfo, TokenManifest
from train_deploy.registry.evalset import _documents
from train_deploy.registry.evalstore import stored_eval_set

pytestmark = pytest.mark.slow

MODEL = "manual_lm"
REGISTRY = Path(sys.executable).parent / "train-deploy-registry"
CHAPTERS, REVISED, NEW, PARAGRAPHS = 100, 80, 20, 4


def _write_editions(folder: Path) -> list[Path]:
    """Edition 1: 100 chapters of 4 People's Daily paragraphs; edition 2: its first 80 chapters, each after two new
    paragraphs (a Jaccard similarity of about 2/3 to its twin: no near-duplicate, yet it holds the twin's text),
    and 20 new chapters. Paragraphs of a chapter are lines; chapters are blank-line separated documents."""
    lines = [line for line in strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines()[:1200])
             if line.strip()]
    paragraphs = iter(lines)
    first = [[next(paragraphs) for _ in range(PARAGRAPHS)] for _ in range(CHAPTERS)]
    second = [[next(paragraphs), next(paragraphs), *chapter] for chapter in first[:REVISED]]
    second += [[next(paragraphs) for _ in range(PARAGRAPHS)] for _ in range(NEW)]
    folder.mkdir()
    paths = []
    for number, chapters in enumerate((first, second), start=1):
        path = folder / f"manual_edition{number}.txt"
        path.write_text("".join("\n".join(chapter) + "\n\n" for chapter in chapters), encoding="utf-8")
        paths.append(path)
    return paths


def _params(editions: list[Path], receiver: Receiver, again: bool = False, **registry) -> dict:
    """The tiny whole pipeline on the two editions, under the default baseline rule unless ``registry`` says;
    ``again``: trained though a version was trained alike (retrain.force)."""
    registry = {"model_name": MODEL, "require_beats": "unigram", "eval_set": {"documents": 16, "max_chars": 60},
                **registry}
    params = tiny_train_deploy_params(1, registry=registry, notify={"webhooks": [receiver.url]})
    params["corpus"]["reader"] = {"source": "text", "paths": [str(path) for path in editions], "chunk_bytes": 65536}
    params["corpus"]["encoding"]["validation_fraction"] = 0.2
    params["retrain"] = {"force": again}
    return params


def _night(project: Path, params: dict, receiver: Receiver) -> tuple[dict, dict]:
    """A whole run; its registry decision and the alert it sent."""
    sent = len(receiver.received)
    with KedroSession.create(project_path=project, runtime_params=params) as session:
        session.run(pipeline_names=["train_deploy"])
    decision = json.loads((project / "data/08_reporting/registry_decision.json").read_text(encoding="utf-8"))
    (alert,) = [json.loads(body) for _, body in receiver.wait_for(sent + 1, 30)[sent:]]
    return decision, alert


def _training_documents(project: Path) -> list[str]:
    tokens = TokenManifest.read_folder(project / "data/04_feature/tokens")
    tokenizer = TokenizerInfo.read_folder(project / "data/06_models/tokenizer")
    encoder = TokenEncoder(tokenizer)
    return [encoder.decode(ids) for ids in _documents(Path(f"{tokens.prefix('train')}.bin"), tokens.dtype,
                                                      tokenizer.eos_id)]


def test_a_leaky_two_edition_manual_gets_a_clean_set_no_champion_worse_than_counting_and_undecided_keeps_it(
        project, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"  # the project fixture's store
    client = MlflowClient(uri, uri)
    editions = _write_editions(tmp_path / "manuals")
    receiver = Receiver()
    try:
        # Night 1, under the default baseline rule: 4 steps predict worse than counting, so no champion.
        first, alert = _night(project, _params(editions, receiver), receiver)
        assert (first["version"], first["decision"], first["champion"], first["baseline"]) == (
            "1", "rejected", False, "unigram")
        assert first["val_loss"] >= first["baseline_loss"]
        assert first["reason"].startswith(f"never champion worse than counting: its validation loss "
                                          f"{first['val_loss']:.4f} nats/token is not below the unigram baseline's "
                                          f"{first['baseline_loss']:.4f} on the same ")
        assert (alert["decision"], alert["reason"]) == ("rejected", first["reason"])
        assert client.get_registered_model(MODEL).aliases == {}

        # The set made by that first registration: no text of it is held by a training document, though most
        # chapters of one edition hold their twin's text in the other.
        with_set = stored_eval_set(client, MODEL)
        training = _training_documents(project)
        assert len(with_set.texts) == first["eval_texts"] == 16
        assert [text for text in with_set.texts if any(text in document for document in training)] == []
        manifest = json.loads((project / "data/04_feature/tokens/manifest.json").read_text(encoding="utf-8"))
        assert manifest["documents"]["read"] == CHAPTERS + REVISED + NEW

        # Night 2, the rule off (a tiny model): the first version made champion, on the same set.
        second, _ = _night(project, _params(editions, receiver, again=True, require_beats="none"),
                           receiver)
        assert (second["version"], second["decision"], second["champion"]) == ("2", "first", True)

        # Night 3 on a set one text short of min_texts: undecided, the champion stays, the interval goes out.
        third, alert = _night(project, _params(editions, receiver, again=True, require_beats="none",
                                               eval_set={"documents": 16, "max_chars": 60, "min_texts": 17}),
                              receiver)
    finally:
        receiver.close()
    assert (third["version"], third["decision"], third["champion"], third["eval_texts"]) == ("3", "undecided", False,
                                                                                            16)
    low, high = third["interval"]
    assert low <= third["improvement"] <= high
    assert third["reason"].startswith("undecided: the evaluation set holds 16 texts, fewer than "
                                      "registry.eval_set.min_texts 17, too few to decide on; champion version 2 stays")
    assert {alias: str(v) for alias, v in client.get_registered_model(MODEL).aliases.items()} == {"champion": "2"}
    assert (alert["decision"], alert["version"], alert["champion_version"], alert["interval"], alert["eval_texts"]) \
        == ("undecided", "3", "2", [low, high], 16)
    out = capsys.readouterr().out
    assert "fewer than registry.eval_set.min_texts 17" in out
    assert "registered model manual_lm's evaluation set holds" not in out  # no late warning after the summary

    history = subprocess.run([str(REGISTRY), "history", "--model", MODEL, "--tracking-uri", uri], cwd=tmp_path,
                             capture_output=True, text=True, timeout=180)
    assert history.returncode == 0, history.stderr
    rows = [row.split() for row in history.stdout.splitlines()[1:]]
    assert [row[3:5] for row in rows] == [["rejected", "1"], ["first", "2"], ["undecided", "3"]]
    assert rows[-1][2:12] == ["gate", "undecided", "3", "2", "-", f"{third['candidate_value']:.4f}",
                              f"{third['champion_value']:.4f}", f"{third['improvement']:.4f}",
                              f"[{low:.4f},{high:.4f}]", "16"]
