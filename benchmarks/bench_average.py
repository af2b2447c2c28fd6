"""Checkpoint averaging throughput and memory against a plain sequential read, in one run.

    .venv/bin/python benchmarks/bench_average.py            # K = 2, 4, 8 checkpoints of ~500 MB
    .venv/bin/python benchmarks/bench_average.py --mb 100   # smaller checkpoints

Writes K synthetic float32 checkpoints shaped like a 10-layer Llama (hidden 1024, MLP 2816, plus an
int64 tensor), then for each K in a fresh process: (1) read every file sequentially in 16 MB blocks,
the limit; (2) average them with the averaging stage (which also hashes every input and fsyncs its
output). Each pair runs from disk ("cold": page cache dropped first, needs root) and from memory ("warm":
files already cached, where the "read" is a memory copy). Throughput is input MB / wall time, imports
excluded. Peak RSS is the process's own high-water mark (VmHWM). The files are removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

WORK = Path(__file__).resolve().parent / ".work" / "average"


def make_checkpoints(count: int, megabytes: int) -> list[Path]:
    import numpy as np
    from safetensors.numpy import save_file

    hidden, mlp = 1024, 2816
    per_layer = (4 * hidden * hidden + 3 * hidden * mlp) * 4
    layers = max(1, round(megabytes * 1e6 / per_layer))
    folders = []
    for step in range(1, count + 1):
        folder = WORK / "checkpoints" / f"step_{step:08d}"
        if not (folder / "state.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            rng = np.random.default_rng(step)
            tensors = {"counter": np.array([step], dtype=np.int64)}
            for i in range(layers):
                for name, shape in (("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)),
                                    ("o", (hidden, hidden)), ("gate", (hidden, mlp)), ("up", (hidden, mlp)),
                                    ("down", (mlp, hidden))):
                    tensors[f"layers.{i}.{name}.weight"] = rng.standard_normal(shape, dtype=np.float32)
            save_file(tensors, str(folder / "model.safetensors"))
            (folder / "state.json").write_text(json.dumps({"step": step, "model_config": {"layers": layers}}))
        folders.append(folder)
    return folders


def child(mode: str, paths: list[str]) -> dict:
    from train_deploy.atomic import atomic_folder
    from train_deploy.averaging.average import average_checkpoints
    from train_deploy.averaging.config import AveragingConfig
    from train_deploy.corpus.build import peak_rss_mb

    files = [Path(p) / "model.safetensors" for p in paths]
    size = sum(f.stat().st_size for f in files)
    # Every run writes a new output: deleting the previous one (a discard on this disk) is not timed.
    shutil.rmtree(WORK / "out", ignore_errors=True)
    os.sync()
    started = time.perf_counter()
    if mode == "read":
        for f in files:
            with open(f, "rb") as src:
                while src.read(1 << 24):
                    pass
    else:
        with atomic_folder(WORK / "out") as staging:  # staged and published as the catalog does
            average_checkpoints([Path(p) for p in paths], AveragingConfig(k=len(paths)), staging)
    wall = time.perf_counter() - started
    return {"mb": size / 1e6, "wall": wall, "rss_mb": peak_rss_mb()}


def drop_page_cache() -> bool:
    """Start from disk, not memory (needs root on Linux); False where that is not allowed."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_child(mode: str, paths: list[Path], cold: bool) -> dict:
    if cold and not drop_page_cache():
        raise SystemExit("cannot drop the page cache here (needs root); run with --warm-only")
    out = subprocess.run([sys.executable, __file__, "--child", mode, *map(str, paths)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=500, help="size of one checkpoint")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--warm-only", action="store_true", help="skip the cold-cache rows (no root)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1:])))  # noqa: T201
        return
    try:
        folders = make_checkpoints(max(args.ks), args.mb)
        model_mb = (folders[0] / "model.safetensors").stat().st_size / 1e6
        lines = [f"checkpoint size {model_mb:.0f} MB (float32)", "",
                 "| K | cache | input MB | sequential read MB/s | averaging MB/s | averaging / read | peak RSS MB | "
                 "RSS / one model |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for k in args.ks:
            chosen = folders[-k:]
            for cold in (False,) if args.warm_only else (True, False):
                read = run_child("read", chosen, cold)
                average = run_child("average", chosen, cold)
                read_rate, average_rate = read["mb"] / read["wall"], average["mb"] / average["wall"]
                lines.append(f"| {k} | {'cold' if cold else 'warm'} | {average['mb']:,.0f} | {read_rate:,.0f} | "
                             f"{average_rate:,.0f} | {average_rate / read_rate:.2f} | {average['rss_mb']:,.0f} | "
                             f"{average['rss_mb'] / model_mb:.2f} |")
        lines.append("")
        lines.append("targets: averaging ≥ 0.5 × read; peak RSS ≤ 1.5 × one float32 model at every K")
        sys.stdout.write("\n".join(lines) + "\n")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
