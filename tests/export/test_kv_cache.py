"""Generation with the KV cache: the cached graphs equal full recomputation on both engines (MHA and GQA, left
padding), and LanguageModel's batched, streamed generation keeps the answers of the full-recompute path."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.helpers.export import fused_here
from train_deploy.export import LanguageModel
from train_deploy.export.backends import OnnxRuntimeBackend, PaddleInferenceBackend
from train_deploy.export.checks import cache_parity_report
from train_deploy.export.config import ParityConfig, ServerConfig
from train_deploy.export.errors import BundleError

pytestmark = pytest.mark.slow

PROMPTS = ["中国", "今天天气很好，我们去公园", "中国的经济发展"]


@pytest.fixture(scope="module")
def gqa_forms(tmp_path_factory):
    """A random GQA Llama (4 query heads, 2 key/value heads) exported once to both engines, and its reference. ONNX
    Runtime decodes with the converted graph's growing cache (``onnx_fp32``) and with the in-place graph
    (``onnx_inplace``, ``inplace.py``)."""
    from tests.helpers.export import reference_llama
    from train_deploy.export.edge import convert_to_onnx
    from train_deploy.export.graph import DECODE_MODEL, compact_model, save_server_model
    from train_deploy.export.inplace import save_inplace_decode

    reference = reference_llama(3, num_key_value_heads=2)
    folder = tmp_path_factory.mktemp("gqa")
    model = compact_model(reference)
    prefix = save_server_model(model, folder / "server", portable=not fused_here())  # the graph this CPU runs
    source = save_server_model(model, folder / "onnx_source", portable=True)
    convert_to_onnx(source, folder / "model.onnx", 17)
    convert_to_onnx(source.with_name(DECODE_MODEL), folder / "decode.onnx", 17)
    save_inplace_decode(model, folder / "decode_inplace.onnx")
    forms = {"paddle_inference": PaddleInferenceBackend(prefix, ServerConfig(cpu_threads=1)),
             "onnx_fp32": OnnxRuntimeBackend(folder / "model.onnx", 1, in_place=False),
             "onnx_inplace": OnnxRuntimeBackend(folder / "model.onnx", 1)}
    return reference, forms


@pytest.fixture(scope="module")
def models(tiny_bundle) -> dict[str, LanguageModel]:
    return {"paddle": LanguageModel.load(tiny_bundle, backend="paddle"),
            "onnx": LanguageModel.load(tiny_bundle, backend="onnx")}


@pytest.mark.parametrize("batch", [1, 3])
def test_gqa_cache_equals_full_recomputation_on_both_engines(gqa_forms, batch):
    import paddle

    reference, forms = gqa_forms
    windows = np.random.default_rng(batch).integers(3, 96, size=(batch, 21))

    def full(ids, mask):
        with paddle.no_grad():
            return reference(input_ids=paddle.to_tensor(ids), use_cache=False, return_dict=False)[0].numpy()

    report = cache_parity_report(windows, full, forms, ParityConfig())
    assert report["prompt_lengths"] == [10, 9, 8][:batch] and report["decode_steps"] == 10
    assert report["passed"], report["failures"]
    assert all(0 < diff <= 1e-4 for diff in report["max_abs_logit_diff"].values())


def test_a_smaller_batch_after_a_larger_one_still_equals_full_recomputation(gqa_forms):
    """Paddle Inference writes an output into the buffer it kept from the last run when that is large enough:
    after a larger batch the caches a step reads must not be the buffers it writes."""
    import paddle

    reference, forms = gqa_forms

    def full(ids, mask):
        with paddle.no_grad():
            return reference(input_ids=paddle.to_tensor(ids), use_cache=False, return_dict=False)[0].numpy()

    rng = np.random.default_rng(7)
    for batch, width in ((3, 25), (1, 13), (2, 17)):
        report = cache_parity_report(rng.integers(3, 96, size=(batch, width)), full, forms, ParityConfig())
        assert report["passed"], (batch, report["failures"])


@pytest.mark.parametrize("name", ["onnx_fp32", "onnx_inplace"])
def test_cache_parity_fails_when_the_cache_is_wrong(gqa_forms, name):
    """The check can fail: decode steps over the keys of another sequence are not full recomputation (the growing
    cache and the in-place one)."""
    import paddle

    reference, forms = gqa_forms

    class SwappedCache:
        def __init__(self, form):
            self.form = form

        def __call__(self, ids, mask):
            return self.form(ids, mask)

        def prefill(self, ids, mask):
            return self.form.prefill(ids, mask)

        def new_cache(self):
            cache = self.form.new_cache()
            join = cache.join

            def swapped(mask, step, rows):
                join(mask, step, rows)
                cache.keys = [keys[::-1].copy() for keys in cache.keys]

            cache.join = swapped
            return cache

    def full(ids, mask):
        with paddle.no_grad():
            return reference(input_ids=paddle.to_tensor(ids), use_cache=False, return_dict=False)[0].numpy()

    windows = np.random.default_rng(5).integers(3, 96, size=(2, 21))
    report = cache_parity_report(windows, full, {name: SwappedCache(forms[name])}, ParityConfig())
    assert not report["passed"]
    assert report["failures"][0].startswith(f"{name} with the KV cache: max |logit diff| ")


def test_the_in_place_graph_writes_the_callers_buffers_and_copies_nothing_of_the_cache(gqa_forms):
    """A decode step of the slot cache writes the new position into the buffers it holds (the same arrays before
    and after: no cache returned or copied), leaves every other position as it was, and frees them when empty."""
    _, forms = gqa_forms
    form = forms["onnx_inplace"]
    ids = np.random.default_rng(3).integers(3, 96, size=(2, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    cache = form.new_cache()
    cache.join(mask, form.prefill(ids, mask), [0, 1])
    buffers = [*cache.keys, *cache.values]
    before = [buffer.copy() for buffer in buffers]
    assert cache.lengths.tolist() == [6, 4]
    logits = cache.decode(np.array([[5], [7]], np.int64))
    kept = logits.copy()
    assert cache.lengths.tolist() == [7, 5]
    for buffer, old in zip([*cache.keys, *cache.values], before, strict=True):
        assert any(buffer is each for each in buffers)
        changed = np.argwhere(np.abs(buffer - old).sum(axis=(1, 3)) > 0)  # (row, position) pairs written
        assert sorted(map(tuple, changed.tolist())) == [(0, 6), (1, 4)]
    cache.decode(np.array([[9], [11]], np.int64))  # the next step, with the binding the first one made
    assert np.array_equal(logits, kept)  # the logits it returned are the caller's, not a view it writes again
    second = cache.keys[0][1, :, :6].copy()
    cache.keep([1])
    assert cache.lengths.tolist() == [6] and cache.keys[0][0, :, :6].tolist() == second.tolist()
    cache.keep([])
    assert cache.rows == 0 and cache.keys == []


def test_the_bundle_records_cache_parity_for_every_form(tiny_bundle):
    parity = json.loads((tiny_bundle / "parity.json").read_text())
    cache = parity["kv_cache"]
    assert cache["passed"] and parity["passed"] and cache["decode_steps"] > 0
    assert len(set(cache["prompt_lengths"])) > 1  # left padding: prompts of different lengths in one batch
    paddle_forms = ("paddle_inference", "paddle_portable") if fused_here() else ("paddle_portable",)
    assert set(cache["max_abs_logit_diff"]) == {*paddle_forms, "onnx_fp32", "onnx_int8"}
    assert max(cache["max_abs_logit_diff"][form] for form in (*paddle_forms, "onnx_fp32")) <= 1e-4
    assert (tiny_bundle / "server_portable" / "decode.json").is_file()
    assert (tiny_bundle / "edge" / "decode.onnx").is_file()
    assert (tiny_bundle / "server" / "decode.json").is_file() == fused_here()
    card = (tiny_bundle / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert f"KV cache: {len(cache['prompt_lengths'])} left-padded prompts of " in card
    assert "its cost grows linearly with the output length" in card


def _recompute_greedy(logits, eos_id: int, ids: list[int], steps: int, context: int) -> list[int]:
    """Greedy tokens by full recomputation of each token's window, one pass per token (the path before the cache):
    the whole sequence until it outgrows the context, then its last half context, growing again (the shift)."""
    new: list[int] = []
    start = 0
    for _ in range(steps):
        if len(ids) + len(new) - start > context:
            start = len(ids) + len(new) - context // 2
        token = int(np.argmax(logits(np.asarray([(ids + new)[start:]]))[0, -1]))
        if token == eos_id:
            break
        new.append(token)
    return new


def test_greedy_batch_equals_paddle_eager_recomputation_on_both_engines(models, tiny_checkpoint):
    from train_deploy.export.graph import eager_logits
    from train_deploy.training.evaluation import load_model

    trained = load_model(tiny_checkpoint)
    model = models["paddle"]
    prompts = [[model.eos_id, *ids] for ids in model.tokenizer.encode(PROMPTS)]
    assert len({len(ids) for ids in prompts}) == 3
    expected = [model.tokenizer.decode(_recompute_greedy(lambda ids: eager_logits(trained, ids), model.eos_id, ids,
                                                         10, model.context)) for ids in prompts]
    for name, each in models.items():
        assert each.generate(PROMPTS, max_new_tokens=10, temperature=0) == expected, name
        assert [each.generate(p, max_new_tokens=10, temperature=0) for p in PROMPTS] == expected, name


def test_streamed_tokens_make_the_generated_text_and_report_tokens_per_second(models):
    model = models["onnx"]
    events = list(model.generate_stream(PROMPTS, max_new_tokens=6, temperature=0))
    texts = ["".join(e.text for e in events if e.sequence == i) for i in range(len(PROMPTS))]
    assert texts == model.generate(PROMPTS, max_new_tokens=6, temperature=0)
    stats = model.last_stats
    assert stats.sequences == 3 and stats.new_tokens == len(events) > 0 and stats.tokens_per_second > 0


def test_eos_stops_one_sequence_while_the_others_continue(models):
    """Row 0 picks end of document at its third step; the others keep their greedy tokens (the cache of the
    finished row is dropped from the batch, the rest must not move)."""
    model = models["paddle"]
    prompts = [[model.eos_id, *ids] for ids in model.tokenizer.encode(PROMPTS)]
    steps = {0: 0}

    def pick(row: int, logits: np.ndarray) -> int:
        if row == 0:
            steps[0] += 1
            if steps[0] == 3:
                return model.eos_id
        return int(np.argmax(logits))

    out = list(model.stream_ids(prompts, 8, pick))
    by_row = {row: [token for r, token in out if r == row] for row in range(3)}
    assert len(by_row[0]) == 2 and len(by_row[1]) == len(by_row[2]) == 8
    for row in (1, 2):
        alone = [token for _, token in model.stream_ids([prompts[row]], 8, lambda r, logits: int(np.argmax(logits)))]
        assert by_row[row] == alone


def test_sampling_is_reproducible_with_a_seed_and_top_p_narrows_it(models):
    model = models["onnx"]
    kwargs = {"max_new_tokens": 8, "temperature": 0.9, "top_k": 0, "top_p": 0.9, "seed": 11}
    first = model.generate(PROMPTS, **kwargs)
    assert first == model.generate(PROMPTS, **kwargs) == models["paddle"].generate(PROMPTS, **kwargs)
    assert first == [model.generate(p, **kwargs) for p in PROMPTS]  # each prompt has its own seeded generator
    assert model.generate(PROMPTS, **{**kwargs, "top_p": 1e-9}) == model.generate(PROMPTS, 8, temperature=0)
    with pytest.raises(BundleError, match=r"^top_p: 0 is outside \(0, 1\]$"):
        model.generate("中国", top_p=0)


def test_a_prompt_at_the_context_limit_slides_its_window(tiny_bundle, models):
    model = LanguageModel.load(tiny_bundle, backend="onnx", too_long="truncate")
    long_text = "中国人民银行" * 200
    prompt = model._fit([model.eos_id, *model.tokenizer.encode([long_text])[0]], "prompt")
    assert len(prompt) == model.context
    expected = _recompute_greedy(model.logits, model.eos_id, prompt, 4, model.context)
    assert model.generate([long_text, "中国"], max_new_tokens=4, temperature=0)[0] == model.tokenizer.decode(expected)


def test_an_output_past_the_context_shifts_it_to_its_last_half_as_often_as_it_outgrows_it(models):
    """Each token past the context is the one a full recomputation of the shifted window gives, through two shifts,
    for one prompt and beside a shorter one (whose own window never shifts), on both engines."""
    for name, each in models.items():
        prompts = [[each.eos_id, *ids] for ids in each.tokenizer.encode(PROMPTS)]
        context = len(prompts[2]) + 1
        small = LanguageModel(each._form, each.tokenizer, context=context, eos_id=each.eos_id)
        expected = _recompute_greedy(each.logits, each.eos_id, prompts[2], 2 * context, context)
        assert len(expected) == 2 * context, name  # no end of document before the second shift
        alone = [token for _, token in small.stream_ids([prompts[2]], 2 * context, lambda _, x: int(np.argmax(x)))]
        assert alone == expected, name
        beside = small.stream_ids([prompts[1], prompts[2]], 2 * context, lambda _, x: int(np.argmax(x)))
        assert [token for row, token in beside if row == 1] == expected, name


def test_a_bundle_from_before_the_cache_is_refused_and_re_exported(tmp_path, tiny_bundle, tiny_checkpoint,
                                                                  tiny_tokenizer, monkeypatch):
    from tests.helpers.export import NO_CURVES, export_params
    from train_deploy.export import bundle as bundle_module
    from train_deploy.export.config import ExportConfig

    old = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, old)
    meta = json.loads((old / "bundle.json").read_text())
    (old / "bundle.json").write_text(json.dumps({**meta, "format": 6}))  # a stacked cache, no fused kernels
    with pytest.raises(BundleError, match=rf"^{old}/bundle.json: bundle format 6 is older than the graphs this runtime "
                                          r"runs \(format 7\); re-export it \(kedro run --pipelines export\)$"):
        LanguageModel.load(old)
    config = ExportConfig.from_params(export_params())
    now = bundle_module.bundle_fingerprint(tiny_checkpoint, tiny_tokenizer, config, NO_CURVES)
    monkeypatch.setattr(bundle_module, "FORMAT", 6)
    assert bundle_module.bundle_fingerprint(tiny_checkpoint, tiny_tokenizer, config, NO_CURVES) != now
