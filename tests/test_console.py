"""The console on a real terminal (a pseudo-terminal): log records and progress bars keep to their own lines."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios

import pytest

# Kedro's console handler on the root logger (as conf/logging.yml sets it up), a training-like bar, and records
# logged while the bar is drawn.
LOGGING_UNDER_A_BAR = """
import logging, sys
from kedro.logging import RichHandler
from tqdm.auto import tqdm
from train_deploy.console import log_above_bars_on_terminal
logging.getLogger().addHandler(RichHandler())
logging.getLogger().setLevel(logging.INFO)
if sys.argv[1] == "above":
    log_above_bars_on_terminal()
bar = tqdm(total=5, desc="training", unit="step", disable=None, mininterval=0, miniters=1)
for step in range(5):
    bar.update(1)
    logging.getLogger("train_deploy.test").info("record %d of the run", step)
bar.close()
"""
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x1b]*\x1b\\")  # CSI (colours, cursor), OSC (links)


def _terminal_lines(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: each carriage return goes back to the line's start and what follows
    overwrites it (colours and other escape sequences dropped)."""
    lines = []
    for line in _ESCAPE.sub("", raw).replace("\r\n", "\n").split("\n"):
        shown: list[str] = []
        for part in line.split("\r"):
            shown[: len(part)] = part
        lines.append("".join(shown).rstrip())
    return lines


def _under_a_pty(mode: str) -> list[str]:
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm draws nothing 0 columns wide
    process = subprocess.Popen([sys.executable, "-c", LOGGING_UNDER_A_BAR, mode], stdin=child, stdout=child,
                               stderr=child, env={**os.environ, "TERM": "xterm"})
    os.close(child)
    raw = b""
    try:
        while chunk := os.read(main, 65536):
            raw += chunk
    except OSError:  # EIO: the child closed the terminal
        pass
    finally:
        os.close(main)
    assert process.wait(60) == 0, raw.decode(errors="replace")[-2000:]
    return _terminal_lines(raw.decode("utf-8", errors="replace"))


@pytest.mark.parametrize("mode", ["above", "kedro_only"])
def test_on_a_terminal_log_records_are_written_above_the_bar_not_into_it(mode):
    lines = _under_a_pty(mode)
    records = [line for line in lines if "of the run" in line]
    glued = [line for line in records if "training:" in line or "step/s" in line or "%|" in line]
    assert len(records) == 5, lines
    if mode == "kedro_only":  # without AboveProgressBars the records run into the bar: what the test must catch
        assert glued, lines
    else:
        assert glued == [], lines
        assert any(line.startswith("training: 100%|") for line in lines), lines  # the bar, on its own line


def test_the_end_of_run_line_judges_against_the_strongest_baseline_and_reads_bundles_made_before_it():
    from train_deploy.hooks.display import _baseline_line

    add_k = {"unigram_loss": 7.5, "bigram_loss": 6.0, "unigram_k": 1.0, "bigram_k": 0.01, "windows": 64,
             "seq_length": 128, "train_tokens": 1000}
    kneser_ney = {**add_k, "kn_bigram_loss": 5.8, "kn_bigram_discounts": [1.0, 0.75], "kn_trigram_loss": 5.2,
                  "kn_trigram_discounts": [1.0, 0.8, 0.85]}
    line = _baseline_line({"val_baselines": kneser_ney, "val_loss": 5.5}, {})
    assert line.startswith("validation: validation loss 5.5000 nats/token")
    assert "NOT below the Kneser-Ney trigram baseline (5.5000 vs 5.2000)" in line  # it beats both bigrams
    # a bundle exported before the Kneser-Ney baselines (no val_baselines: parity windows, add-k only)
    old = _baseline_line({"val_loss": None}, {"baselines": {**add_k, "model_loss": 5.9, "model_beats_bigram": True}})
    assert "below the strongest (add-k bigram)" in old and "NOT" not in old
    assert _baseline_line({}, {}) is None
