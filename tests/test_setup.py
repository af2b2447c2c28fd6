"""setup.py and pyproject: requires-python admits the Python the lock was tested with, and the corpus stage's C
extension is built for the architecture's baseline whatever CFLAGS asks for (the logged MLflow model carries it to
other machines, where an AVX instruction would kill the process with SIGILL)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers.project import REPO

# Instructions a baseline x86-64 CPU may lack: VEX/EVEX-encoded ones (AVX, AVX2, AVX-512: v-prefixed mnemonics,
# mask registers) and BMI/LZCNT/POPCNT.
NOT_BASELINE = re.compile(r"^(v\w+|k\w+|shlx|shrx|sarx|rorx|andn|bextr|blsr|blsi|blsmsk|bzhi|pdep|pext|tzcnt|lzcnt|"
                          r"popcnt)$")


def _instructions(library) -> set[str]:
    """The mnemonics in ``library``'s disassembly."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                             check=True).stdout
    fields = (line.split("\t") for line in listing.splitlines())
    return {parts[1].split()[0] for parts in fields if len(parts) > 1 and parts[1].strip()}


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None or shutil.which("cc") is None,
                    reason="x86-64 with a C compiler and objdump")
def test_the_c_extension_has_no_instruction_beyond_x86_64_even_with_march_native(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                    "--build-temp", str(tmp_path / "tmp")], cwd=REPO, check=True, capture_output=True,
                   env={**os.environ, "CFLAGS": "-march=native -O3"})
    (built,) = (tmp_path / "lib").rglob("_fast*.so")
    assert sorted(i for i in _instructions(built) if NOT_BASELINE.match(i)) == []
    for installed in (REPO / "src" / "train_deploy" / "corpus").glob("_fast*.so"):  # the one `make venv` built
        assert sorted(i for i in _instructions(installed) if NOT_BASELINE.match(i)) == []


def test_requires_python_admits_the_python_the_lock_was_installed_and_tested_with():
    import tomllib

    from packaging.specifiers import SpecifierSet

    allowed = SpecifierSet(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"])
    assert platform.python_version() in allowed
    assert "3.10.14" not in allowed  # onnxruntime 1.32, pandas and scipy of the lock need 3.11
