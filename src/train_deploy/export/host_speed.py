"""How fast each engine runs a bundle on this host: measured where the model is served, not where it was exported.

The figures the export recorded (``latency.json``) were measured on the export's machine, under whatever load it
had then; the serving host may be another machine. So the first time a bundle is loaded here with no engine pinned
(``engines.choose_engine``), :func:`host_figures` times every candidate the host can run (the fused and portable
Paddle Inference graphs, ONNX Runtime fp32) on a short greedy generation, in this process: each engine is opened
(``backends.py``), warmed up, then generations of up to :data:`NEW_TOKENS` tokens from the start of a document
(prefill included; the end of document is never picked, so every run generates as many tokens) repeat, at least
:data:`ROUNDS` times and until :data:`BUDGET_S` seconds have passed. The figure is the median milliseconds per
generated token. One engine at a time, each released before the next is opened, as serving holds one: timed in
turns, ONNX Runtime's threads, which spin for a while after each run, took the cores from Paddle's next run and
made it look about 5 times slower. The chosen engine is opened again by the load (a few tenths of a second).

In-process, not in a child: a child paid for importing Paddle again and opening every engine a second time, about
3 s per new bundle with two candidates on a 2-core CPU without AVX-512 (and more under load), in every first load
of every bundle, the test suite's end-to-end runs included. The candidates are only engines this host can run (the
fused graph only where the kernel probe's child passed, ``probe.py``), so no SIGILL can reach this process; an
engine that fails to open or run ends the timing with one warning and the export's figures decide.

Measured with the tests' tiny bundle (2 layers, hidden size 64, context 128; the portable graph and ONNX Runtime)
on this shared 2-core CPU without AVX-512: the child took 2.7-3.1 s, timing in-process takes 0.56-0.64 s (Paddle
and ONNX Runtime already imported, as in the test suite's processes); on the emulated CPU of ``test_emulated.py``
(``qemu-x86_64 -cpu max``) 7.2 s where the child under qemu took 45.7 s (started from a native process; from an
emulated one it ran under qemu twice over). No default-sized bundle was at hand; its engines open in about the same
time and each of its tokens costs more, so a candidate costs its opening, the warm-up and about :data:`BUDGET_S`
seconds (:data:`ROUNDS` generations when those take longer).

The figures are kept in ``engine_speed.json`` in :func:`train_deploy.cache.cache_dir` (written atomically), filed
under the CPU's model name, a digest of its flags (:func:`train_deploy.environment.cpu_identity`), the Paddle and
ONNX Runtime wheels' versions, the launcher (``TRAIN_DEPLOY_PROBE_LAUNCHER``: a process run under ``qemu-x86_64``
sees the host's ``/proc/cpuinfo``, so the emulated CPU is told apart by it, as in the kernel probe's cache), the
candidates and a digest of the bundle's ``bundle.json`` (which records every file's hash), so a second load reads
them and a changed bundle, wheel or CPU is measured again. A failed timing keeps nothing.
"""

from __future__ import annotations

import datetime as dt
import gc
import importlib.metadata
import json
import logging
import os
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from train_deploy.atomic import write_json
from train_deploy.cache import cache_dir
from train_deploy.environment import cpu_identity, this_cpu
from train_deploy.export.backends import OnnxRuntimeBackend, PaddleInferenceBackend
from train_deploy.export.config import ServerConfig
from train_deploy.export.edge import ONNX_FILE
from train_deploy.export.graph import SERVER_MODEL
from train_deploy.export.probe import paddle_version
from train_deploy.handoffs import BUNDLE_FILE, BundleMeta
from train_deploy.hashing import digest

logger = logging.getLogger(__name__)

CACHE_FILE = "engine_speed.json"
BUDGET_S = 0.15
"""Seconds of timed generations per candidate, after its warm-up."""
ROUNDS = 3
"""Timed generations per candidate at least, however long they take (an emulated CPU is slow)."""
NEW_TOKENS = 16
"""New tokens per timed generation (fewer when the bundle's context is shorter)."""


@dataclass(frozen=True, slots=True)
class HostSpeed:
    """Milliseconds per generated token of each form on this host, and where the figures came from."""

    ms_per_token: dict[str, float]
    source: Literal["measured", "cache"]
    measured_at: str

    def describe(self) -> str:
        """One line naming each figure (for the engine's choice and the log)."""
        figures = ", ".join(f"{form} {ms:.3g} ms/token" for form, ms in self.ms_per_token.items())
        when = "now" if self.source == "measured" else f"at {self.measured_at}, cached"
        return f"{figures}; measured on this host {when}"


def host_figures(folder: Path, meta: BundleMeta, candidates: dict[str, str | None]) -> HostSpeed | None:
    """This host's figures of ``candidates`` (each form's Paddle Inference graph folder, None for ONNX Runtime
    fp32) for the bundle in ``folder``: from the cache, else measured now and cached (module docstring); None when
    the measurement failed (logged as a warning)."""
    forms = list(candidates)
    launcher = shlex.split(os.environ.get("TRAIN_DEPLOY_PROBE_LAUNCHER", ""))
    model, flags = cpu_identity(this_cpu())
    bundle = digest((Path(folder) / BUNDLE_FILE).read_text(encoding="utf-8"))
    wheels = [paddle_version(), _version("onnxruntime")]
    key = digest([model, flags, wheels, launcher, sorted(forms), bundle], size=8)
    path = cache_dir() / CACHE_FILE
    entries = _read_cache(path)
    if key in entries and set(entries[key]["ms_per_token"]) == set(forms):
        entry = entries[key]
        speed = HostSpeed({form: float(entry["ms_per_token"][form]) for form in forms}, "cache",
                          str(entry.get("measured_at")))
        logger.info("Engine speed of %s from the cache: %s", folder, speed.describe())
        return speed
    start = time.perf_counter()
    figures = measure_forms(folder, meta, candidates)
    if figures is None:
        return None
    speed = HostSpeed(figures, "measured", dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    entries[key] = {"cpu": model, "flags_digest": flags, "wheels": wheels, "launcher": launcher, "bundle": bundle,
                    "ms_per_token": figures, "measured_at": speed.measured_at}
    try:
        write_json(path, entries)
    except OSError as exc:  # an unwritable cache only costs the next load a measurement
        logger.debug("engine speed not cached in %s: %s", path, exc)
    logger.info("Engine speed of %s on this host (%s): %s", folder, model, speed.describe())
    logger.debug("engine speed of %s timed in %.2f s", folder, time.perf_counter() - start)
    return speed


def measure_forms(folder: Path, meta: BundleMeta, candidates: dict[str, str | None]) -> dict[str, float] | None:
    """Time ``candidates`` on the bundle in ``folder`` in this process, one after the other (module docstring):
    milliseconds per generated token by form, or None (with a one-line warning) when an engine fails to open or
    run."""
    figures = {}
    for form, graph in candidates.items():
        try:
            figures[form] = _timed(_open(Path(folder), meta, graph), meta)
        except Exception as exc:  # any engine's failure (Paddle's, ONNX Runtime's own errors) means no figures
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            logger.warning("Engine speed not measured on this host: %s failed (%s: %s); the export's figures "
                           "decide", form, type(exc).__name__, first)
            return None
        finally:
            gc.collect()  # the engine is released now: the load opens the chosen one again
    return figures


def _open(folder: Path, meta: BundleMeta, graph: str | None) -> Any:
    """The engine of one candidate, opened as ``LanguageModel.load`` opens it with the bundle's settings."""
    if graph is None:
        return OnnxRuntimeBackend(folder / "edge" / ONNX_FILE, int(meta.edge["threads"]))
    return PaddleInferenceBackend(folder / graph / SERVER_MODEL, ServerConfig(**meta.server), meta.model.context)


def _timed(engine: Any, meta: BundleMeta) -> float:
    """The engine's median milliseconds per generated token (module docstring)."""
    new = max(1, min(NEW_TOKENS, meta.model.context - 1))
    _generate(engine, meta.model.eos_id, min(new, 4))  # warm-up: first runs allocate and plan
    times: list[float] = []
    end = time.perf_counter() + BUDGET_S
    while len(times) < ROUNDS or time.perf_counter() < end:
        start = time.perf_counter()
        _generate(engine, meta.model.eos_id, new)
        times.append((time.perf_counter() - start) * 1000 / new)
    return statistics.median(times)


def _generate(engine: Any, eos_id: int, count: int) -> None:
    """``count`` greedy tokens from the start of a document with the KV cache, as ``LanguageModel.stream_ids``
    decodes: a prefill, then one decode step per further token; the end of document is never picked."""
    mask = np.ones((1, 1), np.int64)
    step, cache = engine.prefill(np.full((1, 1), eos_id, np.int64), mask), engine.new_cache()
    cache.join(mask, step, [0])
    logits = step.logits
    for _ in range(count - 1):
        last = np.array(logits[0, -1], dtype=np.float32)
        last[eos_id] = -np.inf
        logits = cache.decode(np.array([[int(np.argmax(last))]], np.int64))


def _version(distribution: str) -> str:
    try:
        return f"{distribution}=={importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{distribution} not installed"


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        return {key: value for key, value in entries.items()
                if isinstance(value, dict) and isinstance(value.get("ms_per_token"), dict)}
    except (OSError, ValueError, AttributeError):
        return {}
