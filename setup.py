"""Build hook: generate the protocol modules before the packages are built.

Everything else about the build is declared in ``pyproject.toml``. Here ``build`` gains a
first sub-command, ``build_protos``, which runs ``protos/generate.py`` so that every build
(``pip install .``, a wheel, and the editable ``pip install -e .``, whose ``editable_wheel``
runs the same sub-commands) writes ``protos/*_pb2.py``, ``*_pb2_grpc.py`` and their ``.pyi``
stubs into the source tree from the ``.proto`` files. They are not committed (``.gitignore``).
``grpcio-tools`` and ``mypy-protobuf`` are build requirements, never runtime dependencies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import Command, setup
from setuptools.command.build import build

GENERATE = Path(__file__).resolve().parent / "protos" / "generate.py"


def _generate_module() -> ModuleType:
    """``protos/generate.py`` loaded by path: importing ``protos`` needs what it generates."""
    spec = importlib.util.spec_from_file_location("_corral_protos_generate", GENERATE)
    assert spec is not None and spec.loader is not None  # noqa: S101 - build-time check of our own file
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildProtos(Command):
    """Generate the protocol modules and stubs into ``protos/`` from the ``.proto`` files."""

    description = "generate protos/*_pb2*.py and .pyi stubs from the .proto files"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        """No options."""

    def finalize_options(self) -> None:
        """No options."""

    def run(self) -> None:
        """Write the generated files beside the ``.proto`` files (``build_py`` takes them on)."""
        _generate_module().write()

    def get_outputs(self) -> list[str]:
        """Nothing of its own in the build directory: ``build_py`` copies what it wrote."""
        return []


class Build(build):
    """``build`` with ``build_protos`` first."""

    sub_commands = [("build_protos", None), *build.sub_commands]


setup(cmdclass={"build": Build, "build_protos": BuildProtos})
