"""Generate the Python modules and type stubs of the wire protocols from the ``.proto`` files.

Every build runs this (``setup.py``'s ``build_protos``, with ``grpcio-tools`` and
``mypy-protobuf`` pinned in ``[build-system] requires``), so ``pip install .`` and
``pip install -e .`` write ``protos/*_pb2.py``, ``*_pb2_grpc.py`` and their ``.pyi`` stubs
beside the ``.proto`` files; they are not committed. After editing a ``.proto`` file,
``python -m protos.generate`` rewrites them in place (it needs the ``dev`` extra, which pins
the same versions; where they are missing, ``python protos/generate.py``, since importing
``protos`` needs them); ``--check`` regenerates into a temporary directory and exits 1 if the
modules in the tree are missing or differ (a ``.proto`` edited without regenerating).
The runtime only imports the generated modules. ``setup.py`` loads this file by path, so
it imports nothing from ``protos``.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    """The ``.proto`` files of this package, in a stable order."""
    return sorted(HERE.glob("*.proto"))


def generated_names() -> list[str]:
    """The file names :func:`generate` writes."""
    return [p.stem + suffix for p in proto_files() for suffix in SUFFIXES]


def generate(out_root: Path) -> None:
    """Compile every ``.proto`` file into ``out_root/protos/``."""
    # dev-only dependency, imported here so the runtime never needs a compiler
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    plugins = [f"--plugin={n}={_plugin(n)}" for n in ("protoc-gen-mypy", "protoc-gen-mypy_grpc")]
    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    for proto in proto_files():
        args = [
            "grpc_tools.protoc",
            *plugins,
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"--mypy_out={out_root}",
            f"--mypy_grpc_out={out_root}",
            str(proto.relative_to(ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto.name}")


def _plugin(name: str) -> str:
    """The mypy-protobuf plugin beside this interpreter (a venv need not be on PATH)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install the dev extra (mypy-protobuf)")
    return found


def stale() -> list[str]:
    """Generated files that are missing or differ from what the ``.proto`` files give."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "protos"
        return [
            name
            for name in generated_names()
            if not (HERE / name).exists()
            or not filecmp.cmp(fresh / name, HERE / name, shallow=False)
        ]


def write() -> int:
    """Regenerate every module and stub beside the ``.proto`` files; how many were written."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in generated_names():
            shutil.copyfile(Path(tmp) / "protos" / name, HERE / name)
    return len(generated_names())


def main(argv: list[str] | None = None) -> int:
    """Regenerate the modules, or with ``--check`` report missing or stale ones."""
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if generated code is stale")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"protos/{name} is stale: run `python -m protos.generate`", file=sys.stderr)
        return 1 if bad else 0
    print(f"wrote {write()} files in {HERE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
