"""The evaluation set a first registration makes from the validation split holds no text that a training document
holds (issue 36): a chapter of a second edition that opens as the first edition's does is not a near-duplicate of it
as a whole, but its opening, the text the set would take, is the other chapter's."""

from __future__ import annotations

from tests.corpus.test_dedup import _is_valid, split_texts
from tests.helpers.corpus import encode, random_chinese
from train_deploy.registry.evalset import validation_texts


def _shingles(text: str) -> set[str]:
    return {text[i : i + 5] for i in range(len(text) - 4)}


def _held(text: str, documents: list[str]) -> bool:
    """A document holds at least 80% of the text's 5-character shingles (the corpus stage's defaults)."""
    return any(len(_shingles(text) & _shingles(doc)) >= 0.8 * len(_shingles(text)) for doc in documents)


def test_a_validation_text_whose_opening_a_training_chapter_holds_is_passed_over(tmp_path, tiny_tokenizer):
    first = random_chinese(30, 600, seed=41)
    second = [chapter[:150] + new for chapter, new in zip(first, random_chinese(30, 450, seed=42), strict=True)]
    path = tmp_path / "manual.txt"
    path.write_text("\n\n".join(first + second) + "\n", encoding="utf-8")
    _, manifest = encode(tmp_path, tiny_tokenizer, encoding={"validation_fraction": 0.3},
                         reader={"source": "text", "paths": [str(path)], "chunk_bytes": 8192, "max_bytes": None})
    assert "near_duplicate_of_training" not in manifest.documents.dropped  # a quarter in common: no near-twins
    crossing = sum(_is_valid(a, 0.3) != _is_valid(b, 0.3) for a, b in zip(first, second, strict=True))
    training = split_texts(manifest, "train", tiny_tokenizer)
    openings = [text[:100] for text in split_texts(manifest, "valid", tiny_tokenizer)]
    expected = [text for text in openings if not _held(text, training)]
    assert (len(openings), len(openings) - len(expected), crossing) == (23, 11, 11)

    assert validation_texts(manifest, tiny_tokenizer, 100, 100) == expected
    assert validation_texts(manifest, tiny_tokenizer, 4, 100) == expected[:4]  # the next ones fill the gaps
