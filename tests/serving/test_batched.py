"""batched.start: a request's prompts as jobs in the running batch, their text decoded a few tokens at a time as
they come. Joined, a prompt's pieces are the text that decoding its whole output gives, and a token that leaves a
character incomplete comes with the token that completes it."""

from __future__ import annotations

import asyncio
import time

import pytest

from train_deploy.export import LanguageModel
from train_deploy.serving.admission import Lane, Ticket
from train_deploy.serving.batched import TokenEvent, start
from train_deploy.serving.batching import Batcher, Sampling

pytestmark = pytest.mark.slow

# the whole vocabulary, hot: the tiny model's byte pieces (byte_fallback) come often, and many characters span two
# or three of them
WILD = Sampling(temperature=1.5, top_k=0, seed=7)


def _run(model: LanguageModel, texts: list[str], new_tokens: int) -> tuple[list[TokenEvent], list[list[int]]]:
    batcher, lane = Batcher(model, max_running=4), Lane("generate", 4, 0)

    async def follow() -> tuple[list[TokenEvent], list[list[int]]]:
        prompts = [[model.eos_id, *ids] for ids in model.tokenizer.encode([model.normalize(t) for t in texts])]
        queue, future, jobs = start(batcher, lane, Ticket(time.monotonic(), 60), prompts, new_tokens, WILD,
                                    model.tokenizer)
        events = []
        while (event := await queue.get()) is not None:
            events.append(event)
        await future
        return events, [job.tokens for job in jobs]

    try:
        return asyncio.run(follow())
    finally:
        batcher.close()
        lane.close()


def test_pieces_join_into_the_decoded_output_and_an_incomplete_character_waits_for_its_end(tiny_bundle):
    model = LanguageModel.load(tiny_bundle, backend="onnx")
    events, outputs = _run(model, ["中国", "今天天气很好"], 300)
    held = 0
    for sequence, tokens in enumerate(outputs):
        mine = [event for event in events if event.sequence == sequence]
        assert [event.token for event in mine] == tokens
        assert "".join(event.text for event in mine) == model.tokenizer.decode(tokens)
        # a token with text of its own sent empty: its bytes came with a later piece
        held += sum(event.text == "" and model.tokenizer.decode([event.token]) != "" for event in mine[:-1])
    assert held > 0, "no output had a character across tokens: the case this test is for did not occur"
