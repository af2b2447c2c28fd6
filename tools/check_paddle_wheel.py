"""Check that a venv holds exactly the Paddle wheel of the flavour `make` built it as.

`paddlepaddle` (CPU) and `paddlepaddle-gpu` install the same `paddle/` package: the one installed last
overwrites part of the other, and uninstalling either deletes files the other needs. A wheel pip-installed
by hand into a venv of the other flavour would also be replaced by the next `make` that reinstalls the lock.
`make` runs this with the venv's Python before every target that uses the venv; it exits 0 when only the
flavour's wheel is installed and otherwise with one line saying which `make` command fixes the venv.

    python tools/check_paddle_wheel.py --device cpu|gpu [--path SITE_PACKAGES ...]
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import distributions

WHEEL = {"cpu": "paddlepaddle", "gpu": "paddlepaddle-gpu"}


def installed_wheels(paths: list[str]) -> dict[str, str]:
    """The Paddle wheels installed on ``paths``, as {device: 'name version'}."""
    found = {}
    for device, name in WHEEL.items():
        for dist in distributions(name=name, path=paths):
            found[device] = f"{name} {dist.version}"
    return found


def problem(device: str, found: dict[str, str], where: str) -> str | None:
    """Why the wheels ``found`` in ``where`` are wrong for a venv built as ``device``; None when they are right."""
    other = "gpu" if device == "cpu" else "cpu"
    if len(found) > 1:
        return (f"{found['cpu']} and {found['gpu']} are both installed in {where}: they overwrite each other's "
                f"paddle/ package; keep one with `make -B venv DEVICE={device}` (or DEVICE={other})")
    if other in found:
        return (f"{found[other]} is installed in {where}, which make built as DEVICE={device}: keep it with "
                f"`make venv DEVICE={other}`, or replace it with `make -B venv DEVICE={device}`")
    if not found:
        return f"no Paddle wheel is installed in {where}: reinstall it with `make -B venv DEVICE={device}`"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(WHEEL), required=True, help="the flavour make built the venv as")
    parser.add_argument("--path", action="append", help="a site-packages folder to look in (default: sys.path)")
    args = parser.parse_args(argv)
    message = problem(args.device, installed_wheels(args.path or sys.path), ", ".join(args.path or [sys.prefix]))
    if message:
        sys.exit(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
