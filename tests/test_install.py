"""The venv flavours: `make` builds a CPU or a GPU venv, keeps the one it built, and refuses mixed Paddle wheels.

These run the real Makefile, mostly as dry runs (`make -n`) against temporary venv folders, so make's own
decisions (which lock, which index, whether to reinstall at all) are what is checked; nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers.project import REPO

PADDLE_INDEX = "https://www.paddlepaddle.org.cn/packages/stable/{}/"
CHECK = [sys.executable, str(REPO / "tools" / "check_paddle_wheel.py")]


def _make(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`make` with ``args``, free of what an enclosing `make test DEVICE=…` would pass down to it."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "DEVICE", "CUDA", "VENV"}}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _dry_run(*args: str) -> str:
    result = _make("-n", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _built_venv(venv: Path, *flavour: str, stamp_age: float = 0.0) -> Path:
    """A venv folder as the Makefile's install recipe leaves it for ``flavour`` (e.g. DEVICE=gpu): its flavour
    record written by the recipe's own line, and a stamp ``stamp_age`` seconds old."""
    venv.mkdir(parents=True, exist_ok=True)
    if flavour:
        recipe = _dry_run(f"VENV={venv}", *flavour, "venv").splitlines()
        record = next(line for line in recipe if line.startswith("printf 'VENV_DEVICE"))
        subprocess.run(["bash", "-c", record], check=True)
    stamp = venv / ".installed"
    stamp.touch()
    then = time.time() - stamp_age
    os.utime(stamp, (then, then))
    return venv


def _installs(dry_run: str) -> list[str]:
    return [line for line in dry_run.splitlines() if " -m pip install" in line and " -r " in line]


# The two locks ------------------------------------------------------------------------------------------

def _pins(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_gpu_lock_is_the_cpu_lock_with_the_gpu_wheel_in_place_of_the_cpu_one():
    cpu, gpu = _pins(REPO / "requirements.lock"), _pins(REPO / "requirements-gpu.lock")
    assert len(cpu) == len(gpu)
    different = [(c, g) for c, g in zip(cpu, gpu, strict=True) if c != g]
    assert different == [("paddlepaddle==3.3.1", "paddlepaddle-gpu==3.3.1")]
    assert "paddlepaddle==3.3.1" in (REPO / "requirements.in").read_text().splitlines()


def test_make_writes_the_committed_gpu_lock(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path)
    shutil.copy(REPO / "requirements.lock", tmp_path)
    result = _make("requirements-gpu.lock", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "requirements-gpu.lock").read_text() == (REPO / "requirements-gpu.lock").read_text()


def test_make_refuses_a_cpu_lock_without_the_paddle_pin(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path)
    (tmp_path / "requirements.lock").write_text("numpy==1.26.4\n")
    result = _make("requirements-gpu.lock", cwd=tmp_path)
    assert result.returncode != 0
    assert "requirements.lock pins no paddlepaddle==" in result.stderr
    assert not (tmp_path / "requirements-gpu.lock").exists()



def test_locks_pin_the_build_backend_pyproject_asks_for_and_make_lock_keeps_it():
    """`python -m build --no-isolation` (the offline `kedro package`, tests/test_run.py) builds with the venv's own
    setuptools and wheel: both locks pin them, satisfying [build-system], and `make lock` freezes them too (plain
    `pip freeze` leaves them out)."""
    build_system = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    requires = [Requirement(r) for r in build_system["requires"]]
    assert [r.name for r in requires] == ["setuptools"]
    for lock in ("requirements.lock", "requirements-gpu.lock"):
        pins = dict(line.split("==") for line in _pins(REPO / lock))
        assert requires[0].specifier.contains(pins["setuptools"]) and "wheel" in pins, lock
    wanted = (REPO / "requirements.in").read_text().splitlines()
    assert {f"setuptools=={pins['setuptools']}", f"wheel=={pins['wheel']}"} <= set(wanted)
    assert "pip freeze --all --exclude-editable" in _dry_run("lock")

# Building a flavour -------------------------------------------------------------------------------------

def test_gpu_build_removes_the_cpu_wheel_and_installs_the_gpu_lock_from_the_cuda_index(tmp_path):
    dry_run = _dry_run(f"VENV={tmp_path / 'venv'}", "DEVICE=gpu", "CUDA=cu129", "venv")
    assert _installs(dry_run) == [
        f"{tmp_path}/venv/bin/python -m pip install --quiet --disable-pip-version-check "
        f"-r requirements-gpu.lock --extra-index-url {PADDLE_INDEX.format('cu129')}"]
    uninstall = next(line for line in dry_run.splitlines() if "pip uninstall" in line)
    assert uninstall.split("--yes")[1].split(";")[0].split() == ["paddlepaddle", "paddlepaddle-gpu"]
    assert "pip show --quiet paddlepaddle 2>" in dry_run  # only when the CPU wheel is there
    assert "check_paddle_wheel.py --device gpu" in dry_run


def test_default_build_is_the_cpu_lock_from_the_default_index(tmp_path):
    dry_run = _dry_run(f"VENV={tmp_path / 'venv'}", "venv")
    assert _installs(dry_run) == [
        f"{tmp_path}/venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.lock "]
    assert "paddlepaddle.org.cn" not in dry_run
    assert "pip show --quiet paddlepaddle-gpu 2>" in dry_run
    assert "check_paddle_wheel.py --device cpu" in dry_run


@pytest.mark.parametrize(("device", "cuda", "message"), [
    ("cuda", "cu126", "DEVICE=cuda: DEVICE takes cpu or gpu"),
    ("gpu", "cu124", "CUDA=cu124: Paddle 3.3's GPU wheel is built for CUDA=cu118 cu126 cu129 cu130"),
])
def test_make_refuses_an_unknown_device_or_cuda_build_in_one_line(tmp_path, device, cuda, message):
    result = _make("-n", f"VENV={tmp_path / 'venv'}", f"DEVICE={device}", f"CUDA={cuda}", "test")
    assert result.returncode != 0
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# A built venv keeps its flavour -------------------------------------------------------------------------

def test_outdated_gpu_venv_reinstalls_the_gpu_lock_not_the_cpu_one(tmp_path):
    venv = _built_venv(tmp_path / "venv", "DEVICE=gpu", "CUDA=cu129", stamp_age=10 * 365 * 86400)
    dry_run = _dry_run(f"VENV={venv}", "test")  # the stamp is older than every lock: a reinstall
    assert _installs(dry_run) == [
        f"{venv}/bin/python -m pip install --quiet --disable-pip-version-check "
        f"-r requirements-gpu.lock --extra-index-url {PADDLE_INDEX.format('cu129')}"]
    assert dry_run.splitlines()[-2:] == [f"{venv}/bin/python tools/check_paddle_wheel.py --device gpu",
                                         f"{venv}/bin/python -m pytest -n 2 --dist loadfile"]


@pytest.mark.parametrize("flavour", [("DEVICE=gpu", "CUDA=cu118"), ("DEVICE=cpu",), ()],
                         ids=["gpu", "cpu", "cpu-venv-from-before-the-record"])
def test_up_to_date_venv_of_either_flavour_runs_the_tests_without_installing(tmp_path, flavour):
    venv = _built_venv(tmp_path / "venv", *flavour)
    device = "gpu" if "DEVICE=gpu" in flavour else "cpu"
    assert _dry_run(f"VENV={venv}", "test").splitlines() == [
        f"{venv}/bin/python tools/check_paddle_wheel.py --device {device}",
        f"{venv}/bin/python -m pytest -n 2 --dist loadfile"]


@pytest.mark.parametrize(("built", "asked", "lock"), [
    (("DEVICE=cpu",), ("DEVICE=gpu",), "requirements-gpu.lock"),
    (("DEVICE=gpu",), ("DEVICE=gpu", "CUDA=cu129"), "requirements-gpu.lock"),
    (("DEVICE=gpu",), ("DEVICE=cpu",), "requirements.lock"),
], ids=["cpu-to-gpu", "other-cuda", "gpu-to-cpu"])
def test_asking_for_another_flavour_reinstalls_an_up_to_date_venv(tmp_path, built, asked, lock):
    venv = _built_venv(tmp_path / "venv", *built)
    dry_run = _dry_run(f"VENV={venv}", *asked, "venv")
    assert [line.split(" -r ")[1].split()[0] for line in _installs(dry_run)] == [lock]
    assert f"rm -f {venv}/.installed" in dry_run


# Two Paddle wheels in one venv --------------------------------------------------------------------------

def _install_fake_wheel(site_packages: Path, name: str, version: str = "3.3.1") -> None:
    """What pip leaves of a wheel that importlib.metadata reads: its dist-info folder."""
    info = site_packages / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize(("device", "wheels", "message"), [
    ("gpu", ["paddlepaddle", "paddlepaddle-gpu"],
     "paddlepaddle 3.3.1 and paddlepaddle-gpu 3.3.1 are both installed in {site}: they overwrite each other's "
     "paddle/ package; keep one with `make -B venv DEVICE=gpu` (or DEVICE=cpu)"),
    ("cpu", ["paddlepaddle-gpu"],
     "paddlepaddle-gpu 3.3.1 is installed in {site}, which make built as DEVICE=cpu: keep it with "
     "`make venv DEVICE=gpu`, or replace it with `make -B venv DEVICE=cpu`"),
    ("gpu", [], "no Paddle wheel is installed in {site}: reinstall it with `make -B venv DEVICE=gpu`"),
])
def test_wheel_check_refuses_a_wrong_or_mixed_venv_in_one_line(tmp_path, device, wheels, message):
    site = tmp_path / "site-packages"
    site.mkdir()
    for wheel in wheels:
        _install_fake_wheel(site, wheel)
    result = subprocess.run([*CHECK, "--device", device, "--path", str(site)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr == message.format(site=site) + "\n"


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_wheel_check_passes_the_flavours_own_wheel(tmp_path, device):
    site = tmp_path / "site-packages"
    _install_fake_wheel(site, {"cpu": "paddlepaddle", "gpu": "paddlepaddle-gpu"}[device])
    _install_fake_wheel(site, "paddlenlp", "3.0.0b4")
    result = subprocess.run([*CHECK, "--device", device, "--path", str(site)], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (0, "")


def test_make_test_stops_before_pytest_in_a_venv_holding_both_wheels(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    _install_fake_wheel(Path(site), "paddlepaddle")
    _install_fake_wheel(Path(site), "paddlepaddle-gpu")  # pip-installed by hand over the CPU venv
    _built_venv(venv, "DEVICE=cpu")
    result = _make(f"VENV={venv}", "test")
    assert result.returncode != 0
    assert "paddlepaddle 3.3.1 and paddlepaddle-gpu 3.3.1 are both installed in" in result.stderr
    assert "pytest" not in result.stdout
