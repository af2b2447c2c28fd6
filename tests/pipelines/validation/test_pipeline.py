"""The data gate as `kedro run` runs it: between the corpus and training in `train_deploy`, against the statistics the
registry stage recorded on the champion's version."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from tests.helpers.project import NO_SERVING_CHECK, cli_params, tiny_train_deploy_params
from tests.http_receiver import Receiver
from train_deploy.cli import VALIDATION_STOPPED, run
from train_deploy.export.runtime import LanguageModel
from train_deploy.handoffs import Bundle, TokenizerInfo, TokenManifest
from train_deploy.pipelines.registry.nodes import register_bundle
from train_deploy.pipelines.validation.nodes import validate_corpus
from train_deploy.registry.config import RegistryConfig
from train_deploy.validation.records import STATISTICS_TAG, champion_statistics
from train_deploy.validation.screening import document_scores
from train_deploy.validation.statistics import CorpusStatistics, corpus_statistics

pytestmark = pytest.mark.slow

MODEL = RegistryConfig().model_name
REGISTRY = {"eval_set": {"documents": 8, "max_chars": 60}, **NO_SERVING_CHECK}  # the gate is not tested here


def test_a_truncated_night_stops_before_training_with_its_report_and_warn_or_force_let_it_through(
        project, tmp_path, capfd, caplog, tiny_bundle, tiny_run, tiny_token_files, tiny_tokenizer):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"  # the project fixture's store
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    # The champion: the tiny slice's version, registered by the registry stage's node, which records its statistics.
    with mlflow.start_run(experiment_id=mlflow.set_experiment("champion").experiment_id):
        register_bundle(REGISTRY, Bundle.read_folder(tiny_bundle), {}, tiny_token_files, tiny_tokenizer, tiny_run)
    client = MlflowClient(uri, uri)
    version, recorded = champion_statistics(RegistryConfig())
    tonight = corpus_statistics(tiny_token_files, tiny_tokenizer, tiny_bundle)  # the champion scores its own sample
    assert version == "1" and recorded == CorpusStatistics.from_json(json.loads(tonight.compact()))  # 6 digits
    assert recorded.documents_scored > 0 and recorded.nats_per_char > 0 and len(recorded.character_shares) > 100
    assert json.loads(client.get_model_version(MODEL, "1").tags[STATISTICS_TAG])["documents_kept"] > 0

    # Tonight's dump is a fifth of it: `kedro run` stops after the corpus stage, exit status 3, one line.
    params = tiny_train_deploy_params(1, registry=REGISTRY)
    params["corpus"]["reader"]["max_bytes"] = 40_000
    receiver = Receiver()  # the team's alerts: one validation_stopped message with the report
    params["notify"] = {"webhooks": f"['{receiver.url}']"}
    try:
        with pytest.raises(SystemExit) as stopped:
            run.main(["--pipelines", "train_deploy", "--params", ",".join(cli_params(params))], standalone_mode=False)
    finally:
        receiver.close()
    assert stopped.value.code == VALIDATION_STOPPED
    (alert,) = [json.loads(body) for _, body in receiver.received]
    assert alert["event"] == "validation_stopped" and alert["reason"].startswith("the corpus is past the data gate")
    assert "documents_kept" in {finding["statistic"] for finding in alert["report"]["failures"]}
    err = capfd.readouterr().err
    (line,) = [text for text in err.splitlines() if text.startswith("ValidationStopped: ")]
    assert "Traceback" not in err
    assert f"against {MODEL} version 1 (documents_kept " in line and "retrain.force: true trains anyway" in line
    (report,) = _logged(caplog, logging.ERROR)  # the report, one line per statistic past its bound
    assert "documents_kept: champion" in report and "(validation.max_documents_decrease)" in report

    (night,) = client.search_runs([mlflow.get_experiment_by_name("train_deploy").experiment_id])
    assert night.info.status == "FAILED"
    assert night.data.tags["outcome"] == "validation_stopped" and night.data.tags["validation.outcome"] == "stopped"
    assert "documents_kept" in night.data.tags["validation.failed"].split(",")
    artifact = Path(client.download_artifacts(night.info.run_id, "validation/report.json", str(tmp_path)))
    recorded_report = json.loads(artifact.read_text(encoding="utf-8"))
    failed = {f["statistic"]: f for f in recorded_report["failures"]}
    # the champion's bundle, downloaded from the registry, scored tonight's sample (issue 39)
    assert recorded_report["tonight"]["documents_scored"] > 0 and recorded_report["tonight"]["nats_per_char"] > 0
    assert 0 < recorded_report["tonight"]["character_distance"] < 1
    assert recorded_report["screening"]["scored"] == recorded_report["tonight"]["documents_scored"]
    assert failed["documents_kept"]["champion"] == recorded.documents_kept > failed["documents_kept"]["tonight"]
    assert not any(key.startswith("train.") for key in night.data.metrics)  # nothing trained
    assert [str(v.version) for v in client.search_model_versions(f"name='{MODEL}'")] == ["1"]

    # The same token files pass with a warning under validation.mode: warn, or retrain.force.
    tokens = TokenManifest.read_folder(project / "data/04_feature/tokens")
    tokenizer = TokenizerInfo.read_folder(project / "data/06_models/tokenizer")
    caplog.clear()
    assert validate_corpus({"mode": "warn"}, {}, REGISTRY, tokens, tokenizer) is tokens
    assert validate_corpus({}, {"force": True}, REGISTRY, tokens, tokenizer) is tokens
    warnings = _logged(caplog, logging.WARNING)
    assert "training anyway (validation.mode: warn)" in warnings[0] and "(retrain.force: true)" in warnings[1]

    # validation.screening: drop through the whole `kedro run --pipelines train_deploy`: the champion (downloaded)
    # scores every training document; those above the factor times its own figure (here: the quarter it scores
    # worst) are left out of the copy in the catalog's screened_token_files, which training, averaging and export
    # read; the shares go on the run, and the night registers its version
    scores = document_scores(LanguageModel.load(tiny_bundle), tokens, tokenizer)
    factor = round(float(np.quantile(scores, 0.75)) / recorded.nats_per_char, 4)
    dropped = int((scores > factor * recorded.nats_per_char).sum())
    assert 0 < dropped < len(scores)
    params["validation"] = {"mode": "warn", "screening": "drop", "max_document_nats_factor": factor}
    run.main(["--pipelines", "train_deploy", "--params", ",".join(cli_params(params))], standalone_mode=False)
    (screened,) = (project / "data/04_feature/screened_tokens").iterdir()
    kept = TokenManifest.read_folder(screened)
    assert kept.splits["train"].documents == len(scores) - dropped and kept.splits["valid"] == tokens.splits["valid"]
    latest = client.search_runs([mlflow.get_experiment_by_name("train_deploy").experiment_id],
                                order_by=["attribute.start_time DESC"], max_results=1)[0]
    assert latest.data.metrics["validation.screening.scored"] == len(scores)
    assert latest.data.metrics["validation.screening.dropped"] == dropped
    assert latest.info.status == "FINISHED"  # averaging and export checked the checkpoints against the copy
    assert [str(v.version) for v in client.search_model_versions(f"name='{MODEL}'")] == ["2", "1"]


def _logged(caplog, level: int) -> list[str]:
    """The data gate's reports of statistics past their bounds logged at ``level``."""
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and re.match(r"\d+ corpus statistics? past the data gate's bounds", r.getMessage())]
