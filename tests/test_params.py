"""`kedro run --params` as the project reads it (train_deploy.params): Kedro's items, one line for a bad value."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from train_deploy.params import ParamsError, parse_params


def test_values_are_yaml_as_kedro_reads_them_and_commas_inside_a_value_stay_in_it():
    assert parse_params(None, None, "a.b=1,a.c=2.5,d=true,e=null,f=[1, 2],g='3'") == {
        "a": {"b": 1, "c": 2.5}, "d": True, "e": None, "f": [1, 2], "g": "3"}
    assert parse_params(None, None, "corpus.reader.paths=[/a/*.html,/b],corpus.reader.separator=-{4,},x=\"p,q\"") == {
        "corpus": {"reader": {"paths": ["/a/*.html", "/b"], "separator": "-{4,}"}}, "x": "p,q"}
    assert parse_params(None, None, {"given": 1}) == {"given": 1}
    assert parse_params(None, None, "") == {}


def test_a_bare_value_yaml_cannot_start_is_taken_as_its_text_with_a_warning_showing_the_quoting(caplog):
    with caplog.at_level(logging.WARNING, logger="train_deploy.params"):
        assert parse_params(None, None, "corpus.reader.separator=%,x=@y") == {
            "corpus": {"reader": {"separator": "%"}}, "x": "@y"}
    first = caplog.records[0].getMessage()
    assert first.startswith("--params corpus.reader.separator=%: YAML cannot read '%' (")
    assert first.endswith("taken as the string '%'; write --params \"corpus.reader.separator='%'\" to say so")
    assert parse_params(None, None, "corpus.reader.separator='%'") == {"corpus": {"reader": {"separator": "%"}}}


@pytest.mark.parametrize(("value", "message"), [
    ("training.batch.seq_length=[12", "--params training.batch.seq_length=[12: YAML cannot read the value (did not "
     "find expected ',' or ']'); close it, or quote it as a string: --params \"training.batch.seq_length='[12'\""),
    ("corpus.reader.paths={a: 1", "--params corpus.reader.paths={a: 1: YAML cannot read the value ("),
    ("corpus.reader", "--params 'corpus.reader': an item is key=value (e.g. --params corpus.reader.max_bytes=200000)"),
])
def test_a_value_that_cannot_be_read_is_one_line_naming_the_key_and_the_quoting(value, message):
    with pytest.raises(ParamsError) as refused:
        parse_params(None, None, value)
    assert refused.value.format_message().startswith(message) and "\n" not in refused.value.format_message()


def test_kedro_run_with_a_bad_params_value_prints_one_line_and_exits_2(project, tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    done = subprocess.run([sys.executable, "-m", "kedro", "run", "--pipelines", "corpus", "--params",
                           "corpus.reader.source=text,corpus.reader.separator='%"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr == ("Error: --params corpus.reader.separator='%: YAML cannot read the value (found unexpected "
                           "end of stream); close it, or quote it as a string: --params "
                           "\"corpus.reader.separator='%'\"\n"), done.stderr[-3000:]
    assert done.stdout == ""
