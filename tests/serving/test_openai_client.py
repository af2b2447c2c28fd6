"""OpenAI's API on the server, spoken by the official ``openai`` client (``base_url`` at a real server process):
completions streamed and not, greedy text identical to the model alone, stop sequences, errors in OpenAI's shape,
and the time to the first token in the log."""

from __future__ import annotations

import itertools
import re
import threading

import numpy as np
import openai
import pytest

from train_deploy.export.runtime import LanguageModel, log_softmax

MODEL = "train_deploy_lm"



@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def alone(tiny_bundle) -> LanguageModel:
    return LanguageModel.load(tiny_bundle)


def test_models_names_the_registered_model_and_version(client):
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "train_deploy")]
    assert models[0].model_extra["version"] == "1"


def test_a_greedy_completion_is_the_models_own_continuation(client, alone):
    answer = client.completions.create(model=MODEL, prompt="中国", max_tokens=8, temperature=0)
    expected = alone.generate("中国", max_new_tokens=8, temperature=0)
    assert answer.object == "text_completion" and answer.model == MODEL
    assert [(c.index, c.text, c.finish_reason) for c in answer.choices] == [(0, expected, "length")]
    prompt_tokens = len(alone.tokenizer.encode([alone.normalize("中国")])[0]) + 1
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 8)


def test_a_streamed_completion_sends_the_same_text_in_pieces_and_logs_the_first_token(client, alone, server):
    prompts = ["中国", "今天"]
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0, stream=True)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    reasons = {}
    for chunk in stream:
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    expected = alone.generate(prompts, max_new_tokens=12, temperature=0)
    assert ["".join(pieces[i]) for i in (0, 1)] == expected
    assert sum(1 for piece in pieces[0] if piece) > 1  # sent as it came, not at the end
    assert reasons == {0: "length", 1: "length"}
    assert re.search(r"completion cmpl-\w+: first token after \d+\.\d{3} s \(2 prompts, stream True\)",
                     server.log_text())


def test_sampling_with_a_seed_repeats(client):
    first, second = (client.completions.create(model=MODEL, prompt="今天", max_tokens=10, temperature=0.8,
                                               top_p=0.9, seed=7).choices[0].text for _ in range(2))
    assert first == second


def test_a_stop_sequence_ends_the_text_before_it_streamed_or_not(client, alone):
    full = alone.generate("中国", max_new_tokens=20, temperature=0)
    stop = full[5:7]
    expected = full[:full.index(stop)]
    answer = client.completions.create(model=MODEL, prompt="中国", max_tokens=20, temperature=0, stop=[stop])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (expected, "stop")
    streamed = client.completions.create(model=MODEL, prompt="中国", max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


@pytest.mark.parametrize(("kwargs", "status", "param", "message"), [
    ({"n": 2}, 400, "n", "n: only 1 completion per prompt is supported"),
    ({"max_tokens": 100_000}, 400, "max_tokens", "max_tokens: 100000 is outside 0 to 256"),
    ({"temperature": -1}, 400, "temperature", "temperature: -1 is outside 0 to 2"),
    ({"logprobs": 6}, 400, "logprobs", "logprobs: 6 is outside 0 to 5"),
    ({"logprobs": -1}, 400, "logprobs", "logprobs: -1 is outside 0 to 5"),
    ({"extra_body": {"logprobs": "3"}}, 400, "logprobs", "logprobs: expected an integer"),
    ({"model": "gpt-4"}, 404, "model", f"model: not served here; this server serves {MODEL} (GET /v1/models)"),
    ({"extra_body": {"temprature": 0}}, 400, "temprature",
     "unknown field temprature; see the API reference for /v1/completions"),
])
def test_errors_come_in_openais_shape(client, kwargs, status, param, message):
    arguments = {"model": MODEL, "prompt": "中国", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(**arguments)
    assert raised.value.status_code == status
    assert raised.value.body == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def test_concurrent_greedy_completions_share_the_batch_and_each_is_the_text_alone(client, alone):
    prompts = ["中国", "今天", "人民日报", "经济发展", "北京", "世界"]
    answers: dict[str, str] = {}

    def one(prompt: str) -> None:
        answers[prompt] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                    temperature=0).choices[0].text

    threads = [threading.Thread(target=one, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == {prompt: alone.generate(prompt, max_new_tokens=24, temperature=0) for prompt in prompts}


def _greedy_with_reference(alone: LanguageModel, prompt: str, count: int) -> tuple[list[int], list[np.ndarray]]:
    """The prompt's greedy new tokens alone, and each step's log-probabilities computed apart from the server: the
    model's logits over the whole text at once (no cache, no batch), through log_softmax."""
    tokens = [event.token for event in alone.generate_stream(prompt, max_new_tokens=count, temperature=0)]
    ids = [alone.eos_id, *alone.tokenizer.encode([alone.normalize(prompt)])[0], *tokens]
    logprobs = log_softmax(alone.logits(np.asarray([ids], dtype=np.int64))[0].astype(np.float64))
    first = len(ids) - len(tokens) - 1
    return tokens, [logprobs[first + k] for k in range(len(tokens))]


def _expected_top(alone: LanguageModel, reference: np.ndarray, chosen: int, text: str, k: int) -> dict[str, float]:
    top = {text: float(reference[chosen])}
    for t in np.argsort(-reference, kind="stable")[:k]:
        if t != chosen:
            top.setdefault(alone.tokenizer.decode([int(t)]), float(reference[t]))
    return top


def _assert_logprobs(alone, logprobs, text: str, tokens: list[int], reference: list[np.ndarray], k: int) -> None:
    assert "".join(logprobs.tokens) == text and len(logprobs.tokens) == len(tokens)
    assert logprobs.text_offset == list(itertools.accumulate([0, *map(len, logprobs.tokens[:-1])]))
    np.testing.assert_allclose(logprobs.token_logprobs, [ref[t] for ref, t in zip(reference, tokens, strict=True)],
                               rtol=0, atol=1e-4)
    for top, ref, token, piece in zip(logprobs.top_logprobs, reference, tokens, logprobs.tokens, strict=True):
        expected = _expected_top(alone, ref, token, piece, k)
        assert sorted(top) == sorted(expected)
        np.testing.assert_allclose([top[key] for key in expected], list(expected.values()), rtol=0, atol=1e-4)


@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_are_the_models_own_and_leave_the_greedy_text_unchanged(client, alone, k):
    tokens, reference = _greedy_with_reference(alone, "中国", 12)
    answer = client.completions.create(model=MODEL, prompt="中国", max_tokens=12, temperature=0, logprobs=k)
    choice = answer.choices[0]
    assert choice.text == alone.generate("中国", max_new_tokens=12, temperature=0)
    _assert_logprobs(alone, choice.logprobs, choice.text, tokens, reference, k)


def test_streamed_logprobs_come_with_their_text_and_match_the_model(client, alone):
    prompts = ["今天", "经济发展"]
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0, logprobs=2,
                                       stream=True)
    texts: dict[int, str] = {0: "", 1: ""}
    parts: dict[int, dict[str, list]] = {i: {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                             "text_offset": []} for i in texts}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            assert "".join(choice.logprobs.tokens) == choice.text  # each chunk's tokens carry its text
            for key, values in parts[choice.index].items():
                values.extend(getattr(choice.logprobs, key))
    for i, prompt in enumerate(prompts):
        tokens, reference = _greedy_with_reference(alone, prompt, 10)
        assert texts[i] == alone.generate(prompt, max_new_tokens=10, temperature=0)
        _assert_logprobs(alone, openai.types.completion_choice.Logprobs(**parts[i]), texts[i], tokens, reference, 2)


def test_logprobs_end_with_the_token_a_stop_sequence_begins_in(client, alone):
    full = alone.generate("中国", max_new_tokens=20, temperature=0)
    stop = full[5:7]
    plain = client.completions.create(model=MODEL, prompt="中国", max_tokens=20, temperature=0, stop=stop, logprobs=1)
    streamed = client.completions.create(model=MODEL, prompt="中国", max_tokens=20, temperature=0, stop=stop,
                                         logprobs=1, stream=True)
    text, logprobs = plain.choices[0].text, plain.choices[0].logprobs
    assert text == full[:full.index(stop)]
    ends = [offset + len(token) for offset, token in zip(logprobs.text_offset, logprobs.tokens, strict=True)]
    assert ends[-1] >= len(text) and (len(ends) == 1 or ends[-2] < len(text))
    tokens = [token for chunk in streamed for choice in chunk.choices for token in choice.logprobs.tokens]
    assert tokens == logprobs.tokens
