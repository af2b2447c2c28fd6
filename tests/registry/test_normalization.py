"""The served MLflow model normalises its inputs as the corpus was normalised."""

from __future__ import annotations

import mlflow
import pandas as pd
import pytest

from tests.helpers.corpus import CLEANED, RAW

pytestmark = pytest.mark.slow


def test_the_logged_model_scores_raw_and_cleaned_text_alike(tiny_model, model_store):
    with model_store.active():
        model = mlflow.pyfunc.load_model(tiny_model.model_uri)
    frame = model.predict(pd.DataFrame({"text": [RAW, CLEANED]}))
    raw, cleaned = frame.to_dict("records")
    assert raw["text"] == RAW and raw["tokens"] == cleaned["tokens"]
    assert raw["log_prob"] == pytest.approx(cleaned["log_prob"], rel=1e-6)
    assert raw["perplexity"] == pytest.approx(cleaned["perplexity"], rel=1e-6)
