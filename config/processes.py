"""Whether a process exists: the one question about processes both config and agents ask.

Standard library only, so an agent process (``agents.procs``) and the settings
(a running ``corral up``'s state file names its pid) share it without either loading
the other's dependencies: an agent never imports pydantic.
"""

from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    """True if a process ``pid`` exists (a zombie too), even one owned by another user."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
