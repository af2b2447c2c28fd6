"""Bad input: a one-line error naming the file (and line), or a counted warning; never partial outputs."""

from __future__ import annotations

import bz2
import json
import re
from pathlib import Path

import pytest

from tests.helpers.corpus import GOOD
from tests.helpers.project import corpus_params
from train_deploy.atomic import atomic_folder
from train_deploy.config import ConfigError
from train_deploy.corpus.build import encode_corpus
from train_deploy.corpus.config import CorpusConfig
from train_deploy.corpus.readers import CorpusError, plan_corpus
from train_deploy.handoffs import TokenizerInfo, TokenManifest, from_json, to_json


def run(tmp_path: Path, tokenizer: TokenizerInfo, paths: list[Path], workers: int = 1, **reader) -> TokenManifest:
    """Encode into ``tmp_path/tokens`` staged and published as the catalog's folder dataset does."""
    params = corpus_params(reader={"source": "text", "paths": [str(p) for p in paths], "max_bytes": None, **reader},
                           encoding={"workers": workers})
    config = CorpusConfig.from_params(params)
    with atomic_folder(tmp_path / "tokens") as staging:
        return encode_corpus(config, plan_corpus(config.reader), tokenizer, staging)


def assert_nothing_written(tmp_path: Path) -> None:
    leftovers = [p.name for p in tmp_path.iterdir() if p.name == "tokens" or p.name.startswith(".tokens")]
    assert leftovers == [], f"partial outputs left behind: {leftovers}"


def assert_one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_missing_path_is_named(tmp_path, tiny_tokenizer):
    with pytest.raises(CorpusError) as exc:
        run(tmp_path, tiny_tokenizer, [tmp_path / "nope.txt"])
    assert assert_one_line(exc) == f"{tmp_path / 'nope.txt'}: no such file or folder (corpus.reader.paths)"
    with pytest.raises(CorpusError, match=r"no file matches this pattern"):
        run(tmp_path, tiny_tokenizer, [tmp_path / "*.jsonl"])


def test_empty_corpus_is_an_error(tmp_path, tiny_tokenizer):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("", encoding="utf-8")
    short.write_text("短\n\n也短\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"corpus is empty: nothing to read in .*empty\.txt"):
        run(tmp_path, tiny_tokenizer, [empty])
    with pytest.raises(CorpusError) as exc:
        run(tmp_path, tiny_tokenizer, [short])
    assert re.search(r"corpus is empty: no document left after cleaning in .*short\.txt .*too_short': 2",
                     assert_one_line(exc))
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("workers", [1, 2])
def test_invalid_utf8_names_file_and_line_or_is_skipped(tmp_path, tiny_tokenizer, workers):
    bad = tmp_path / "gbk.txt"
    bad.write_bytes(GOOD.encode() * 20 + "这是GBK编码\n".encode("gbk") + GOOD.encode())
    with pytest.raises(CorpusError) as exc:
        run(tmp_path, tiny_tokenizer, [bad], workers=workers, chunk_bytes=4096)
    assert assert_one_line(exc) == f"{bad} line 1201: not valid UTF-8 (byte 0xd5 at column 1)"
    assert_nothing_written(tmp_path)
    manifest = run(tmp_path, tiny_tokenizer, [bad], workers=workers, chunk_bytes=4096, on_error="skip")
    assert manifest.documents.skipped_bad_input == {"invalid_utf8": 1}
    assert manifest.warnings == [f"{bad} line 1201: not valid UTF-8 (byte 0xd5 at column 1)"]


def test_binary_garbage_is_refused_or_skipped(tmp_path, tiny_tokenizer):
    garbage = tmp_path / "model.bin"
    garbage.write_bytes(bytes(range(256)) * 64)
    good = tmp_path / "good.txt"
    good.write_text(GOOD, encoding="utf-8")
    with pytest.raises(CorpusError) as exc:
        run(tmp_path, tiny_tokenizer, [garbage, good])
    assert assert_one_line(exc).startswith(f"{garbage}: looks binary (NUL byte at offset 0)")
    manifest = run(tmp_path, tiny_tokenizer, [garbage, good], on_error="skip")
    assert manifest.input["skipped_files"] == {str(garbage): "looks binary (NUL byte at offset 0)"}
    assert manifest.documents.kept == 30


def test_random_bytes_without_nul_fail_as_invalid_utf8(tmp_path, tiny_tokenizer):
    import random

    noise = tmp_path / "noise.txt"
    rng = random.Random(1)
    noise.write_bytes(bytes(rng.randrange(1, 256) for _ in range(5000)))
    with pytest.raises(CorpusError, match=rf"^{re.escape(str(noise))} line \d+: not valid UTF-8"):
        run(tmp_path, tiny_tokenizer, [noise])


def test_a_single_100_mb_line_is_refused_or_skipped_with_bounded_memory(tmp_path, tiny_tokenizer):
    huge = tmp_path / "one_line.txt"
    with open(huge, "wb") as f:
        f.write(GOOD.encode())
        block = "长" * (1 << 20)
        for _ in range(34):  # 34 × 3 MiB ≈ 100 MiB, no newline
            f.write(block.encode())
        f.write(b"\n\n" + GOOD.encode())
    with pytest.raises(CorpusError) as exc:
        run(tmp_path, tiny_tokenizer, [huge])
    assert assert_one_line(exc) == f"{huge} line 61: line longer than 8388608 bytes (corpus.reader.max_line_bytes)"
    small = tmp_path / "small.txt"
    small.write_text(GOOD + "\n\n" + GOOD, encoding="utf-8")
    peak_small, manifest_small = _skip_run_in_fresh_process(tmp_path / "a", tiny_tokenizer, small)
    peak_huge, manifest = _skip_run_in_fresh_process(tmp_path / "b", tiny_tokenizer, huge)
    assert manifest.documents.skipped_bad_input == {"line_too_long": 1}
    assert manifest.documents.kept == manifest_small.documents.kept == 30  # the rest are duplicates
    assert peak_huge - peak_small < 40, f"peak RSS grew by {peak_huge - peak_small:.0f} MB for a 100 MB line"


def _skip_run_in_fresh_process(tmp_path: Path, tokenizer: TokenizerInfo, path: Path) -> tuple[float, TokenManifest]:
    """Peak RSS (MB) of a process that encodes ``path`` with ``on_error: skip``, and the manifest."""
    import subprocess
    import sys

    tokenizer_json = json.dumps({**to_json(tokenizer), "path": tokenizer.path})
    script = f"""
import json, resource
from tests.corpus.test_bad_input import run
from train_deploy.handoffs import TokenizerInfo, from_json, to_json
from pathlib import Path
tokenizer = from_json(TokenizerInfo, json.loads({tokenizer_json!r}), "tokenizer")
manifest = run(Path({str(tmp_path)!r}), tokenizer, [Path({str(path)!r})], on_error="skip")
print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, to_json(manifest)]))
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    peak, manifest = json.loads(out.stdout.strip().splitlines()[-1])
    return peak, from_json(TokenManifest, manifest, "manifest")


def test_jsonl_line_without_the_text_field(tmp_path, tiny_tokenizer):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"第{i}行有足够长的文字内容。"}, ensure_ascii=False) for i in range(5)]
    lines.insert(3, json.dumps({"body": "字段名不对"}, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CorpusError) as exc:
        run(tmp_path, tiny_tokenizer, [path], source="jsonl")
    assert assert_one_line(exc) == f"{path} line 4: no field 'text' (corpus.reader.text_field)"
    manifest = run(tmp_path, tiny_tokenizer, [path], source="jsonl", on_error="skip")
    assert manifest.documents.skipped_bad_input == {"missing_field": 1}
    assert manifest.documents.kept == 5


def test_truncated_bz2_is_named(tmp_path, tiny_tokenizer):
    path = tmp_path / "c.jsonl.bz2"
    filler = "".join(chr(0x4E00 + k * 97 % 20000) for k in range(100))  # no repeated n-gram for the filters
    data = "".join(json.dumps({"text": f"第{i}行的内容{filler}。"}, ensure_ascii=False) + "\n"
                   for i in range(20000)).encode()  # 6 MB: several 900 kB bz2 blocks
    compressed = bz2.compress(data)
    path.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(CorpusError) as exc:
        run(tmp_path, tiny_tokenizer, [path], source="jsonl")
    assert assert_one_line(exc).startswith(f"{path}: compressed stream is truncated or corrupt")
    assert_nothing_written(tmp_path)
    manifest = run(tmp_path, tiny_tokenizer, [path], source="jsonl", on_error="skip")
    assert manifest.documents.skipped_bad_input == {"truncated_archive": 1}
    assert 0 < manifest.documents.kept < 20000


def test_truncated_wiki_dump_is_named(tmp_path, tiny_tokenizer):
    from tests.helpers.corpus import wiki_dump

    path = tmp_path / "zhwiki.xml.bz2"
    pages = [(0, f"条目{i}", f"'''条目{i}'''是一个测试条目，{'内容' * 200}。") for i in range(300)]
    compressed = bz2.compress(wiki_dump(pages))
    path.write_bytes(compressed[: len(compressed) - 200])
    with pytest.raises(CorpusError, match=rf"^{re.escape(str(path))}: compressed stream is truncated or corrupt"):
        run(tmp_path, tiny_tokenizer, [path], source="wiki_xml")


def test_truncated_multistream_dump_is_named(tmp_path, tiny_tokenizer):
    from tests.helpers.corpus import multistream_dump, sample_pages

    path = tmp_path / "zhwiki-multistream.xml.bz2"
    data = multistream_dump(sample_pages(300), 10)
    path.write_bytes(data[: len(data) - 300])  # the last page stream loses its end
    with pytest.raises(CorpusError, match=rf"^{re.escape(str(path))}: compressed stream is truncated or corrupt "
                                          r"\(a bz2 stream ends before its end-of-stream marker\)"):
        run(tmp_path, tiny_tokenizer, [path], source="wiki_xml", chunk_bytes=4096)
    assert_nothing_written(tmp_path)


def test_malformed_xml_in_a_later_chunk_of_a_dump_names_its_line_in_the_file(tmp_path, tiny_tokenizer):
    from tests.helpers.corpus import sample_pages, wiki_dump

    text = wiki_dump(sample_pages(300)).decode().replace("<page>", "\n<page>")
    broken = text.index("<title>条目250</title>")
    path = tmp_path / "zhwiki.xml"
    path.write_text(text[:broken] + "<title>条目250</titel>" + text[broken + len("<title>条目250</title>"):],
                    encoding="utf-8")
    line = text[:broken].count("\n") + 1
    with pytest.raises(CorpusError, match=rf"^{re.escape(str(path))} line {line}: malformed XML"):
        run(tmp_path, tiny_tokenizer, [path], source="wiki_xml", chunk_bytes=4096)


def test_existing_outputs_survive_a_failed_rebuild(tmp_path, tiny_tokenizer):
    good = tmp_path / "good.txt"
    good.write_text(GOOD, encoding="utf-8")
    first = run(tmp_path, tiny_tokenizer, [good])
    before = {p.name: p.read_bytes() for p in (tmp_path / "tokens").iterdir()}
    good.write_bytes(GOOD.encode() + b"\xff\xfe broken\n")
    with pytest.raises(CorpusError, match="not valid UTF-8"):
        run(tmp_path, tiny_tokenizer, [good])
    after = {p.name: p.read_bytes() for p in (tmp_path / "tokens").iterdir()}
    assert after == before and json.loads(after["manifest.json"])["fingerprint"] == first.fingerprint


@pytest.mark.parametrize(
    "block,message",
    [
        ({"reader": {"source": "book"}}, "corpus.reader.source: 'book' is not one of"),
        ({"reader": {"chunk_size": 1}}, "corpus.reader.chunk_size: unknown key"),
        ({"tokenizer": {"vocab_size": "big"}}, "corpus.tokenizer.vocab_size: expected an integer, got 'big'"),
        ({"reader": {"source": "jsonl"}}, "corpus.reader.paths: source 'jsonl' needs at least one file"),
        ({"tokenizer": {"mode": "load"}}, "corpus.tokenizer.load_path: mode 'load' needs the directory"),
        ({"encoding": {"validation_fraction": 1.5}}, "corpus.encoding.validation_fraction: must be in [0, 1)"),
    ],
)
def test_configuration_errors_name_the_key(tmp_path, block, message):
    params = corpus_params()
    for name, values in block.items():
        params[name].update(values)
    with pytest.raises(ConfigError) as exc:
        CorpusConfig.from_params(params)
    assert str(exc.value).startswith(message)
