"""The model builder: presets and the recompute flag."""

from __future__ import annotations

from train_deploy.training.config import TrainingConfig
from train_deploy.training.model import _apply_rotary_pos_emb, build_model, flops_per_token


def test_preset_shapes_and_vocabulary_from_the_tokenizer():
    config = TrainingConfig.from_params({"model": {"preset": "tiny", "overrides": {"num_hidden_layers": 3}},
                                         "precision": {"recompute": True}})
    model = build_model(config, vocab_size=500, eos_id=2)
    assert model.config.vocab_size == 500 and model.config.num_hidden_layers == 3
    assert model.llama.enable_recompute
    shape = config.model.shape()
    assert flops_per_token(shape, 1_000_000, 100_000, 128) == 6 * 900_000 + 12 * 3 * 64 * 128



def test_cpu_forms_compute_the_same_logits_and_gradients(monkeypatch):
    """The CPU model's norms and rotary embedding (``use_cpu_forms``) against PaddleNLP's own, same weights."""
    import numpy as np
    import paddle
    from paddlenlp.transformers.llama import modeling, modeling_network

    config = TrainingConfig.from_params({"model": {"preset": "tiny"}})
    fast = build_model(config, vocab_size=300, eos_id=2)
    assert modeling_network.apply_rotary_pos_emb is _apply_rotary_pos_emb
    assert all("forward" in vars(layer) for layer in fast.sublayers()
               if isinstance(layer, modeling_network.LlamaRMSNormNet))
    reference = modeling_network.LlamaForCausalLMNet(fast.config)  # the class's own norms
    reference.set_state_dict(fast.state_dict())
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 300, (2, 17)))

    def logits_and_grads(model, rope):
        monkeypatch.setattr(modeling_network, "apply_rotary_pos_emb", rope)
        logits = model(input_ids=ids)
        (logits * logits).mean().backward()
        return logits.numpy(), [p.grad.numpy() for p in model.parameters()]

    fast_logits, fast_grads = logits_and_grads(fast, _apply_rotary_pos_emb)
    logits, grads = logits_and_grads(reference, modeling.apply_rotary_pos_emb)
    np.testing.assert_allclose(fast_logits, logits, rtol=1e-5, atol=1e-5)
    for fast_grad, grad in zip(fast_grads, grads, strict=True):
        np.testing.assert_allclose(fast_grad, grad, rtol=1e-4, atol=1e-6)


def test_cpu_rotary_form_with_position_ids():
    import numpy as np
    import paddle
    from paddlenlp.transformers.llama import modeling

    rng = np.random.RandomState(1)
    q, k = (paddle.to_tensor(rng.randn(2, 5, 4, 8).astype("float32")) for _ in range(2))
    cos, sin = (paddle.to_tensor(rng.randn(1, 9, 1, 8).astype("float32")) for _ in range(2))
    positions = paddle.to_tensor([[0, 2, 4, 6, 8], [1, 2, 3, 4, 5]])
    for ours, theirs in zip(_apply_rotary_pos_emb(q, k, cos, sin, positions),
                            modeling.apply_rotary_pos_emb(q, k, cos, sin, positions), strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-6)
