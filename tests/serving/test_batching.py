"""The Batcher: sequences join and leave the running batch between decode steps, and each keeps the tokens it gets
alone from LanguageModel.generate (greedy, or sampled with its seed), on ONNX Runtime and on Paddle Inference (the
graph this CPU runs: the portable one where the fused kernels cannot run)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from train_deploy.export import LanguageModel
from train_deploy.serving.batching import Batcher, Job, Sampling

pytestmark = pytest.mark.slow

PROMPTS = ["今天天气很好，我们去公园", "中国", "中国的经济发展很快，人民的生活"]
GREEDY = Sampling(temperature=0)
LONGEST = 12
_ALONE: dict[str, list[int]] = {}


@pytest.fixture(scope="module", params=["onnx", "paddle"])
def model(request, tiny_bundle) -> LanguageModel:
    model = LanguageModel.load(tiny_bundle, backend=request.param)
    _ALONE.clear()  # each prompt's greedy tokens alone, decoded before any batcher runs on this model's engine
    _ALONE.update({text: [token for _, token in model.stream_ids([_ids(model, text)], LONGEST, _greedy)]
                   for text in PROMPTS})
    return model


def _ids(model: LanguageModel, text: str) -> list[int]:
    return [model.eos_id, *model.tokenizer.encode([model.normalize(text)])[0]]


def _alone(model: LanguageModel, text: str, steps: int) -> list[int]:
    """``text``'s first ``steps`` greedy tokens served alone (a greedy run's prefix is the shorter run), from the
    fixture's decoding: never decoded here while a batcher's thread may use the same engine (Paddle's predictor is
    not thread-safe; the batcher's last step can still run after a job's wait returns)."""
    assert steps <= LONGEST
    return _ALONE[text][:steps]


def _greedy(_: int, logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def _later(deadline: float = 60.0) -> float:
    return time.monotonic() + deadline


class StepHooks:
    """``on_step`` that records batch sizes and runs ``actions[step]`` after that decode step (in the decode thread,
    so a join or a cancel lands at a known step). The first step waits until the test has armed the actions: on a
    busy host the thread could otherwise run its steps before the test had set them."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.actions: dict[int, object] = {}
        self._armed = threading.Event()

    def arm(self, actions: dict[int, object]) -> None:
        self.actions = actions
        self._armed.set()

    def __call__(self, size: int) -> None:
        self.sizes.append(size)
        assert self._armed.wait(60), "the test never armed its step actions"
        action = self.actions.get(len(self.sizes))
        if action is not None:
            action()


def test_greedy_jobs_joining_at_different_steps_equal_each_prompt_alone(model):
    hooks = StepHooks()
    batcher = Batcher(model, max_running=4, on_step=hooks)
    jobs: list[Job] = []

    def submit(text: str, steps: int) -> None:
        jobs.append(batcher.submit(_ids(model, text), steps, GREEDY, _later()))

    hooks.arm({2: lambda: submit(PROMPTS[1], 6), 4: lambda: submit(PROMPTS[2], 9)})
    submit(PROMPTS[0], 12)
    try:
        first = jobs[0].wait(60)  # the others were submitted before the first ends
        outputs = [first, *(job.wait(60) for job in jobs[1:])]
    finally:
        batcher.close()
    assert outputs == [_alone(model, PROMPTS[0], 12), _alone(model, PROMPTS[1], 6), _alone(model, PROMPTS[2], 9)]
    assert [job.finish_reason for job in jobs] == ["length"] * 3
    # the second joins after step 2 and leaves after its 5th step (its 1st token comes from its prefill), the third
    # joins after step 4, the first leaves after step 11
    assert hooks.sizes == [1, 1, 2, 2, 3, 3, 3, 2, 2, 2, 2, 1]
    assert model.tokenizer.decode(outputs[2]) == model.generate(PROMPTS[2], max_new_tokens=9, temperature=0)


def test_a_cancelled_job_leaves_at_the_next_step_and_the_others_keep_their_tokens(model):
    hooks = StepHooks()
    batcher = Batcher(model, on_step=hooks)
    try:
        first = batcher.submit(_ids(model, PROMPTS[0]), 10, GREEDY, _later())
        second = batcher.submit(_ids(model, PROMPTS[1]), 10, GREEDY, _later())
        hooks.arm({2: first.cancel})
        assert second.wait(60) == _alone(model, PROMPTS[1], 10)
        assert first.wait(60) == _alone(model, PROMPTS[0], 3)  # one from the prefill, one per step
    finally:
        batcher.close()
    assert (first.finish_reason, second.finish_reason) == ("cancelled", "length")


def test_a_job_past_its_deadline_ends_before_or_during_decoding(model):
    hooks = StepHooks()
    batcher = Batcher(model, on_step=hooks)
    try:
        late = batcher.submit(_ids(model, PROMPTS[0]), 10, GREEDY, time.monotonic() - 1)
        running = batcher.submit(_ids(model, PROMPTS[1]), 10, GREEDY, _later())
        hooks.arm({1: lambda: setattr(running, "deadline", 0.0)})
        assert late.wait(60) == [] and running.wait(60) == _alone(model, PROMPTS[1], 2)
    finally:
        batcher.close()
    assert (late.finish_reason, running.finish_reason) == ("deadline", "deadline")
    assert late.first_token_s is None and running.first_token_s > 0


def test_end_of_document_stops_a_job_without_being_streamed(model):
    """A model whose end-of-document id is the third greedy token: the job stops there, reason ``stop``."""
    alone = _alone(model, PROMPTS[0], 8)
    stops_early = LanguageModel(model._form, model.tokenizer, context=model.context, eos_id=alone[2])
    batcher = Batcher(stops_early)
    try:
        job = batcher.submit(_ids(model, PROMPTS[0]), 8, GREEDY, _later())
        assert job.wait(60) == alone[:alone.index(alone[2])]
    finally:
        batcher.close()
    assert job.finish_reason == "stop"


def test_max_new_tokens_ends_a_job_with_reason_length(model):
    batcher = Batcher(model)
    try:
        jobs = [batcher.submit(_ids(model, PROMPTS[0]), n, GREEDY, _later()) for n in (0, 1, 3)]
        assert [job.wait(60) for job in jobs] == [[], _alone(model, PROMPTS[0], 1), _alone(model, PROMPTS[0], 3)]
    finally:
        batcher.close()
    assert [job.finish_reason for job in jobs] == ["length"] * 3


def test_a_sampled_job_is_reproducible_by_its_seed_whatever_runs_beside_it(model):
    sampling = Sampling(temperature=0.9, top_k=0, top_p=0.9, seed=11)
    batcher = Batcher(model)
    try:
        beside = batcher.submit(_ids(model, PROMPTS[2]), 8, GREEDY, _later())
        sampled = batcher.submit(_ids(model, PROMPTS[0]), 8, sampling, _later())
        again = batcher.submit(_ids(model, PROMPTS[0]), 8, sampling, _later())
        # each is waited for: `again` may join the batch a step after `sampled`, so end a step later
        tokens, _, twin = sampled.wait(60), beside.wait(60), again.wait(60)
    finally:
        batcher.close()
    assert tokens == twin
    assert model.tokenizer.decode(tokens) == model.generate(PROMPTS[0], max_new_tokens=8, temperature=0.9, top_k=0,
                                                            top_p=0.9, seed=11)


def test_the_async_stream_yields_every_token_then_ends(model):
    async def collect() -> tuple[list[int], Job]:
        batcher = Batcher(model)
        try:
            job = batcher.submit(_ids(model, PROMPTS[1]), 7, GREEDY, _later())
            return [token async for token in job.stream()], job
        finally:
            batcher.close()

    tokens, job = asyncio.run(collect())
    assert tokens == _alone(model, PROMPTS[1], 7) == job.tokens
    assert job.finish_reason == "length" and job.first_token_s is not None


def test_close_cancels_the_jobs_still_waiting(model):
    batcher = Batcher(model, max_running=1)
    batcher.close()
    job = batcher.submit(_ids(model, PROMPTS[1]), 4, GREEDY, _later())
    assert job.wait(1) == [] and job.finish_reason == "cancelled"
    assert (batcher.running, batcher.waiting) == (0, 0)


class FailsOnce:
    """An engine whose first decode step raises, then works: the batch of that step ends, the thread goes on."""

    def __init__(self, form) -> None:
        self.form, self.failed = form, False

    def prefill(self, ids, mask):
        return self.form.prefill(ids, mask)

    def new_cache(self):
        cache = self.form.new_cache()
        decode = cache.decode

        def fails_once(ids):
            if not self.failed:
                self.failed = True
                raise RuntimeError("engine failure")
            return decode(ids)

        cache.decode = fails_once
        return cache


def test_a_failed_step_ends_its_jobs_with_an_error_and_later_jobs_are_served(model, caplog):
    failing = LanguageModel(FailsOnce(model._form), model.tokenizer, context=model.context, eos_id=model.eos_id)
    batcher = Batcher(failing)
    try:
        broken = batcher.submit(_ids(model, PROMPTS[0]), 5, GREEDY, _later())
        assert broken.wait(60) == _alone(model, PROMPTS[0], 1)  # the prefill's token, then the failed step
        later = batcher.submit(_ids(model, PROMPTS[1]), 5, GREEDY, _later())
        assert later.wait(60) == _alone(model, PROMPTS[1], 5)
    finally:
        batcher.close()
    assert (broken.finish_reason, later.finish_reason) == ("error", "length")
    assert "Batched generation failed; its 1 sequences end with an error" in caplog.text


def test_a_waiting_job_cancelled_or_past_its_deadline_ends_while_the_batch_is_full(model):
    hooks = StepHooks()
    batcher = Batcher(model, max_running=1, on_step=hooks)
    seen: dict[str, object] = {}
    try:
        running = batcher.submit(_ids(model, PROMPTS[0]), 8, GREEDY, _later())
        late = batcher.submit(_ids(model, PROMPTS[1]), 8, GREEDY, _later())
        gone = batcher.submit(_ids(model, PROMPTS[2]), 8, GREEDY, _later())
        hooks.arm({2: lambda: (setattr(late, "deadline", 0.0), gone.cancel()),
                         4: lambda: seen.update(reasons=(late.finish_reason, gone.finish_reason),
                                                waiting=batcher.waiting, running=running.finish_reason)})
        assert running.wait(60) == _alone(model, PROMPTS[0], 8)
    finally:
        batcher.close()
    assert seen == {"reasons": ("deadline", "cancelled"), "waiting": 0, "running": None}
    assert late.tokens == gone.tokens == []


class Recording:
    """An engine that records how many rows each prefill pass computes."""

    def __init__(self, form) -> None:
        self.form, self.prefills = form, []

    def prefill(self, ids, mask):
        self.prefills.append(len(ids))
        return self.form.prefill(ids, mask)

    def new_cache(self):
        return self.form.new_cache()


def test_a_sequence_that_outgrows_the_context_shifts_it_alone_while_the_others_keep_decoding_with_their_cache(model):
    long, short = _ids(model, PROMPTS[2]), _ids(model, PROMPTS[1])
    engine = Recording(model._form)
    small = LanguageModel(engine, model.tokenizer, context=len(long) + 2, eos_id=model.eos_id)
    assert len(short) + 8 <= small.context  # the short one never shifts
    alone = [[token for _, token in small.stream_ids([ids], n, _greedy)] for ids, n in ((long, 16), (short, 8))]
    assert len(alone[0]) == 16  # no end of document before the second shift
    engine.prefills.clear()
    hooks = StepHooks()
    batcher = Batcher(small, on_step=hooks)
    jobs: list[Job] = []
    try:
        jobs.append(batcher.submit(short, 8, GREEDY, _later()))
        hooks.arm({1: lambda: jobs.append(batcher.submit(long, 16, GREEDY, _later()))})
        outputs = [jobs[0].wait(60), jobs[1].wait(60) if len(jobs) > 1 else None]
    finally:
        batcher.close()
    assert outputs == [alone[1], alone[0]]
    # the two prompts, then the long one's last half context alone, once for its 4th token and once again when
    # its window outgrew the context again (for its 4 + context - context // 2 th); never a row of the short one
    assert engine.prefills == [1, 1, 1, 1]
    assert hooks.sizes == [1, *[2] * 6, *[1] * 9]  # one token a step each, the long one two at its first


class FailsAtShift(Recording):
    """An engine whose second prefill (the prompt's context shift, after its first) raises."""

    def prefill(self, ids, mask):
        if len(self.prefills) == 1:
            self.prefills.append(-1)
            raise RuntimeError("engine failure")
        return super().prefill(ids, mask)


def test_a_failed_context_shift_ends_its_job_with_an_error_and_the_thread_goes_on(model, caplog):
    long, short = _ids(model, PROMPTS[2]), _ids(model, PROMPTS[1])
    engine = FailsAtShift(model._form)
    small = LanguageModel(engine, model.tokenizer, context=len(long) + 2, eos_id=model.eos_id)
    batcher = Batcher(small)
    try:
        broken = batcher.submit(long, 8, GREEDY, _later())
        broken.wait(60)
        later = batcher.submit(short, 4, GREEDY, _later())
        assert later.wait(60) == _alone(model, PROMPTS[1], 4)
    finally:
        batcher.close()
    assert (broken.finish_reason, len(broken.tokens), later.finish_reason) == ("error", 3, "length")
    assert "Batched generation failed; its 1 sequences end with an error" in caplog.text


def test_a_burst_is_prefilled_in_groups_of_at_most_prefill_tokens_positions(model, monkeypatch):
    from train_deploy.serving import batching

    ids = _ids(model, PROMPTS[0])
    monkeypatch.setattr(batching, "PREFILL_TOKENS", 2 * len(ids))
    engine = Recording(model._form)
    recorded = LanguageModel(engine, model.tokenizer, context=model.context, eos_id=model.eos_id)
    hooks = StepHooks()
    batcher = Batcher(recorded, on_step=hooks)
    try:
        hooks.arm({})
        with batcher._wake:  # all five are waiting when the thread looks
            jobs = [batcher.submit(ids, 4, GREEDY, _later()) for _ in range(5)]
        outputs = [job.wait(60) for job in jobs]
    finally:
        batcher.close()
    assert outputs == [_alone(model, PROMPTS[0], 4)] * 5
    assert engine.prefills == [2, 2, 1]  # 5 prompts at once: one pass of 5 rows before
    assert hooks.sizes == [5, 5, 5]
