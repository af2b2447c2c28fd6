"""Only for the optional C kernels of the corpus stage; everything else is in pyproject.toml.

The extension is optional: where no C compiler is available the build goes on without it and the
corpus stage uses its numpy versions (same output, slower).

It is built for the architecture's baseline (x86-64: SSE2, no AVX), whatever ``CFLAGS`` asks for: the logged
MLflow model carries the package's files, this library included, to machines other than the one that built it, and
an instruction the serving CPU lacks kills the process (SIGILL). A ``-march`` given here comes after ``CFLAGS``'s,
so it wins over a ``-march=native``. tests/test_setup.py builds it with ``CFLAGS=-march=native`` and disassembles it.
"""

import platform

from setuptools import Extension, setup

BASELINE = {"x86_64": ["-march=x86-64", "-mtune=generic"], "amd64": ["-march=x86-64", "-mtune=generic"],
            "aarch64": ["-march=armv8-a"]}.get(platform.machine().lower(), [])

setup(ext_modules=[Extension("train_deploy.corpus._fast", ["src/train_deploy/corpus/_fast.c"], optional=True,
                             extra_compile_args=["-O2", *BASELINE])])
