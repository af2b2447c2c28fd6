"""The playground page (``GET /``): a prompt box, the sampling settings, and the completion streamed in as it is
generated, with the served model's name, version and one line of its card.

One self-contained HTML document: no build step, and nothing fetched from anywhere but this server (the script
and style are inline; the page posts to ``/v1/completions`` with ``stream: true`` and reads the server-sent events
with ``fetch`` and a ``ReadableStream``). Every value placed in the page is HTML-escaped, and the script only
ever writes text (``textContent``), never markup.
"""

from __future__ import annotations

from html import escape

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem; color: #1b1b1b; }
header p { color: #555; margin-top: 0.2rem; }
textarea { width: 100%; box-sizing: border-box; font: inherit; }
fieldset { display: flex; flex-wrap: wrap; gap: 1rem; border: 1px solid #ccc; margin: 0.8rem 0; }
label { display: flex; flex-direction: column; font-size: 0.85rem; }
input { width: 7rem; font: inherit; }
#output { white-space: pre-wrap; border: 1px solid #ccc; min-height: 6rem; padding: 0.6rem; background: #fafafa; }
#status { color: #555; font-size: 0.85rem; }
#status.error { color: #a00; }
"""

_SCRIPT = """
"use strict";
const form = document.getElementById("form");
const output = document.getElementById("output");
const status = document.getElementById("status");
const button = document.getElementById("generate");

function number(id) { return Number(document.getElementById(id).value); }

function request() {
  const body = {model: document.body.dataset.model, prompt: document.getElementById("prompt").value,
    max_tokens: number("max_tokens"), temperature: number("temperature"), top_p: number("top_p"),
    seed: number("seed"), stream: true};
  const stop = document.getElementById("stop").value;
  if (stop) body.stop = stop;
  return body;
}

function show(text, error) { status.textContent = text; status.className = error ? "error" : ""; }

function handle(data) {
  if (data === "[DONE]") return true;
  const event = JSON.parse(data);
  if (event.error) { show(event.error.message, true); return true; }
  for (const choice of event.choices || []) output.textContent += choice.text;
  return false;
}

async function generate(submit) {
  submit.preventDefault();
  output.textContent = "";
  button.disabled = true;
  show("generating\u2026", false);
  const started = performance.now();
  try {
    const answer = await fetch("v1/completions", {method: "POST",
      headers: {"Content-Type": "application/json"}, body: JSON.stringify(request())});
    if (!answer.ok) {
      const refusal = await answer.json().catch(() => ({}));
      show((refusal.error && refusal.error.message) || ("HTTP " + answer.status), true);
      return;
    }
    const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "", done = false;
    while (!done) {
      const part = await reader.read();
      if (part.done) break;
      buffer += part.value;
      let end;
      while (!done && (end = buffer.indexOf("\\n\\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\\n")) {
          if (line.startsWith("data: ") && handle(line.slice(6))) { done = true; break; }
        }
      }
    }
    const seconds = ((performance.now() - started) / 1000).toFixed(2);
    if (status.className !== "error") show("done in " + seconds + " s", false);
  } catch (error) {
    show("the request failed: " + error.message, true);
  } finally {
    button.disabled = false;
  }
}

form.addEventListener("submit", generate);
"""


def _setting(name: str, label: str, value: str, attributes: str) -> str:
    return (f'<label for="{name}">{escape(label)}<input id="{name}" name="{name}" type="number" '
            f'value="{escape(value)}" {attributes}></label>')


def page(model_name: str, version: str, card_line: str) -> str:
    """The HTML of ``GET /`` for the served model ``model_name`` at ``version``, with ``card_line`` (one line of
    its card) under the title; every value escaped."""
    name, shown_version = escape(model_name), escape(version)
    settings = "\n".join([
        _setting("max_tokens", "max tokens", "64", 'min="1" step="1"'),
        _setting("temperature", "temperature", "0", 'min="0" max="2" step="0.05"'),
        _setting("top_p", "top p", "1", 'min="0.01" max="1" step="0.01"'),
        _setting("seed", "seed", "0", 'min="0" step="1"'),
        '<label for="stop">stop<input id="stop" name="stop" type="text" value=""></label>',
    ])
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{name} {shown_version} — playground</title>
<style>{_STYLE}</style>
</head>
<body data-model="{name}">
<header>
<h1><span id="model">{name}</span> <small id="version">version {shown_version}</small></h1>
<p id="card">{escape(card_line)}</p>
</header>
<form id="form">
<label for="prompt">prompt</label>
<textarea id="prompt" name="prompt" rows="5" required></textarea>
<fieldset><legend>sampling</legend>
{settings}
</fieldset>
<button id="generate" type="submit">generate</button> <span id="status"></span>
</form>
<h2>output</h2>
<div id="output" aria-live="polite"></div>
<script>{_SCRIPT}</script>
</body>
</html>
"""
