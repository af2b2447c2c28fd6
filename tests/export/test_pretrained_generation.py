"""A PaddleNLP user who only calls from_pretrained and generate on the bundle's pretrained/ folder gets the bundle's
greedy text: the folder's tokenizer begins every prompt with the end-of-document id, as the bundle does."""

from __future__ import annotations

import pytest

from train_deploy.export import LanguageModel

pytestmark = pytest.mark.slow

PROMPTS = ["中国人民", "今天", "经济发展"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def paddlenlp_model(tiny_bundle):
    from paddlenlp.transformers import AutoTokenizer, LlamaForCausalLM

    folder = str(tiny_bundle / "pretrained")
    model = LlamaForCausalLM.from_pretrained(folder)
    model.eval()
    return AutoTokenizer.from_pretrained(folder), model


@pytest.fixture(scope="module")
def bundle_text(tiny_bundle) -> list[str]:
    model = LanguageModel.load(tiny_bundle)
    return [model.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0) for prompt in PROMPTS]


def test_from_pretrained_and_generate_give_the_bundles_greedy_text(paddlenlp_model, bundle_text, tiny_bundle):
    tokenizer, model = paddlenlp_model
    eos = LanguageModel.load(tiny_bundle, "onnx").eos_id
    texts = []
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pd")
        assert inputs["input_ids"][0, 0].item() == eos  # the context every training document was seen in
        ids, _ = model.generate(**inputs, decode_strategy="greedy_search", max_new_tokens=NEW_TOKENS)
        texts.append(tokenizer.decode(ids[0].tolist(), skip_special_tokens=True))
    assert texts == bundle_text
    assert any(bundle_text), "greedy decoding produced nothing for every prompt: the comparison proves little"


def test_input_ids_alone_with_the_documented_mask_give_the_bundles_greedy_text(paddlenlp_model, bundle_text,
                                                                              tiny_bundle):
    import paddle

    tokenizer, model = paddlenlp_model
    ids = paddle.to_tensor([tokenizer(PROMPTS[0])["input_ids"]])
    out, _ = model.generate(input_ids=ids, attention_mask=paddle.ones_like(ids), decode_strategy="greedy_search",
                            max_new_tokens=NEW_TOKENS)
    assert tokenizer.decode(out[0].tolist(), skip_special_tokens=True) == bundle_text[0]
    assert "attention_mask=paddle.ones_like(input_ids)" in (tiny_bundle / "pretrained" / "README.md").read_text()


def test_the_bundles_own_tokenizer_still_adds_nothing(tiny_bundle):
    from paddlenlp.transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(tiny_bundle / "tokenizer"))
    pretrained = AutoTokenizer.from_pretrained(str(tiny_bundle / "pretrained"))
    ids = own(PROMPTS[0])["input_ids"]
    assert ids == LanguageModel.load(tiny_bundle, "onnx").tokenizer.encode([PROMPTS[0]])[0]
    assert pretrained(PROMPTS[0])["input_ids"] == [own.eos_token_id, *ids]


def test_the_pretrained_tokenizer_encodes_corpora_as_the_bundles_does_when_training_starts_from_it(tiny_bundle,
                                                                                                  tmp_path):
    from train_deploy.corpus.tokenizer import TokenEncoder, load_tokenizer

    # training.init_from: champion makes pretrained/'s tokenizer the corpus stage's
    loaded = load_tokenizer(tiny_bundle / "pretrained", tmp_path / "tokenizer", "test")
    texts = ["迈向充满希望的新世纪 ——1998年新年讲话 Hello, world!", *PROMPTS]
    own = LanguageModel.load(tiny_bundle, "onnx").tokenizer
    assert TokenEncoder(loaded).encode(texts) == own.encode(texts)
    assert loaded.eos_id == own.info.eos_id
