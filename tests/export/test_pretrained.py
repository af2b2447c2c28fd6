"""The bundle's pretrained/ folder is PaddleNLP's save_pretrained layout: users load it with from_pretrained."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.slow
def test_the_bundles_pretrained_folder_loads_with_paddlenlp_and_gives_the_checkpoints_logits(
        tiny_bundle, tiny_checkpoint, tiny_token_files):
    from paddlenlp.transformers import AutoTokenizer, LlamaForCausalLM
    from safetensors import safe_open

    from train_deploy.export.graph import eager_logits
    from train_deploy.training.evaluation import load_model, validation_windows

    folder = tiny_bundle / "pretrained"
    with safe_open(str(folder / "model.safetensors"), "np") as weights:
        assert {str(weights.get_tensor(name).dtype) for name in weights.keys()} == {"float32"}
    model = LlamaForCausalLM.from_pretrained(str(folder))
    model.eval()
    ids = validation_windows(tiny_token_files.prefix("valid"), tiny_token_files.dtype, 32, 2)
    np.testing.assert_allclose(eager_logits(model, ids), eager_logits(load_model(tiny_checkpoint), ids), rtol=0,
                               atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert len(tokenizer) == tiny_token_files.tokenizer.vocab_size
    assert not (folder / "train_deploy_tokenizer.json").exists()  # a plain PaddleNLP folder
