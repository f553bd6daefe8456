"""File descriptors: the process's limit, raised at start, and what connections may take of it.

A server that accepts connections past its descriptor limit fails everything else that
needs one: an upstream connection, a store's file, a broker connection. So each of
corral's HTTP servers raises its soft ``RLIMIT_NOFILE`` to the hard limit when it starts
(:func:`raise_limit`, as nginx's ``worker_rlimit_nofile`` and systemd's services do) and
keeps its connection caps below what that leaves, with a reserve for everything else
(:meth:`netplumb.asgiserve.Limits.within`).
"""

from __future__ import annotations

import errno
import os
import resource

__all__ = ["EXHAUSTED", "exhausted", "none_free", "raise_limit"]

#: The errors of a call that found no descriptor (the process's, or the system's) free.
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})


def raise_limit() -> int:
    """Raise the soft descriptor limit to the hard one (where allowed); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
        return hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def exhausted(exc: BaseException) -> bool:
    """True when ``exc`` says no descriptor was free (EMFILE, ENFILE)."""
    return isinstance(exc, OSError) and exc.errno in EXHAUSTED


def none_free() -> bool:
    """True when this process cannot open a descriptor now (EMFILE, ENFILE).

    What a failed call that names no errno cannot say: a database driver's connect, or a
    file it could not open. Asked after such a failure, it tells the process's own want of
    descriptors from the other side's trouble.
    """
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno in EXHAUSTED
    os.close(fd)
    return False
