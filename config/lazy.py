"""Names imported when first used: the one lazy import of corral, on the standard library alone.

The model
---------
A name is written as kombu's ``symbol_by_name`` writes it: ``"package.module:attr"``, or
dotted, ``"package.module.attr"`` (then the last dot splits the module from the attribute).
Writing a name costs nothing; its module is imported when the name is first used, so a
process loads only what it runs: ``corral --help`` no command's handler, a listing of the
store no Celery, an agent no other agent. Three shapes of use, one mechanism:

* :func:`attribute` - the thing a name names, imported now (a command's handler when it
  runs, a kind of node's backend when first asked for);
* :func:`module_getattr` - a package's face (PEP 562): the module's ``__getattr__``, from
  a table of its public names, each imported on first use and then kept in the module,
  and :class:`AttributeError` for any other name, as for a module without the hook;
* :class:`LazyModule` - a module to call through (``redis.Redis(...)``), imported on its
  first attribute: what a module's own functions use, since a module's ``__getattr__``
  serves only those who look a name up from outside.

Not ``symbol_by_name`` itself, though kombu is a dependency: importing
``kombu.utils.imports`` loads kombu, amqp, vine and :mod:`ssl` (about 57 ms), which the
CLI's store commands and the agents never load (``tests/corral/cli/test_startup.py``).
This module imports nothing at run time but :mod:`importlib` and :mod:`sys`, which every
interpreter has loaded before it runs a line (not even :mod:`typing`: ``corral --help``
loads none).
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # typing is for mypy only (see above)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from types import ModuleType
    from typing import Any

__all__ = ["LazyModule", "attribute", "module_getattr", "names_in", "split"]


def split(name: str) -> tuple[str, str]:
    """The module and the attribute of ``"module:attr"`` or ``"module.attr"``."""
    module, colon, attr = name.partition(":")
    if not colon:
        module, _, attr = name.rpartition(".")
    if not module or not attr or ":" in attr:
        raise ValueError(f"{name!r} does not name an attribute of a module ('module:attr')")
    return module, attr


def attribute(name: str) -> Any:
    """What ``"module:attr"`` (or ``"module.attr"``) names, its module imported now."""
    module, attr = split(name)
    return getattr(importlib.import_module(module), attr)


def names_in(module: str, *names: str) -> dict[str, str]:
    """A table naming each of ``names`` in ``module``: ``{name: "module:name"}``."""
    return {name: f"{module}:{name}" for name in names}


def module_getattr(module: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A PEP 562 ``__getattr__`` for ``module``: each name of ``table`` from where it names."""
    table = dict(table)
    for target in table.values():
        split(target)  # a misspelt table fails when its module is imported, not when used

    def __getattr__(name: str) -> Any:
        """A public name, imported on first use and kept in the module."""
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = attribute(target)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


class LazyModule:
    """A module imported on the first use of one of its attributes."""

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr in LazyModule.__slots__:  # not set yet (a copy being made): not the module's
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<LazyModule {self._name!r}, {state}>"
