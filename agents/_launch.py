"""Launcher run as a script in every child: tie its life to the agent, then become the child.

Usage (by :mod:`agents.procs` only)::

    python agents/_launch.py PARENT_PID exec|module|code ARGS...

It sets ``PR_SET_PDEATHSIG`` to SIGKILL (Linux), exits if its parent is no longer
``PARENT_PID`` (the agent died before the prctl took effect), then either execs
``ARGS`` (the death signal survives exec) or runs a Python module / code in place, so a
Python replica costs one interpreter start-up. Stdlib only: it must not import the
``agents`` package, whose imports are heavy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import sys


def _die_with_parent(parent_pid: int) -> None:
    """Ask for SIGKILL when the parent dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, KILL
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str]) -> None:
    """Run ``argv = [parent_pid, mode, *args]``."""
    _die_with_parent(int(argv[0]))
    mode, args = argv[1], argv[2:]
    if mode == "exec":
        try:
            os.execvp(args[0], args)  # noqa: S606 - argv built by agents.procs for an allow-listed image, never a shell
        except OSError as exc:
            print(f"cannot exec {args[0]!r}: {exc}", file=sys.stderr)
            os._exit(127)
    elif mode == "module":
        sys.argv = [args[0], *args[1:]]
        sys.path[0] = os.getcwd()  # as with ``python -m``, not this script's directory
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args[1:]]
        sys.path[0] = ""
        exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the agent's own -c code (the CPU hog's loop), never a request's


if __name__ == "__main__":
    main(sys.argv[1:])
