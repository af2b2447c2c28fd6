"""Only for the optional C kernels of the corpus stage; everything else is in pyproject.toml.

The extension is optional: where no C compiler is available the build goes on without it and the
corpus stage uses its numpy versions (same output, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("train_deploy.corpus._fast", ["src/train_deploy/corpus/_fast.c"], optional=True,
                             extra_compile_args=["-O2"])])
