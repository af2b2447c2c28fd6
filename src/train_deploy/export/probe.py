"""Which of Paddle's fused CPU kernels this machine can run: each is tried in a short-lived child process first.

Paddle 3.3.1's CPU wheel runs ``fused_rms_norm`` with AVX-512 instructions whatever the CPU (its
``RmsNormAvxKernel`` has no run-time dispatch): on a CPU without AVX-512 the process dies of SIGILL, with no
Python error to catch. So before a process runs the bundle's fused server graph (``server/``, ``graph.py``) on
CPU, :func:`fused_kernels` runs every kernel of :data:`KERNELS` on a tiny input in one child process
(``sys.executable -c``), which prints each kernel's name before and after running it: a child that dies names the
kernel it was in. A SIGILL there becomes a one-line reason, logged once per process, to use the portable graph
(``server_portable/``). The decision comes from the probe, never from a list of CPU names; on GPU the fused graph
runs Paddle's GPU kernels and nothing is probed.

The verdict is kept once per process and once per machine on disk (``kernel_probe.json`` in
:func:`train_deploy.cache.cache_dir`, written atomically), filed under the CPU's model name, a digest of its
flags (:func:`train_deploy.environment.cpu_identity`), the Paddle wheel's version and the launcher below. Only
definitive results are kept: every kernel ran, or one died of SIGILL. A timeout or another failure uses the
portable graph this time and probes again next time.

Environment:

- ``TRAIN_DEPLOY_FUSED_KERNELS``: ``probe`` (default); ``off`` never runs the fused graph on CPU; ``on`` trusts
  the CPU without a probe (a CPU that cannot run them then dies of SIGILL).
- ``TRAIN_DEPLOY_PROBE_LAUNCHER``: a command put before the child's Python, for a process that itself runs
  under a user-mode emulator (``qemu-x86_64 -cpu max``): such an emulator runs the programs its guest starts
  on the real CPU, so the child must be started under the emulator again to probe the emulated CPU.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from train_deploy.atomic import write_json
from train_deploy.cache import cache_dir
from train_deploy.environment import cpu_identity, this_cpu

logger = logging.getLogger(__name__)

KERNELS: dict[str, str] = {
    "swiglu": "paddle.nn.functional.swiglu(paddle.rand([2, 3, 512])).numpy()",
    "fused_rms_norm": "from paddle.incubate.nn.functional import fused_rms_norm\n"
                      "x, r, w = paddle.rand([2, 3, 256]), paddle.rand([2, 3, 256]), paddle.ones([256])\n"
                      "fused_rms_norm(x, w, None, 1e-6, 2, residual=r)[0].numpy()",
}
"""The fused CPU kernels of the server graph, each called as ``graph.py`` calls it (3-D input, the norm with a
residual), in the order the child runs them."""
CACHE_FILE = "kernel_probe.json"
TIMEOUT_S = 300.0
"""Seconds the child may take (importing Paddle takes most of it: ~5 s natively, ~40 s under qemu)."""
_CHILD = """import json, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file behind
import paddle
paddle.disable_signal_handler()  # Paddle's handler would catch the SIGILL (and hangs in it under qemu)
paddle.set_device("cpu")
for name, code in json.loads(sys.argv[1]).items():
    print("start", name, flush=True)
    exec(code)
    print("ok", name, flush=True)
"""
_CACHED_SIGNALS = {signal.SIGILL}  # a crash of the instruction set is the CPU's for good; others may pass


@dataclass(frozen=True, slots=True)
class KernelProbe:
    """Whether the fused server graph can run here, and why (one line, for logs, parity.json and the card)."""

    runs: bool
    reason: str
    source: Literal["device", "setting", "probe", "cache"]
    """What decided: the device (GPU), ``TRAIN_DEPLOY_FUSED_KERNELS``, a child process now, or the disk cache."""
    kernels: dict[str, str] = field(default_factory=dict)
    """Each kernel's outcome in the probe: ``ok``, ``SIGILL`` (or another signal), ``exit N``, ``timeout``,
    ``not run`` (a kernel before it failed)."""


def fused_kernels(device: str = "cpu", *, kernels: Mapping[str, str] = KERNELS) -> KernelProbe:
    """Can this process run the fused server graph on ``device`` (``cpu`` or ``gpu``)? Decided once per process
    (module docstring); a negative verdict is logged once, as a warning. ``kernels``: the snippets the child
    runs (:data:`KERNELS`; a test passes others, such as one whose process dies of a signal)."""
    setting = os.environ.get("TRAIN_DEPLOY_FUSED_KERNELS", "probe").strip().lower()
    launcher = os.environ.get("TRAIN_DEPLOY_PROBE_LAUNCHER", "")
    return _verdict(device, setting, launcher, str(cache_dir()), tuple(kernels.items()))


@functools.cache
def _verdict(device: str, setting: str, launcher: str, cache: str, kernels: tuple[tuple[str, str], ...]) -> KernelProbe:
    if device == "gpu":
        return KernelProbe(True, "GPU: the fused graph runs Paddle's GPU kernels", "device")
    if setting in ("on", "off"):
        verdict = KernelProbe(setting == "on", f"TRAIN_DEPLOY_FUSED_KERNELS={setting}", "setting")
    elif setting != "probe":
        raise ValueError(f"TRAIN_DEPLOY_FUSED_KERNELS: {setting!r} is not one of probe, on, off")
    else:
        verdict = _probed(dict(kernels), shlex.split(launcher), Path(cache) / CACHE_FILE)
    if not verdict.runs:
        logger.warning("%s: using the portable graph", verdict.reason)
    return verdict


def _probed(kernels: dict[str, str], launcher: list[str], path: Path) -> KernelProbe:
    """The cached verdict of this CPU, wheel, launcher and kernels, or a new probe's (kept when definitive)."""
    model, flags = cpu_identity(this_cpu())
    key = hashlib.blake2b(json.dumps([model, flags, paddle_version(), launcher, kernels]).encode(),
                          digest_size=8).hexdigest()
    entries = _read_cache(path)
    if key in entries:
        return judge(entries[key]["kernels"], model, "cache")
    outcomes = probe_kernels(kernels, launcher=launcher)
    verdict = judge(outcomes, model, "probe")
    if verdict.runs or any(outcome in {s.name for s in _CACHED_SIGNALS} for outcome in outcomes.values()):
        entries[key] = {"cpu": model, "flags_digest": flags, "paddle": paddle_version(), "launcher": launcher,
                        "kernels": outcomes, "probed_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        try:
            write_json(path, entries)
        except OSError as exc:  # an unwritable cache only costs the next process a probe
            logger.debug("kernel probe not cached in %s: %s", path, exc)
    return verdict


def judge(outcomes: Mapping[str, str], model: str, source: Literal["probe", "cache"]) -> KernelProbe:
    """The verdict of a probe's ``outcomes`` (:func:`probe_kernels`) on the CPU ``model``: the first kernel that
    did not run names the reason."""
    failed = [(name, outcome) for name, outcome in outcomes.items() if outcome != "ok"]
    if not failed:
        return KernelProbe(True, f"the fused CPU kernels ran in a probe on this CPU ({model})", source, dict(outcomes))
    name, outcome = failed[0]
    what = {"timeout": f"timed out after {TIMEOUT_S:.0f} s"}.get(outcome) or (
        f"crashed with {outcome}" if outcome.startswith("SIG") else f"failed ({outcome})")
    return KernelProbe(False, f"{name} {what} in a probe on this CPU ({model})", source, dict(outcomes))


def probe_kernels(kernels: Mapping[str, str], timeout: float | None = None,
                  launcher: Sequence[str] = ()) -> dict[str, str]:
    """Run each snippet of ``kernels`` (Python with ``paddle`` imported, by name, in order) in one child process
    started as ``[*launcher, sys.executable, "-c", …]`` (killed after ``timeout`` seconds, :data:`TIMEOUT_S` by
    default); return each one's outcome (:class:`KernelProbe`)."""
    command = [*launcher, sys.executable, "-c", _CHILD, json.dumps(dict(kernels))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_minloglevel": "3", "PYTHONWARNINGS": "ignore"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout or TIMEOUT_S, env=env,
                              check=False)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, code = _text(exc.stdout), "", None
    except OSError as exc:  # the launcher or the interpreter cannot be started
        return dict.fromkeys(kernels, f"not started: {exc.strerror or exc}")
    lines = stdout.splitlines()
    outcomes = {name: "ok" if f"ok {name}" in lines else "not run" for name in kernels}
    running = next((name for name in kernels if f"start {name}" in lines and outcomes[name] != "ok"), None)
    if running is None and code != 0:  # died or timed out before the first kernel (importing Paddle)
        running = next(iter(kernels))
    if running is not None:
        outcomes[running] = ("timeout" if code is None else _signal_name(-code) if code < 0
                             else f"exit {code}{_last_line(stderr)}")
    return outcomes


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(stderr: str) -> str:
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    return f": {lines[-1][:200]}" if lines else ""


def _read_cache(path: str) -> dict[str, dict]:
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file)
        return {key: value for key, value in entries.items()
                if isinstance(value, dict) and isinstance(value.get("kernels"), dict)}
    except (OSError, ValueError, AttributeError):
        return {}


def paddle_version() -> str:
    """The installed Paddle wheel's version (CPU or GPU build), without importing Paddle."""
    for name in ("paddlepaddle", "paddlepaddle-gpu"):
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "paddle not installed"
