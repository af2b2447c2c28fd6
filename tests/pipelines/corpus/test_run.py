"""The corpus stage as a user meets it: `kedro run` in a subprocess, on a small corpus of their own."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path


def paragraphs(count: int, start: int = 0) -> list[str]:
    """``count`` distinct People's Daily paragraphs of at least 40 characters."""
    lines = strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines()[start:start + 20 * count])
    return [line for line in dict.fromkeys(line.strip() for line in lines) if len(line) >= 40][:count]


def write_site(folder: Path, pages: int) -> Path:
    """``pages`` web pages of a few paragraphs each, as a small site exports them."""
    folder.mkdir(parents=True)
    text = paragraphs(pages * 6)
    for i in range(pages):
        body = "".join(f"<p>{p}</p>" for p in text[i * 6:(i + 1) * 6])
        (folder / f"page{i:02d}.html").write_text(
            f'<html><head><meta charset="utf-8"><title>第{i}页</title></head><body><nav>首页</nav>'
            f"<article><h1>第{i}章</h1>{body}</article><footer>版权所有</footer></body></html>", encoding="utf-8")
    return folder


def kedro_run(project: Path, tmp_path: Path, pipeline: str, params: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    return subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", pipeline, "--params", params],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # over 3 s on 2 cores (CI durations): left out of make test-quick
def test_a_validation_split_too_small_to_evaluate_is_refused_before_training_starts_naming_the_key(project, tmp_path):
    site = write_site(tmp_path / "site", 15)
    params = f"corpus.reader.source=html,corpus.reader.paths=[{site}],corpus.encoding.workers=1"
    done = kedro_run(project, tmp_path, "train_deploy", params)
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if "CorpusError" in line]
    assert line.startswith("CorpusError: corpus.encoding.validation_fraction: 0.01 of the 15 documents put 0 documents "
                           "(0 tokens) in the validation split, fewer tokens than one evaluation window of "
                           "training.batch.seq_length + 1 = 129; set it to "), line
    assert "Traceback" not in done.stdout + done.stderr
    log = (project / "logs" / "train_deploy.log").read_text(encoding="utf-8")
    assert "Running node: encode_corpus" in log and "Running node: train_model" not in log

    advised = re.search(r"--params (corpus\.encoding\.validation_fraction=[0-9.]+)\)", line)[1]
    again = kedro_run(project, tmp_path, "corpus", f"{params},{advised}")  # the advice works
    assert again.returncode == 0, again.stderr[-3000:]
    assert "CorpusError" not in again.stderr


def readme_commands(marker: str) -> list[str]:
    """The commands of README's "Your own corpus" code blocks that contain ``marker``, lines joined."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Your own corpus\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    commands = [command for block in blocks for command in block.replace("\\\n", " ").splitlines()]
    return [command for command in commands if marker in command]


def write_fortunes(folder: Path) -> Path:
    """Two files of short texts between lines holding only %, as fortune's files are."""
    folder.mkdir(parents=True)
    texts = paragraphs(400, start=5_000)  # not the web pages' paragraphs
    for name, part in (("zh", texts[:200]), ("tang", texts[200:])):
        (folder / name).write_text("\n%\n".join(part) + "\n%\n", encoding="utf-8")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(("marker", "placeholder", "write"), [
    ("corpus.reader.source=html", "/data/site", lambda tmp: write_site(tmp / "site", 15)),
    ("corpus.reader.separator=", "/data/fortunes", lambda tmp: write_fortunes(tmp / "fortunes")),
])
def test_the_readmes_own_corpus_commands_encode_a_small_corpus_first_time(project, tmp_path, marker, placeholder,
                                                                          write):
    [command] = readme_commands(marker)
    folder = write(tmp_path)
    words = shlex.split(command.replace(placeholder, str(folder)))
    assert words[:4] == [".venv/bin/kedro", "run", "--pipelines", "train_deploy"] and words[4] == "--params"
    # the corpus stage only (its check against training's window included): training is the other tests' part
    done = kedro_run(project, tmp_path, "corpus", words[5])
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((project / "data" / "04_feature" / "tokens" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["documents"]["kept"] >= 15 and manifest["splits"]["valid"]["tokens"] >= 129
    assert "Error" not in done.stderr
