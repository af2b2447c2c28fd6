"""On an emulated CPU without AVX-512 (``qemu-x86_64 -cpu max``: AVX2, no AVX-512), where Paddle 3.3.1's CPU
``fused_rms_norm`` dies of SIGILL: the real kernel's probe says so in one line, and a bundle exported here with
the fused graph loads, generates and scores there as it does here, and unpinned takes the faster of the engines
it runs by figures timed there (``host_speed.py``, in the emulated process: a few seconds). On an AVX-512 machine
these are the only tests that see such a CPU. One emulated probe child (~20-40 s) and one emulated process
(~1-2 min)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.export import as_older_bundle, fused_here
from train_deploy.environment import cpu_identity, this_cpu
from train_deploy.export import LanguageModel, host_speed, probe
from train_deploy.export.runtime import BundleError

pytestmark = [pytest.mark.emulated, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-x86_64 (qemu-user)")]

QEMU = "qemu-x86_64 -cpu max"
TEXTS = ["今天天气很好，我们去公园散步。", "中国人民"]
SCRIPT = """import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from train_deploy.export import LanguageModel
out = {}
for backend in ("paddle", None):
    model = LanguageModel.load(sys.argv[1], backend)
    out[str(backend)] = {"engine": model.engine, "greedy": model.generate("中国", max_new_tokens=12, temperature=0),
                         "log_probs": [score.log_probs for score in model.score(json.loads(sys.argv[2]))]}
print(json.dumps(out))
"""


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def emulated_probe(tmp_path_factory):
    """The real probe with its child on the emulated CPU, in a cache of its own: (verdict, warnings logged, the
    environment that finds that verdict in the cache: the cache folder and the launcher)."""
    env = {"TRAIN_DEPLOY_CACHE_DIR": str(tmp_path_factory.mktemp("probe_cache")),
           "TRAIN_DEPLOY_PROBE_LAUNCHER": QEMU}
    lines = _Lines()
    logging.getLogger("train_deploy.export.probe").addHandler(lines)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.delenv("TRAIN_DEPLOY_FUSED_KERNELS", raising=False)
        probe._verdict.cache_clear()
        start = time.perf_counter()
        verdict = probe.fused_kernels()
        seconds = time.perf_counter() - start
        probe._verdict.cache_clear()
    logging.getLogger("train_deploy.export.probe").removeHandler(lines)
    logging.getLogger(__name__).info("emulated probe: %.0f s", seconds)
    return verdict, lines.lines, env


def test_the_real_fused_rms_norm_dies_of_sigill_in_the_probe_and_becomes_one_line(emulated_probe):
    verdict, lines, _ = emulated_probe
    model = cpu_identity(this_cpu())[0]  # qemu-user shows the host's /proc/cpuinfo: the probe does not trust it
    assert verdict.kernels == {"swiglu": "ok", "fused_rms_norm": "SIGILL"} and not verdict.runs
    assert verdict.reason == f"fused_rms_norm crashed with SIGILL in a probe on this CPU ({model})"
    assert lines == [f"{verdict.reason}: using the portable graph"]


def test_a_bundle_with_the_fused_graph_serves_on_the_emulated_cpu_as_here(emulated_probe, tiny_bundle):
    if not fused_here():
        pytest.skip("this CPU cannot run the fused kernels itself: its bundles ship the portable graph alone")
    _, _, env = emulated_probe
    start = time.perf_counter()
    done = subprocess.run([*QEMU.split(), sys.executable, "-c", SCRIPT, str(tiny_bundle), json.dumps(TEXTS)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, **env}, check=False)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, f"{done.returncode}: {done.stderr[-2000:]}"
    there = json.loads(done.stdout.strip().splitlines()[-1])
    # the probe's verdict came from the cache (no second emulated child), the portable graph was taken
    assert done.stderr.count("in a probe on this CPU (") and done.stderr.count(": using the portable graph") == 1
    assert f"Loaded {tiny_bundle}: Paddle Inference, portable graph (server_portable/; not server/: " in done.stderr
    # unpinned, the engines it runs (not the fused graph) were timed there, in that process, and the fastest taken
    (entry,) = json.loads((Path(env["TRAIN_DEPLOY_CACHE_DIR"]) / host_speed.CACHE_FILE).read_text()).values()
    figures = entry["ms_per_token"]
    assert list(figures) == ["paddle_portable", "onnx_fp32"] and entry["launcher"] == QEMU.split()
    assert there["paddle"]["engine"] == "paddle_portable" and there["None"]["engine"] == min(figures, key=figures.get)
    assert f"Engine speed of {tiny_bundle} on this host (" in done.stderr
    assert "the fastest this host runs by its own figures (paddle_portable " in done.stderr
    here = LanguageModel.load(tiny_bundle, "paddle")  # this CPU: the fused graph
    assert here.engine == "paddle_inference"
    greedy = here.generate("中国", max_new_tokens=12, temperature=0)
    for result in there.values():
        assert result["greedy"] == greedy and len(greedy) > 0
        for theirs, ours in zip(result["log_probs"], here.score(TEXTS), strict=True):
            np.testing.assert_allclose(theirs, ours.log_probs, atol=1e-4)
    logging.getLogger(__name__).info("emulated load, generate and score: %.0f s", seconds)


def test_a_format_7_bundle_is_refused_in_one_line_by_the_real_probes_verdict(emulated_probe, tiny_bundle, tmp_path,
                                                                            monkeypatch):
    _, _, env = emulated_probe
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    old = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, old, ignore=shutil.ignore_patterns("server_portable"))
    as_older_bundle(old, 7)
    probe._verdict.cache_clear()
    try:
        with pytest.raises(BundleError) as refused:
            LanguageModel.load(old, backend="paddle")
    finally:
        probe._verdict.cache_clear()
    assert str(refused.value) == (f"{old}/bundle.json: format 7 bundle has only the fused server graph, which this "
                                  "CPU cannot run (probe: fused_rms_norm: SIGILL); re-export it with kedro run "
                                  "--pipelines export")
