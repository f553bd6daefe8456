"""config.lazy: a name's module is imported on first use, once, and an unknown name is refused.

Whether a module is imported is read from ``sys.modules`` in a fresh interpreter, as
``tests/corral/cli/test_startup.py`` does: in the suite's own process another test may
already have imported it. The package the mechanics are tried on is written for each test
(``face/``: a PEP 562 face over ``face.heavy``), so nothing else ever imports it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from config import lazy

ROOT = Path(__file__).resolve().parents[2]

FACE = """
from config import lazy
TABLE = {"Thing": "face.heavy:Thing", "alias": "face.heavy.other"}
__getattr__ = lazy.module_getattr(__name__, TABLE)
"""
HEAVY = """
class Thing:
    pass

other = object()
"""


def _run(tmp_path: Path, script: str) -> Any:
    """Run ``script`` in a fresh interpreter that can import corral and ``face``; its JSON."""
    (tmp_path / "face").mkdir(exist_ok=True)
    (tmp_path / "face" / "__init__.py").write_text(FACE)
    (tmp_path / "face" / "heavy.py").write_text(HEAVY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_importing_the_helper_loads_nothing_else() -> None:
    # standard library alone, and not even typing: `corral --help` imports it
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; before = set(sys.modules); import config.lazy; "
            "print(sorted(set(sys.modules) - before))",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['config',", "'config.lazy']"]


def test_a_face_imports_a_name_on_first_use_and_keeps_it(tmp_path: Path) -> None:
    seen = _run(
        tmp_path,
        """
        import json, sys
        import face
        before = "face.heavy" in sys.modules
        thing = face.Thing
        after = "face.heavy" in sys.modules
        import face.heavy
        del sys.modules["face.heavy"]  # a second import would make another Thing
        print(json.dumps({
            "before": before, "after": after,
            "same": thing is face.heavy.Thing and face.Thing is thing,
            "kept": vars(face).get("Thing") is thing,
            "alias": face.alias is face.heavy.other,
        }))
        """,
    )
    assert seen == {"before": False, "after": True, "same": True, "kept": True, "alias": True}


def test_a_face_refuses_a_name_not_in_its_table(tmp_path: Path) -> None:
    seen = _run(
        tmp_path,
        """
        import json, sys
        import face
        try:
            face.heavy_thing
        except AttributeError as exc:
            error = str(exc)
        try:
            from face import Nope
        except ImportError as exc:
            imported = str(exc)
        print(json.dumps({"error": error, "imported": imported,
                          "hasattr": hasattr(face, "Nope"),
                          "loaded": "face.heavy" in sys.modules}))
        """,
    )
    assert seen["error"] == "module 'face' has no attribute 'heavy_thing'"
    assert seen["imported"].startswith("cannot import name 'Nope' from 'face'")
    assert seen["hasattr"] is False
    assert seen["loaded"] is False  # nothing imported for a name it does not know


def test_a_lazy_module_is_imported_on_its_first_attribute_once(tmp_path: Path) -> None:
    seen = _run(
        tmp_path,
        """
        import json, sys
        from config.lazy import LazyModule
        heavy = LazyModule("face.heavy")
        before = ("face.heavy" in sys.modules, repr(heavy))
        thing = heavy.Thing
        after = ("face.heavy" in sys.modules, repr(heavy))
        del sys.modules["face.heavy"]
        try:
            heavy.nothing
        except AttributeError as exc:
            error = str(exc)
        print(json.dumps({"before": before, "after": after, "kept": heavy.Thing is thing,
                          "error": error}))
        """,
    )
    assert seen["before"] == [False, "<LazyModule 'face.heavy', not imported yet>"]
    assert seen["after"] == [True, "<LazyModule 'face.heavy', imported>"]
    assert seen["kept"] is True  # not imported again
    assert seen["error"] == "module 'face.heavy' has no attribute 'nothing'"


@pytest.mark.parametrize(
    ("package", "name", "module"),
    [
        ("agents", "FcAgent", "agents.fcdaemon"),
        ("workers.replicas", "spawn_batch", "workers.replicas.handlers"),
        ("corral.api", "Audit", "workers.maintenance.audit"),
    ],
)
def test_each_face_of_corral_imports_its_names_on_first_use(
    tmp_path: Path, package: str, name: str, module: str
) -> None:
    seen = _run(
        tmp_path,
        f"""
        import importlib, json, sys
        face = importlib.import_module({package!r})
        before = {module!r} in sys.modules
        value = getattr(face, {name!r})
        print(json.dumps({{"before": before,
                          "same": value is getattr(sys.modules[{module!r}], {name!r})}}))
        """,
    )
    assert seen == {"before": False, "same": True}


def test_a_backend_is_imported_when_first_asked_for(tmp_path: Path) -> None:
    seen = _run(
        tmp_path,
        """
        import json, sys
        from workers.backends.base import backend
        before = "workers.backends.lambdo" in sys.modules
        made = backend("lambdo")
        print(json.dumps({"before": before, "type": type(made).__qualname__,
                          "once": backend("lambdo") is made}))
        """,
    )
    assert seen == {"before": False, "type": "LambdoBackend", "once": True}


def test_attribute_takes_kombus_two_spellings() -> None:
    assert lazy.attribute("os.path:join") is os.path.join
    assert lazy.attribute("os.path.join") is os.path.join
    assert lazy.split("a.b:c") == ("a.b", "c") and lazy.split("a.b.c") == ("a.b", "c")


@pytest.mark.parametrize("name", ["os", "os:", ":join", "os.path:join:x", ""])
def test_a_name_that_names_no_attribute_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="does not name an attribute of a module"):
        lazy.attribute(name)
    with pytest.raises(ValueError, match="does not name an attribute of a module"):
        lazy.module_getattr("face", {"x": name})  # when the table is made, not when used


def test_attribute_says_what_is_missing() -> None:
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        lazy.attribute("no_such_module:x")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        lazy.attribute("os.path:no_such_name")
