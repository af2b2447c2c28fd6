"""LanguageModel: score and generate through Paddle Inference and ONNX Runtime, the same answers."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from tests.helpers.export import as_older_bundle, fused_here
from train_deploy.export import LanguageModel, probe
from train_deploy.export.runtime import BundleError, greedy_tokens, log_softmax

pytestmark = pytest.mark.slow

TEXTS = ["今天天气很好，我们去公园散步。", "中国人民", "经济"]


@pytest.fixture(scope="module")
def models(tiny_bundle) -> dict[str, LanguageModel]:
    with pytest.MonkeyPatch.context() as patch:  # as on a CPU without the fused kernels
        patch.setenv("TRAIN_DEPLOY_FUSED_KERNELS", "off")
        portable = LanguageModel.load(tiny_bundle, backend="paddle")
    return {"paddle": LanguageModel.load(tiny_bundle, backend="paddle"), "portable": portable,
            "onnx": LanguageModel.load(tiny_bundle, backend="onnx"),
            "int8": LanguageModel.load(tiny_bundle, backend="onnx", int8=True)}


@pytest.fixture
def no_fused_kernels(monkeypatch):
    """This host as one whose CPU cannot run the fused kernels (``TRAIN_DEPLOY_FUSED_KERNELS=off``)."""
    monkeypatch.setenv("TRAIN_DEPLOY_FUSED_KERNELS", "off")
    probe._verdict.cache_clear()
    yield
    probe._verdict.cache_clear()


def test_scores_are_the_trained_models_log_probabilities(models, tiny_checkpoint):
    from train_deploy.export.graph import eager_logits
    from train_deploy.training.evaluation import load_model

    trained = load_model(tiny_checkpoint)
    for text, score in zip(TEXTS, models["paddle"].score(TEXTS), strict=True):
        ids = np.array([[models["paddle"].eos_id, *score.tokens]])
        expected = log_softmax(eager_logits(trained, ids)[0].astype(np.float64))
        expected = expected[np.arange(len(score.tokens)), score.tokens]
        np.testing.assert_allclose(score.log_probs, expected, atol=1e-4)
        assert score.perplexity == pytest.approx(np.exp(-expected.mean()), rel=1e-4)
        assert score.text == text and len(score.tokens) >= 1


def test_every_backend_scores_alike_and_greedy_generation_is_identical(models):
    assert models["paddle"].engine == ("paddle_inference" if fused_here() else "paddle_portable")
    assert models["portable"].engine == "paddle_portable"
    reference = models["paddle"].score(TEXTS)
    for name in ("portable", "onnx", "int8"):
        for ours, theirs in zip(models[name].score(TEXTS), reference, strict=True):
            assert ours.tokens == theirs.tokens
            assert ours.perplexity == pytest.approx(theirs.perplexity, rel=1e-4 if name != "int8" else 0.05)
    greedy = {name: model.generate("中国", max_new_tokens=12, temperature=0) for name, model in models.items()}
    assert greedy["paddle"] == greedy["portable"] == greedy["onnx"] and len(greedy["paddle"]) > 0


def test_unpinned_the_load_takes_the_fastest_engine_by_this_hosts_figures_and_says_so(tiny_bundle, caplog):
    runnable = ("paddle_inference", "paddle_portable", "onnx_fp32") if fused_here() else ("paddle_portable",
                                                                                           "onnx_fp32")
    with caplog.at_level(logging.INFO, logger="train_deploy.export"):
        model = LanguageModel.load(tiny_bundle)
    # timed here now, or earlier in this session (then from the cache): "<form> <ms> ms/token, ...; measured ..."
    (speed,) = [line for line in caplog.messages if line.startswith(f"Engine speed of {tiny_bundle} ")]
    described = speed.rsplit(": ", 1)[1]
    figures = {form: float(ms) for form, ms, _ in (part.split(" ") for part in described.split("; ")[0].split(", "))}
    assert list(figures) == list(runnable) and figures[model.engine] == min(figures.values())
    (line,) = [line for line in caplog.messages if line.startswith("Loaded")]
    assert line.startswith(f"Loaded {tiny_bundle}: ") and line.endswith(f"the fastest this host runs by its own "
                                                                        f"figures ({described})")


def test_a_format_7_bundle_where_the_fused_kernels_cannot_run_is_refused_in_one_line(tmp_path, tiny_bundle,
                                                                                    no_fused_kernels):
    old = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, old, ignore=shutil.ignore_patterns("server_portable"))
    as_older_bundle(old, 7)
    with pytest.raises(BundleError) as refused:
        LanguageModel.load(old, backend="paddle")
    assert str(refused.value) == (f"{old}/bundle.json: format 7 bundle has only the fused server graph, which this "
                                  "CPU cannot run (TRAIN_DEPLOY_FUSED_KERNELS=off); re-export it with kedro run "
                                  "--pipelines export")
    unpinned = LanguageModel.load(old)  # not pinned: ONNX Runtime serves it
    assert unpinned.engine == "onnx_fp32" and unpinned.generate("中国", max_new_tokens=3, temperature=0)


def test_sampling_with_a_seed_is_deterministic(models):
    model = models["onnx"]
    first = model.generate("经济", max_new_tokens=10, temperature=0.9, top_k=20, seed=7)
    assert first == model.generate("经济", max_new_tokens=10, temperature=0.9, top_k=20, seed=7)
    assert first == models["paddle"].generate("经济", max_new_tokens=10, temperature=0.9, top_k=20, seed=7)


def test_text_longer_than_the_context_is_refused_or_truncated(tiny_bundle, models):
    long_text = "中国人民银行" * 200
    with pytest.raises(BundleError, match=r"prompt: \d+ tokens exceed the model's context of 127 .*'truncate'"):
        models["paddle"].generate(long_text, max_new_tokens=1)
    with pytest.raises(BundleError, match=r"text 1: \d+ tokens exceed the model's context of 127"):
        models["paddle"].score(["短", long_text])
    truncating = LanguageModel.load(tiny_bundle, backend="onnx", too_long="truncate")
    (score,) = truncating.score([long_text])
    assert len(score.tokens) == 127 and np.isfinite(score.perplexity)
    assert isinstance(truncating.generate(long_text, max_new_tokens=3, temperature=0), str)


def test_bad_bundle_and_backend_requests_are_named(tmp_path, tiny_bundle):
    with pytest.raises(BundleError, match=rf"{tmp_path}/bundle.json: missing; is {tmp_path} an exported bundle"):
        LanguageModel.load(tmp_path)
    with pytest.raises(BundleError, match="int8: the int8 model is ONNX; load it with backend='onnx'"):
        LanguageModel.load(tiny_bundle, int8=True)
    with pytest.raises(BundleError, match="backend: 'tensorrt' is not one of 'auto', 'paddle', 'onnx'"):
        LanguageModel.load(tiny_bundle, backend="tensorrt")


def test_gpu_server_on_the_cpu_wheel_is_refused_with_the_key(tiny_bundle):
    from train_deploy.export.config import ServerConfig

    with pytest.raises(BundleError, match="export.server.device: gpu needs the paddlepaddle-gpu wheel"):
        LanguageModel.load(tiny_bundle, server=ServerConfig(device="gpu"))


@pytest.mark.parametrize("onednn", [False, True])
def test_server_settings_reach_the_predictor_and_give_the_same_logits(tiny_bundle, models, onednn):
    import paddle

    from train_deploy.export.config import ServerConfig

    model = LanguageModel.load(tiny_bundle, "paddle", server=ServerConfig(onednn=onednn, gc_batch_mb=4,
                                                                          cpu_threads=1))
    assert paddle.get_flags("FLAGS_eager_delete_tensor_gb")["FLAGS_eager_delete_tensor_gb"] == 4 / 1024
    for ours, theirs in zip(model.score(TEXTS), models["paddle"].score(TEXTS), strict=True):
        np.testing.assert_allclose(ours.log_probs, theirs.log_probs, atol=1e-5)


def test_gpu_only_server_settings_on_cpu_are_refused(tiny_bundle):
    from train_deploy.export.config import ServerConfig

    for server in (ServerConfig(precision="fp16"), ServerConfig(tensorrt=True)):
        with pytest.raises(BundleError, match=r"^export.server: tensorrt and precision fp16 need device: gpu$"):
            LanguageModel.load(tiny_bundle, "paddle", server=server)


def test_sampling_with_top_k_sorts_only_its_candidates(models, monkeypatch):
    """top_k 50 of a vocabulary of thousands: the sampler sorts 50 values per token, not the vocabulary."""
    model = models["onnx"]
    vocabulary = model.logits(np.asarray([[model.eos_id]])).shape[-1]
    sorted_sizes: list[int] = []
    for name in ("sort", "argsort"):
        real = getattr(np, name)
        monkeypatch.setattr(np, name, lambda a, *args, _real=real, **kwargs: sorted_sizes.append(np.size(a))
                            or _real(a, *args, **kwargs))
    model.generate("中国", max_new_tokens=4, temperature=0.9, top_k=50, top_p=0.9, seed=3)
    assert vocabulary > 1000 and sorted_sizes and max(sorted_sizes) == 50
    sorted_sizes.clear()
    model.generate("中国", max_new_tokens=4, temperature=0.9, top_k=0, top_p=0.9, seed=3)
    assert max(sorted_sizes) == vocabulary  # top_p over the whole vocabulary does need it sorted


def test_streaming_decodes_a_few_tokens_per_step_and_the_pieces_make_the_text(models, monkeypatch):
    model = models["onnx"]
    text = model.generate(TEXTS[1], max_new_tokens=40, temperature=0)
    decoded: list[int] = []
    decode = model.tokenizer.decode
    monkeypatch.setattr(model.tokenizer, "decode", lambda ids: decoded.append(len(ids)) or decode(ids))
    pieces = [event.text for event in model.generate_stream(TEXTS[1], max_new_tokens=40, temperature=0)]
    assert "".join(pieces) == text and len(pieces) == 40
    assert max(decoded) <= 4  # the whole output (up to 40 ids) was decoded per token before


def test_a_character_split_across_tokens_is_streamed_once_whole():
    from train_deploy.export.runtime import Detokenizer

    detokenizer = Detokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert [detokenizer.add(byte) for byte in "中a国".encode()] == ["", "", "中", "a", "", "", "国"]


def test_a_stream_cut_inside_a_character_ends_with_the_text_generate_gives():
    from train_deploy.export.runtime import Detokenizer

    detokenizer = Detokenizer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert [detokenizer.add(byte) for byte in "a中".encode()[:3]] == ["a", "", ""] and detokenizer.pending
    assert detokenizer.flush() == "\ufffd" and not detokenizer.pending


def test_greedy_tokens_are_each_rows_likeliest_and_nan_logits_are_a_bundle_error():
    logits = np.array([[0.1, 2.0, 2.0], [3.0, -1.0, 0.0]], dtype=np.float32)
    assert greedy_tokens(logits).tolist() == [1, 0]  # a tie goes to the lower id, as with one row alone
    logits[1, 2] = np.nan
    with pytest.raises(BundleError, match=r"^generation: 1 of the model's 6 next-token logits are not finite"):
        greedy_tokens(logits)
