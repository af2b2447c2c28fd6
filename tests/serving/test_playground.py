"""The playground page (GET /): its HTML, and the page in headless Chromium (Debian's) streaming a completion in
as it comes, from a server that speaks OpenAI's server-sent events the way ``/v1/completions`` does."""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
from collections.abc import AsyncIterator

import pytest
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.helpers import browser
from tests.helpers.asgi import served
from train_deploy.export.runtime import LanguageModel
from train_deploy.serving import completions
from train_deploy.serving.playground import page

PIECES = ["今天", "天气", "很好。"]
CARD = "A 2-layer GPT trained on the People's Daily corpus; Chinese text only."


def test_every_value_in_the_page_is_escaped():
    html = page('<b>lm</b>"', "3<script>", "a card & <i>line</i>")
    assert "<b>" not in html and "<i>" not in html and "3<script>" not in html
    assert 'data-model="&lt;b&gt;lm&lt;/b&gt;&quot;"' in html
    assert '<p id="card">a card &amp; &lt;i&gt;line&lt;/i&gt;</p>' in html
    assert '<small id="version">version 3&lt;script&gt;</small>' in html


def test_the_page_fetches_nothing_from_outside_the_server():
    html = page("lm", "1", "card")
    assert re.findall(r"\b(?:src|href)=", html) == []
    assert "http://" not in html and "https://" not in html and "@import" not in html
    assert 'fetch("v1/completions"' in html and "stream: true" in html


class StreamingServer:
    """The playground at ``/`` and a ``/v1/completions`` that streams :data:`PIECES` as OpenAI's events,
    holding back all but the first until :attr:`release` is set, so the page is seen mid-stream."""

    def __init__(self) -> None:
        self.release, self.requests = threading.Event(), []
        self.app = Starlette(routes=[Route("/", self.index), Route("/v1/completions", self.complete,
                                                                     methods=["POST"])])

    async def index(self, request: Request) -> Response:
        return HTMLResponse(page("train_deploy_lm", "4", CARD))

    async def complete(self, request: Request) -> Response:
        self.requests.append(json.loads(await request.body()))
        return StreamingResponse(self._events(), media_type="text/event-stream")

    async def _events(self) -> AsyncIterator[bytes]:
        ident = completions.completion_id()
        for i, piece in enumerate(PIECES):
            yield completions.chunk(ident, "train_deploy_lm", 0, piece, None)
            if i == 0:
                await asyncio.to_thread(self.release.wait, 30)
        yield completions.chunk(ident, "train_deploy_lm", 0, "", "length")
        yield completions.DONE


@pytest.mark.skipif(not browser.installed(), reason=browser.MISSING)
def test_chromium_types_a_prompt_and_sees_the_completion_stream_in(tmp_path):
    server = StreamingServer()
    with served(server.app) as url, browser.chromium(tmp_path / "chromium") as tab:
        tab.open(f"{url}/")
        assert (tab.text("#model"), tab.text("#version"), tab.text("#card")) == ("train_deploy_lm", "version 4",
                                                                                  CARD)
        tab.type_into("#prompt", "今天")
        tab.click("#generate")
        tab.wait_until(f"document.getElementById('output').textContent === {json.dumps(PIECES[0])}")
        assert tab.evaluate("document.getElementById('generate').disabled") is True
        server.release.set()
        tab.wait_until("document.getElementById('status').textContent.startsWith('done in ')")
        assert tab.text("#output") == "".join(PIECES)
        shot = tab.screenshot()
    assert server.requests == [{"model": "train_deploy_lm", "prompt": "今天", "max_tokens": 64, "temperature": 0,
                                "top_p": 1, "seed": 0, "stream": True}]
    _assert_screenshot(shot)


@pytest.mark.skipif(not browser.installed(), reason=browser.MISSING)
def test_a_refused_completion_shows_the_servers_message_and_no_output(tmp_path):
    async def refuse(request: Request) -> Response:
        return JSONResponse({"error": {"message": "max_tokens: 5000 is over the limit of 256", "type":
                                       "invalid_request_error", "param": "max_tokens", "code": None}}, 400)

    async def index(request: Request) -> Response:
        return HTMLResponse(page("train_deploy_lm", "4", CARD))

    app = Starlette(routes=[Route("/", index), Route("/v1/completions", refuse, methods=["POST"])])
    with served(app) as url, browser.chromium(tmp_path / "chromium") as tab:
        tab.open(f"{url}/")
        tab.type_into("#prompt", "今天")
        tab.click("#generate")
        tab.wait_until("document.getElementById('status').className === 'error'")
        assert tab.text("#status") == "max_tokens: 5000 is over the limit of 256"
        assert tab.text("#output") == ""
        assert tab.evaluate("document.getElementById('generate').disabled") is False


def _assert_screenshot(shot: bytes) -> None:
    """``shot`` is a valid PNG of the page's size with something drawn on it."""
    image = Image.open(io.BytesIO(shot))
    image.verify()
    image = Image.open(io.BytesIO(shot))
    assert (image.format, image.size) == ("PNG", browser.VIEWPORT)
    low, high = image.convert("L").getextrema()
    assert high - low > 100, "the screenshot is blank"



@pytest.mark.slow
@pytest.mark.skipif(not browser.installed(), reason=browser.MISSING)
def test_the_servers_playground_streams_the_models_greedy_continuation_into_chromium(server, tiny_bundle,
                                                                                    tmp_path):
    with browser.chromium(tmp_path / "chromium") as tab:
        tab.open(f"{server.url}/")
        assert (tab.text("#model"), tab.text("#version")) == ("train_deploy_lm", "version 1")
        assert tab.text("#card").strip() != ""
        tab.type_into("#prompt", "中国")
        tab.click("#generate")
        tab.wait_until("document.getElementById('status').textContent.startsWith('done in ')", timeout=60)
        streamed = tab.text("#output")
        shot = tab.screenshot()
    assert streamed == LanguageModel.load(tiny_bundle).generate("中国", max_new_tokens=64, temperature=0)
    assert streamed != ""
    _assert_screenshot(shot)
