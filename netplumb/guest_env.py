"""A guest's environment: what a function may declare, and the clean environment it runs in.

Environment variables are code to the programs that read them: ``PYTHONSTARTUP``,
``PYTHONPATH`` or ``PYTHONWARNINGS`` make Python import or run a file, ``LD_PRELOAD``
makes the loader map a library into every process, ``BASH_ENV`` makes bash run a
script, ``BROWSER`` names a command to run. A function's environment arrives over
the network (fcdaemon ``--env=K=V`` kernel arguments, the Lambdo ``/spawn`` ``env``
object), so letting it through as is would run whatever its sender chose on the
node, past the image allow-list. One rule decides, at ``corral functions deploy``
and again in every agent (:func:`refusal`):

* **Shape.** A name is 1-128 characters of ``[A-Za-z0-9_]`` not starting with a
  digit (:data:`NAME_RE`); a value is at most :data:`MAX_VALUE` characters without
  NUL or newlines; at most :data:`MAX_VARIABLES` variables.
* **Not code.** A name is refused if, compared in upper case, it is one of
  :data:`REFUSED_NAMES` or starts with one of :data:`REFUSED_PREFIXES`: the
  variables some interpreter, shell, dynamic loader or common library reads as
  code, as a path to code, or as a command to run. The agent's own names (``PORT``,
  ``HOST``, ``VMID``, ``PATH``, ``HOME``) are refused too: the agent sets them.

A guest starts with :func:`guest_environment`: the function's checked variables
plus what the agent sets itself, never the agent's own environment (which holds
its tokens, and under ``corral up`` the operator's AWS keys and Flower password).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

__all__ = [
    "AGENT_NAMES",
    "MAX_VALUE",
    "MAX_VARIABLES",
    "NAME_RE",
    "REFUSED_NAMES",
    "REFUSED_PREFIXES",
    "SAFE_PATH",
    "check",
    "guest_environment",
    "parse_env_args",
    "refusal",
]

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_VALUE = 4096
MAX_VARIABLES = 256
#: The PATH a guest gets (the agent's own PATH may name directories its user can write).
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

#: Set by the agent for every guest; a function may not declare them.
AGENT_NAMES = frozenset({"PORT", "HOST", "VMID", "PATH", "HOME", "REGISTRY", "REPORT_TOKEN"})

#: Names (upper-cased) that are code, a path to code, or a command to some program.
REFUSED_NAMES = frozenset(
    {
        "ENV",
        "BASH_ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "PROMPT_COMMAND",
        "IFS",
        "CDPATH",
        "SHELL",
        "BROWSER",
        "PAGER",
        "MANPAGER",
        "EDITOR",
        "VISUAL",
        "TERMINAL",
        "ZDOTDIR",
        "SSH_ASKPASS",
        "SUDO_ASKPASS",
        "LESSOPEN",
        "LESSCLOSE",
        "CLASSPATH",
    }
)
#: Prefixes (upper-cased) of names that are code to some interpreter or loader.
REFUSED_PREFIXES = (
    "PYTHON",  # PYTHONSTARTUP, PYTHONPATH, PYTHONWARNINGS (imports), PYTHONHOME...
    "LD_",
    "DYLD_",
    "GLIBC_",
    "MALLOC_",
    "GCONV_",  # the dynamic loader and libc
    "BASH_",  # BASH_ENV, BASH_FUNC_* (exported functions)
    "PERL",
    "RUBY",
    "GEM_",
    "BUNDLE",
    "NODE_",
    "NPM_",
    "LUA_",
    "PHP",
    "TCL",
    "R_",
    "JAVA",
    "_JAVA_",
    "JDK_",
    "DOTNET_",
    "CORECLR_",
    "COMPLUS_",
    "MONO_",
    "GIT_",
    "OPENSSL_",
)


def refusal(name: str, value: str) -> str | None:
    """Why a function may not set ``name=value`` in its guest's environment (None: it may)."""
    if not NAME_RE.fullmatch(name):
        shown = name if len(name) <= 40 else name[:37] + "..."
        return f"{shown!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*, <=128)"
    upper = name.upper()
    if upper in AGENT_NAMES:
        return f"{name} is set by the agent for every guest"
    if upper in REFUSED_NAMES or upper.startswith(REFUSED_PREFIXES):
        return (
            f"{name} is refused: programs read it as code or as a command to run "
            "(see docs/security.md, 'A guest's environment')"
        )
    if len(value) > MAX_VALUE:
        return f"the value of {name} is longer than {MAX_VALUE} characters"
    if "\0" in value or "\n" in value or "\r" in value:
        return f"the value of {name} holds a NUL or a line break"
    return None


def check(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as a dict if every variable may be set; ValueError naming the first that may not."""
    if len(env) > MAX_VARIABLES:
        raise ValueError(f"{len(env)} environment variables; at most {MAX_VARIABLES}")
    for name, value in env.items():
        reason = refusal(name, value)
        if reason is not None:
            raise ValueError(reason)
    return dict(env)


def guest_environment(declared: Mapping[str, str], agent_set: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of a guest: ``declared`` (checked) plus what the agent sets.

    Nothing comes from the agent's own environment; ``agent_set`` (``PORT``,
    ``VMID``..., and for Python images the ``PYTHONPATH`` the agent computed) wins.
    """
    return {**check(declared), "PATH": SAFE_PATH, **agent_set}


def parse_env_args(kernel_args: str) -> dict[str, str]:
    """Collect ``--env=K=V`` tokens of a kernel command line into a dict (later wins)."""
    try:
        tokens = shlex.split(kernel_args)
    except ValueError:
        tokens = kernel_args.split()
    env: dict[str, str] = {}
    for token in tokens:
        if not token.startswith("--env="):
            continue
        key, sep, value = token[len("--env=") :].partition("=")
        if key and sep:
            env[key] = value
    return env
