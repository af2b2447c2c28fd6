"""How fast each engine runs a bundle on this host: measured where the model is served, not where it was exported.

The figures the export recorded (``latency.json``) were measured on the export's machine, under whatever load it
had then; the serving host may be another machine. So the first time a bundle is loaded here with no engine pinned
(``engines.choose_engine``), :func:`host_figures` times every candidate the host can run (the fused and portable
Paddle Inference graphs, ONNX Runtime fp32) on a short greedy generation, in one child process
(``sys.executable -c``, under ``TRAIN_DEPLOY_PROBE_LAUNCHER`` as the kernel probe is): after a warm-up, repeated
generations of up to :data:`NEW_TOKENS` tokens for about :data:`BUDGET_S` seconds each, the figure being the median
milliseconds per generated token (prefill included; the end of document is never picked, so every run generates
as many tokens). A child keeps a crash or a stray thread pool out of the serving process.

The figures are kept in ``engine_speed.json`` in :func:`train_deploy.cache.cache_dir` (written atomically), filed
under the CPU's model name, a digest of its flags (:func:`train_deploy.environment.cpu_identity`), the Paddle and
ONNX Runtime wheels' versions, the launcher, the candidates and a digest of the bundle's ``bundle.json`` (which
records every file's hash), so a second load reads them and a changed bundle, wheel or CPU is measured again.
A child that fails or times out keeps nothing and the export's figures decide this time.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from train_deploy.atomic import write_json
from train_deploy.cache import cache_dir
from train_deploy.environment import cpu_identity, this_cpu
from train_deploy.export.probe import paddle_version
from train_deploy.handoffs import BUNDLE_FILE
from train_deploy.hashing import digest

logger = logging.getLogger(__name__)

CACHE_FILE = "engine_speed.json"
BUDGET_S = 0.5
"""Seconds each candidate is timed for after its warm-up (three candidates: about a second and a half)."""
NEW_TOKENS = 32
"""New tokens per timed generation (fewer when the bundle's context is shorter)."""
PROMPT = "中国"
TIMEOUT_S = 300.0
"""Seconds the child may take (importing Paddle and loading each engine take most of it; longer under qemu)."""
LOADS = {"paddle_inference": ("paddle", "on"), "paddle_portable": ("paddle", "off"), "onnx_fp32": ("onnx", "off")}
"""How the child loads each form: ``LanguageModel.load``'s backend and ``TRAIN_DEPLOY_FUSED_KERNELS`` (the fused
graph is a candidate only where the probe passed, so ``on`` skips probing it again)."""
_CHILD = """import json, os, statistics, sys, time
import numpy as np
from train_deploy.export.runtime import LanguageModel
spec = json.loads(sys.argv[1])
for form, (backend, fused) in spec["forms"].items():
    os.environ["TRAIN_DEPLOY_FUSED_KERNELS"] = fused
    model = LanguageModel.load(spec["bundle"], backend)
    if model.engine != form:
        raise SystemExit(f"{form}: loaded {model.engine} instead")
    ids = [model.eos_id, *model.tokenizer.encode([model.normalize(spec["prompt"])])[0]][: model.context - 1]
    new = max(1, min(spec["new_tokens"], model.context - len(ids)))
    def pick(sequence, logits):
        logits[model.eos_id] = -np.inf  # never the end of document: every run generates `new` tokens
        return int(np.argmax(logits))
    def run(count):
        start = time.perf_counter()
        assert sum(1 for _ in model.stream_ids([ids], count, pick)) == count
        return (time.perf_counter() - start) * 1000 / count
    run(min(new, 4))
    times, end = [], time.perf_counter() + spec["budget_s"]
    while len(times) < 3 or time.perf_counter() < end:
        times.append(run(new))
    print("figure", json.dumps([form, statistics.median(times), len(times), new]), flush=True)
"""


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


def host_figures(folder: Path, forms: list[str]) -> HostSpeed | None:
    """This host's figures of ``forms`` (names of :data:`LOADS`) for the bundle in ``folder``: from the cache, else
    measured now and cached (module docstring); None when the measurement failed (logged as a warning)."""
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
    figures = measure_forms(folder, forms, launcher)
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
    return speed


def measure_forms(folder: Path, forms: list[str], launcher: list[str]) -> dict[str, float] | None:
    """Time ``forms`` on the bundle in ``folder`` in one child process (module docstring): milliseconds per
    generated token by form, or None (with a one-line warning) when the child fails or times out."""
    spec = {"bundle": str(folder), "forms": {form: LOADS[form] for form in forms}, "prompt": PROMPT,
            "new_tokens": NEW_TOKENS, "budget_s": BUDGET_S}
    command = [*launcher, sys.executable, "-c", _CHILD, json.dumps(spec)]
    env = {**os.environ, "GLOG_minloglevel": "3", "PYTHONWARNINGS": "ignore"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False)
    except (subprocess.TimeoutExpired, OSError) as exc:
        failure = f"timed out after {TIMEOUT_S:.0f} s" if isinstance(exc, subprocess.TimeoutExpired) else \
            f"could not start ({exc.strerror or exc})"
        logger.warning("Engine speed not measured on this host: the child %s; the export's figures decide", failure)
        return None
    figures = {}
    for line in done.stdout.splitlines():
        if line.startswith("figure "):
            form, ms, _, _ = json.loads(line.removeprefix("figure "))
            figures[form] = float(ms)
    if done.returncode != 0 or set(figures) != set(forms):
        last = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
        logger.warning("Engine speed not measured on this host: the child exited %d (%s); the export's figures "
                       "decide", done.returncode, last[:200])
        return None
    return {form: figures[form] for form in forms}


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
