"""The corpus report: length histograms, drop reasons and examples, the same for any worker count, in MLflow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow
from kedro.config import OmegaConfigLoader
from kedro.io import DataCatalog
from PIL import Image

from tests.helpers.corpus import ALL_ON, CASES, encode, random_chinese
from train_deploy.corpus.cleaning import Cleaner
from train_deploy.corpus.config import CleaningConfig
from train_deploy.corpus.report import REPORT_FILE, CorpusQuality, length_bins
from train_deploy.pipelines.corpus.nodes import report_corpus_quality


def mixed_corpus(path: Path) -> list[str]:
    """200 distinct documents, every filter's three examples, and ten near-duplicates (one character changed)."""
    keep = random_chinese(200, 300, seed=7)
    extra = [text for text in CASES.values() for _ in range(3)] + [t[:150] + "的" + t[151:] for t in keep[:10]]
    path.write_text("\n\n".join(keep + extra) + "\n", encoding="utf-8")
    return keep


def test_report_counts_lengths_and_reasons_and_shows_examples_the_same_for_one_and_two_workers(tmp_path,
                                                                                            tiny_tokenizer):
    keep = mixed_corpus(tmp_path / "mixed.txt")
    reports = []
    for workers in (1, 2):
        _, manifest = encode(tmp_path / f"w{workers}", tiny_tokenizer, cleaning=ALL_ON, encoding={"workers": workers},
                             reader={"source": "text", "paths": [str(tmp_path / "mixed.txt")], "chunk_bytes": 8192,
                                     "max_bytes": None})
        reports.append((Path(manifest.path) / REPORT_FILE).read_text(encoding="utf-8"))
    assert reports[0] == reports[1]
    quality = CorpusQuality.of(manifest)
    assert quality.kept == 200 and quality.dropped == manifest.documents.dropped
    # Characters: the filters' kept documents (near-duplicates are judged later) and their drops.
    assert quality.sample.kept_chars == length_bins([len(t) for t in keep] + [300] * 10).tolist()
    assert sum(quality.sample.dropped_chars) == 3 * len(CASES)
    assert sum(quality.token_bins) == manifest.documents.kept
    assert quality.sample.examples["kept"] == keep[:3]
    assert quality.sample.examples["near_duplicate"][0] == keep[0][:150] + "的" + keep[0][151:]
    cleaner = Cleaner(CleaningConfig())
    for reason, text in CASES.items():
        assert quality.sample.examples[reason] == [cleaner(text)[:400]] * 3  # as cleaned
    figure, examples = report_corpus_quality(manifest)
    assert len(figure.axes) == 3
    assert "== near_duplicate (10) ==" in examples and "== repeated_lines (3) ==" in examples
    assert json.loads(reports[0])["read"] == 200 + len(CASES) * 3 + 10


def test_report_reaches_the_mlflow_run_as_png_and_text_through_the_catalog(project, tmp_path, tiny_token_files):
    config = OmegaConfigLoader(str(project / "conf"), base_env="base", default_run_env="local")["catalog"]
    catalog = DataCatalog.from_config({name: config[name] for name in ("corpus_report", "corpus_examples")})
    figure, examples = report_corpus_quality(tiny_token_files)
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])  # the project fixture's own SQLite store
    experiment = mlflow.create_experiment("corpus-report", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        catalog.save("corpus_report", figure)
        catalog.save("corpus_examples", examples)
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "corpus")}
    assert logged == {"corpus/corpus_report.png", "corpus/corpus_examples.txt"}
    folder = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="corpus",
                                                      dst_path=str(tmp_path / "download")))
    with Image.open(folder / "corpus_report.png") as image:
        image.load()
        assert image.size == (1300, 360)
    text = (folder / "corpus_examples.txt").read_text(encoding="utf-8")
    assert text == examples and text.startswith(f"{tiny_token_files.documents.read} documents read")
    assert "== kept (" in text
