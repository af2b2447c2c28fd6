"""Environment variables: set for the length of a block, then put back as they were; this machine's CPU as Linux
describes it (read once per process: :func:`this_cpu`); and the variable this CPU's MKL needs
(``MKL_DEBUG_CPU_TYPE``)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path


@contextlib.contextmanager
def scoped_environment(variables: Mapping[str, str], *, keep_set: bool = False) -> Iterator[None]:
    """``variables`` in ``os.environ`` inside the block; afterwards each is what it was (or unset again).

    With ``keep_set``, a variable the environment already sets keeps its value (the user's choice wins).
    """
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update({name: str(value) for name, value in variables.items()
                       if not (keep_set and saved[name] is not None)})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def first_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The fields of the machine's first processor in Linux's ``cpuinfo`` (``vendor_id``, ``flags``, ...); empty
    where there is none."""
    fields: dict[str, str] = {}
    try:
        with Path(cpuinfo).open(encoding="ascii", errors="replace") as file:
            for line in file:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


@functools.cache
def this_cpu() -> dict[str, str]:
    """:func:`first_cpu` of this machine, read once per process (the kernel probe and the export runtime ask)."""
    return first_cpu()


def cpu_identity(cpu: Mapping[str, str]) -> tuple[str, str]:
    """``(model name, digest of the flags)`` of the processor ``cpu`` (:func:`first_cpu`): what a result measured
    on one CPU is filed under. The flags say what it can run; the model name is for people reading the file."""
    flags = " ".join(sorted(cpu.get("flags", "").split()))
    return cpu.get("model name", "unknown CPU"), hashlib.blake2b(flags.encode(), digest_size=8).hexdigest()


def mkl_cpu_type(cpu: Mapping[str, str]) -> str | None:
    """``MKL_DEBUG_CPU_TYPE`` for the processor ``cpu`` (:func:`first_cpu`): "5" on an AMD CPU with AVX2, else None.

    The MKL in Paddle's CPU wheel (``paddle/libs/libmklml_intel.so``) takes its generic SSE kernels on CPUs that
    are not Intel's unless this variable asks for AVX2: 2-6x the float32 matrix-product rate on an AMD EPYC
    (docs/benchmarks.md). Intel CPUs get their best kernels anyway; a CPU without AVX2 would crash on them. MKL
    reads it once, at the first product of a process.
    """
    amd_avx2 = cpu.get("vendor_id") == "AuthenticAMD" and "avx2" in cpu.get("flags", "").split()
    return "5" if amd_avx2 else None
