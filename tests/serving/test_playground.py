"""The playground page (GET /): its HTML, and (with Debian's chromium installed) the page in a headless browser
streaming a completion in as it comes."""

from __future__ import annotations

import re

from train_deploy.serving.playground import page


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
