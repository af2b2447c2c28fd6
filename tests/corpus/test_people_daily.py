"""People's Daily tag stripping: the documented format, Latin words kept apart, the whole corpus."""

from __future__ import annotations

from train_deploy.corpus.people_daily import strip_pos_tags
from train_deploy.corpus.readers import people_daily_path


def test_people_daily_keeps_a_space_between_latin_words():
    assert strip_pos_tags(["加入/v  WTO/nx  Internet/nx  网络/n  2/m  个/q",
                           "１０００/m  ９００/m  ＷＴＯ/nx  １/m  张/q  TCP/IP/nx", "", "  a/x  "]) == \
        ["加入WTO Internet网络2个", "１０００ ９００ ＷＴＯ １张TCP/IP", "", "a"]


def _reference_strip(line: str) -> str:
    """Token by token, as the format is documented: `word/TAG` separated by spaces."""
    latin = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    latin += "".join(chr(ord(c) + 0xFEE0) for c in latin)  # full-width forms
    out = ""
    for token in line.split():
        word = token.rsplit("/", 1)[0]
        if out and word and out[-1] in latin and word[0] in latin:
            out += " "
        out += word
    return out


def test_vectorised_pos_stripping_matches_token_by_token_reference():
    lines = people_daily_path().read_text(encoding="utf-8").splitlines()
    assert strip_pos_tags(lines) == [_reference_strip(line) for line in lines]
