"""Run a command as the leader of a process group of its own, and stop the whole group with it.

`make ui` runs `kedro mlflow ui`, which starts `mlflow ui`, which starts a server and its workers (17 processes).
A plain `kill` of make (which passes SIGTERM on to its recipe) or of kedro ended only the first of them and left the
others running, holding the port. Here the command runs in a new session; SIGTERM, SIGINT or SIGHUP to this process
(Ctrl-C in the terminal reaches only this one: the group is not in the terminal's foreground), and on Linux the
death of its parent (make killed with SIGKILL), is passed on to the whole group. When the command ends, by a signal
or on its own, what is left of its group gets `--grace` seconds after SIGTERM, then SIGKILL. Exits with the
command's code, or 128 + the signal that stopped it.

    python tools/process_group.py [--grace SECONDS] -- COMMAND [ARGS ...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to the process group ``pgid``; False when no process of it is left."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False


def stop_group(pgid: int, grace: float) -> None:
    """SIGTERM to what is left of the group, SIGKILL to what is still there ``grace`` seconds later."""
    if not signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace
    while signal_group(pgid, 0):
        if time.monotonic() > deadline:
            signal_group(pgid, signal.SIGKILL)
            return
        time.sleep(0.1)


def _die_with_parent() -> None:
    """Linux: SIGTERM to this process when its parent dies (make killed with SIGKILL passes nothing on)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    parent = os.getppid()
    _die_with_parent()
    received: list[int] = []
    child = subprocess.Popen(command, start_new_session=True)

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        signal_group(child.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    if os.getppid() != parent:  # the parent died before the line above could hear of it
        forward(signal.SIGTERM, None)
    code = child.wait()
    stop_group(child.pid, args.grace)
    return 128 + received[0] if received else code


if __name__ == "__main__":
    sys.exit(main())
