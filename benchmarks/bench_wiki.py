"""A MediaWiki dump through the corpus stage: one bz2 stream against Wikipedia's multistream form.

    .venv/bin/python benchmarks/bench_wiki.py               # ~100 MB of page XML
    .venv/bin/python benchmarks/bench_wiki.py --size 20

Builds a dump of about ``--size`` MB of page XML (People's Daily paragraphs, 20 to a page, with links,
bold, a template, a heading and a redirect every 10th page for the stripper to remove), written twice:
as one bz2 stream (what ``bz2.compress`` or ``bzip2`` gives: it cannot be entered in the middle) and as a
multistream ``.xml.bz2`` (100 pages per stream, as Wikipedia publishes it). Then runs the corpus stage
(read, strip markup, clean, encode, merge) in fresh processes with 1 and 2 workers on each, the fastest
of ``--repeat`` runs, and prints wall time, throughput, chunks and the speed-up over one stream and one
worker. The token files of all four runs must be identical (checked). Work files: benchmarks/.work/tokenize.
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import html
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tokenize import WORK, run_stages, stage, train_tokenizer  # noqa: E402


def build_dumps(size_mb: int) -> tuple[Path, Path]:
    """``(single-stream, multistream)`` dumps of the same pages."""
    single, multi = WORK / f"wiki_{size_mb}MB.single.xml.bz2", WORK / f"wiki_{size_mb}MB.multistream.xml.bz2"
    if single.exists() and multi.exists():
        return single, multi
    from train_deploy.corpus.people_daily import strip_pos_tags
    from train_deploy.corpus.readers import people_daily_path

    lines = [line for line in strip_pos_tags(people_daily_path().read_text(encoding="utf-8").splitlines()) if line]
    head = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="zh">\n'
            "  <siteinfo><sitename>维基百科</sitename></siteinfo>\n")
    pages, size, i = [], 0, 0
    while size < size_mb * 1e6:
        body = lines[(20 * i) % (len(lines) - 20):][:20]
        text = (f"#REDIRECT [[页面{i - 1}]]" if i % 10 == 9 else
                "{{Infobox 新闻|日期=1998年1月}}'''" + body[0] + "'''\n== 正文 ==\n"
                + "\n".join(f"[[人民日报|{line[:4]}]]{line[4:]}" for line in body[1:]))
        page = (f"  <page>\n    <title>页面{i}</title>\n    <ns>0</ns>\n    <id>{i}</id>\n    <revision><id>{i}</id>"
                f'<text xml:space="preserve">{html.escape(text, quote=False)}</text></revision>\n  </page>\n')
        pages.append(page)
        size += len(page.encode())
        i += 1
    foot = "</mediawiki>\n"
    WORK.mkdir(parents=True, exist_ok=True)
    single.write_bytes(bz2.compress((head + "".join(pages) + foot).encode()))
    streams = [head] + ["".join(pages[j : j + 100]) for j in range(0, len(pages), 100)] + [foot]
    multi.write_bytes(b"".join(bz2.compress(s.encode()) for s in streams))
    return single, multi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=100, help="MB of page XML")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is kept")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tokenizer = train_tokenizer()
    dumps = build_dumps(args.size)
    rows, outputs = [], set()
    for dump in dumps:
        runs = run_stages(dump, (1, 2), tokenizer, args.repeat)
        for workers in (1, 2):
            r = min(runs[workers], key=lambda r: r["wall"])  # the least disturbed run
            rows.append((dump, workers, r))
            out = WORK / f"check_{dump.stem}_{workers}"  # token files compared across the four runs
            stage(dump, workers, tokenizer, keep=out)
            outputs.add(_token_digest(out))
            shutil.rmtree(out)
    base = rows[0][2]["wall"]
    out = sys.stdout.write
    out("\n| dump | MB on disk | workers | chunks | tokens | wall s | M tokens/s | speed-up |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for dump, workers, r in rows:
        form = "multistream" if "multistream" in dump.name else "one bz2 stream"
        out(f"| {form} | {dump.stat().st_size / 1e6:.1f} | {workers} | {r['chunks']} | {r['tokens']:,} | "
            f"{r['wall']:.2f} | {r['tokens'] / r['wall'] / 1e6:.2f} | {base / r['wall']:.2f}× |\n")
    out(f"\ntoken files identical across the four runs: {len(outputs) == 1}\n")


def _token_digest(folder: Path) -> str:
    digest = hashlib.blake2b()
    for path in sorted(folder.glob("*.bin")) + sorted(folder.glob("*.idx")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":
    main()
