"""Guest images: an initramfs per function build, made from what the function's image names.

The model
---------
A guest boots the cached Debian kernel (:mod:`agents.qemu.kernel`) with an initramfs of
two concatenated cpio archives (the kernel unpacks them one after the other):

* the **base**, the same for every function: busybox (static), the virtio modules in
  load order, a Python runtime - the host's ``python3.X`` binary and the shared libraries
  it and its extension modules load, with the standard library trimmed of what a
  function never runs (tests, IDLE, tkinter, ``ensurepip``, ``lib2to3``, the static
  library...) and shipped as compiled ``.pyc`` only - the guest runtime
  (:mod:`agents.qemu.guest`) and ``/init``, a busybox shell script that mounts ``/proc``,
  ``/sys`` and ``/dev``, loads the modules, brings up ``eth0`` (10.0.2.15 on QEMU's
  user-mode network) and hands over to the runtime;
* the **function**: the top-level package (or module) its image names, copied from where
  the agent imports it, as ``process`` runs it (``examples.hello`` brings ``examples/``),
  and ``/corral/image.json``.

The image's **key** hashes everything that goes into it: the kernel, the Python binary
and its version, busybox, the runtime's source, this builder's version and every byte of
the function's files. A key is a build: an image is built once per key
(``CACHE/images/<key>.cpio.gz``) and a snapshot is restored only by a VM of the same key
(:mod:`agents.qemu.snapshots`). Changing one byte of the function is a new build.

Builds are serialised per key across processes (a lock file), written to a temporary
name and renamed into place; at most ``max_images`` images are kept, the least recently
used removed first.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import marshal
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agents.qemu.cache import lock_file
from agents.qemu.kernel import Kernel

__all__ = [
    "BUILDER_VERSION",
    "GUEST_IP",
    "Image",
    "ImageCache",
    "ImageError",
    "Runtime",
    "function_files",
]

log = logging.getLogger(__name__)

#: Bump when what the builder writes changes: every image key changes with it.
BUILDER_VERSION = "2"
TAG = sys.implementation.cache_tag
GUEST_IP = "10.0.2.15"
GUEST_GATEWAY = "10.0.2.2"
GUEST_RUNTIME = Path(__file__).with_name("guest.py")
LDD = shutil.which("ldd") or "/usr/bin/ldd"
#: Standard-library directories a function never needs.
_DROP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "pydoc_data",
        "distutils",
        "site-packages",
        "dist-packages",
        "__phello__",
        "__pycache__",
        "venv",
    }
)
_DROP_EXTENSIONS = re.compile(
    r"^(_test|_xx|xx|_ctypes_test|_tkinter|readline|_curses|nis|ossaudiodev|_dbm|_gdbm)"
)
#: A function's own files: at most this many bytes and files.
MAX_FUNCTION_BYTES = 64 << 20
MAX_FUNCTION_FILES = 4000


class ImageError(RuntimeError):
    """An image could not be built."""


# -- cpio (newc) ---------------------------------------------------------------------------


class Cpio:
    """A ``newc`` cpio archive written to a stream (what the kernel's initramfs reads)."""

    def __init__(self, out: IO[bytes]) -> None:
        """Write entries to ``out``; :meth:`close` writes the trailer."""
        self._out = out
        self._ino = 1
        self._dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        self._ino += 1
        encoded = name.encode() + b"\0"
        fields = (self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % v for v in fields)
        self._out.write(header + encoded + b"\0" * (-(110 + len(encoded)) % 4))
        self._out.write(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str, mode: int = 0o755) -> None:
        """A directory and its parents (each written once)."""
        name = name.strip("/")
        if not name or name in self._dirs:
            return
        parent = os.path.dirname(name)
        if parent:
            self.directory(parent)
        self._dirs.add(name)
        self._entry(name, stat.S_IFDIR | mode)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """A regular file (its directory made first)."""
        name = name.strip("/")
        self.directory(os.path.dirname(name))
        self._entry(name, stat.S_IFREG | (mode & 0o7777), data)

    def symlink(self, name: str, target: str) -> None:
        """A symbolic link."""
        name = name.strip("/")
        self.directory(os.path.dirname(name))
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def close(self) -> None:
        """Write the trailer."""
        self._entry("TRAILER!!!", 0)


class _Gzip(io.RawIOBase):
    """A write-only stream gzip-compressing into ``out`` (fast level: the guest inflates it)."""

    def __init__(self, out: IO[bytes], level: int = 6) -> None:
        self._out = out
        self._z = zlib.compressobj(level, zlib.DEFLATED, 31)

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._out.write(self._z.compress(data))
        return len(data)

    def finish(self) -> None:
        self._out.write(self._z.flush())


def _archive(write: object, out: IO[bytes]) -> None:
    """Run ``write(cpio)`` into a gzip-compressed archive on ``out``."""
    gz = _Gzip(out)
    cpio = Cpio(gz)  # type: ignore[arg-type]
    write(cpio)  # type: ignore[operator]
    cpio.close()
    gz.finish()


# -- the runtime ---------------------------------------------------------------------------


def _shared_libraries(binary: Path) -> list[Path]:
    """The shared libraries ``binary`` loads (``ldd``), the loader included."""
    try:
        out = subprocess.run(  # noqa: S603 - ldd on a file this driver picked, no shell
            [LDD, str(binary)], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageError(f"ldd {binary}: {exc}") from None
    libs = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            libs.append(Path(parts[2]))
        elif parts and parts[0].startswith("/"):
            libs.append(Path(parts[0]))
    return libs


def _file_digest(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


@dataclass(frozen=True)
class Runtime:
    """The Python a guest runs: the host's interpreter and where its standard library is."""

    python: Path
    version: str
    stdlib: Path
    dynload: Path
    busybox: Path

    @classmethod
    def find(cls, python: str | None = None, busybox: str | None = None) -> Runtime:
        """The host's ``python3.X`` of this version (``/usr/bin`` first), and busybox."""
        want = f"python{sys.version_info.major}.{sys.version_info.minor}"
        candidates = [python] if python else [f"/usr/bin/{want}", sys._base_executable]  # type: ignore[attr-defined]
        exe = next((Path(c) for c in candidates if c and os.access(c, os.X_OK)), None)
        if exe is None:
            raise ImageError(f"no {want} to put in guests")
        probe = (
            "import json,sys,sysconfig;p=sysconfig.get_paths();"
            "print(json.dumps([sys.version.split()[0],p['stdlib'],p['platstdlib']]))"
        )
        try:
            done = subprocess.run(  # noqa: S603 - the interpreter this driver picked
                [str(exe), "-I", "-S", "-c", probe],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            version, stdlib, platstdlib = json.loads(done.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise ImageError(f"cannot ask {exe} where its standard library is: {exc}") from None
        box = Path(busybox or "/bin/busybox")
        if not os.access(box, os.X_OK):
            raise ImageError(f"no busybox at {box} (apt-get install busybox-static)")
        return cls(exe.resolve(), version, Path(stdlib), Path(platstdlib) / "lib-dynload", box)

    def key(self) -> str:
        """What identifies this runtime in image keys (interpreter, version, busybox)."""
        parts = [self.version, str(self.python), _file_digest(self.python)]
        parts += [str(self.stdlib), _file_digest(self.busybox)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def stdlib_files(self) -> Iterator[tuple[Path, str]]:
        """(file, its path in the guest) for the trimmed standard library's sources."""
        for dirpath, dirnames, filenames in os.walk(self.stdlib):
            dirnames[:] = sorted(
                d for d in dirnames if d not in _DROP_DIRS and not d.startswith("config-")
            )
            base = Path(dirpath)
            if base == self.dynload:
                continue
            for name in sorted(filenames):
                if name.endswith(".py"):
                    yield base / name, str(base / name)

    def extensions(self) -> list[Path]:
        """The extension modules a guest gets."""
        if not self.dynload.is_dir():
            return []
        return sorted(
            p
            for p in self.dynload.iterdir()
            if p.suffix == ".so" and not _DROP_EXTENSIONS.match(p.name)
        )


def _pyc(source: Path) -> bytes:
    """``source`` compiled to a ``.pyc`` (a sourceless one: nothing checks its header)."""
    code = compile(source.read_bytes(), str(source), "exec", dont_inherit=True)
    st = source.stat()
    words = (0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
    header = importlib.util.MAGIC_NUMBER + b"".join(w.to_bytes(4, "little") for w in words)
    return header + marshal.dumps(code)


def _unchecked_pyc(source: Path) -> bytes:
    """``source`` compiled to a ``__pycache__`` entry that is used without checking the source
    (an unchecked-hash ``.pyc``: the image's files carry no modification times to check)."""
    data = source.read_bytes()
    code = compile(data, str(source), "exec", dont_inherit=True)
    flags = (1).to_bytes(4, "little")  # hash-based, unchecked
    return (
        importlib.util.MAGIC_NUMBER + flags + importlib.util.source_hash(data) + marshal.dumps(code)
    )


def _cached_pyc(source: Path) -> bytes | None:
    """The interpreter's own ``__pycache__`` entry for ``source``, if current."""
    tag = sys.implementation.cache_tag
    cached = source.parent / "__pycache__" / f"{source.stem}.{tag}.pyc"
    try:
        data = cached.read_bytes()
        st = source.stat()
    except OSError:
        return None
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return None
    flags = int.from_bytes(data[4:8], "little")
    mtime, size = int.from_bytes(data[8:12], "little"), int.from_bytes(data[12:16], "little")
    if flags != 0 or mtime != int(st.st_mtime) & 0xFFFFFFFF or size != st.st_size & 0xFFFFFFFF:
        return None
    return data


# -- the function ----------------------------------------------------------------------------


def function_files(module: str) -> tuple[Path, list[tuple[Path, str]]]:
    """The directory ``module`` is imported from and its top-level package's files
    (file, path relative to that directory), as the agent would import them."""
    top = module.split(".", 1)[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ImageError(f"module {top!r} is not importable")
    files: list[tuple[Path, str]] = []
    if spec.submodule_search_locations:
        package = Path(next(iter(spec.submodule_search_locations))).resolve()
        root = package.parent
        for dirpath, dirnames, filenames in os.walk(package):
            dirnames[:] = sorted(
                d for d in dirnames if d != "__pycache__" and not d.startswith(".")
            )
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if name.endswith((".pyc", ".pyo")) or not path.is_file():
                    continue
                files.append((path, str(path.relative_to(root))))
    elif spec.origin and spec.has_location:
        path = Path(spec.origin).resolve()
        root = path.parent
        files.append((path, path.name))
    else:
        raise ImageError(f"module {top!r} has no files to copy into a guest")
    if len(files) > MAX_FUNCTION_FILES:
        raise ImageError(f"{top!r} has {len(files)} files (at most {MAX_FUNCTION_FILES})")
    if sum(p.stat().st_size for p, _ in files) > MAX_FUNCTION_BYTES:
        raise ImageError(f"{top!r} is larger than {MAX_FUNCTION_BYTES >> 20} MiB")
    return root, files


@dataclass(frozen=True)
class Image:
    """A built guest image: its initramfs and the key of its build."""

    module: str
    key: str
    initrd: Path


class ImageCache:
    """Builds and keeps guest images in ``CACHE/images``, one per build key."""

    def __init__(self, cache: Path, kernel: Kernel, runtime: Runtime, max_images: int = 8) -> None:
        """At most ``max_images`` function images are kept (least recently used go first)."""
        self.directory = cache / "images"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kernel = kernel
        self.runtime = runtime
        self.max_images = max(1, max_images)
        self._base_key = hashlib.sha256(
            "\0".join(
                [
                    BUILDER_VERSION,
                    kernel.key,
                    ",".join(kernel.modules),
                    runtime.key(),
                    _file_digest(GUEST_RUNTIME),
                ]
            ).encode()
        ).hexdigest()[:32]

    @property
    def base(self) -> Path:
        """The base archive (built on first use)."""
        return self.directory / f"base-{self._base_key}.cpio.gz"

    def key(self, module: str) -> tuple[str, Path, list[tuple[Path, str]]]:
        """The build key of ``module``'s image, the directory it is imported from, its files."""
        root, files = function_files(module)
        h = hashlib.sha256(f"{self._base_key}\0{module}\0".encode())
        for path, rel in files:
            h.update(rel.encode() + b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
        return h.hexdigest()[:32], root, files

    def image(self, module: str) -> Image:
        """The image of ``module`` as it is now, built if this build has none yet."""
        key, _root, files = self.key(module)
        path = self.directory / f"fn-{key}.cpio.gz"
        if not path.is_file():
            with lock_file(self.directory / ".lock"):
                if not self.base.is_file():
                    self._write(self.base, self._write_base)
                if not path.is_file():
                    self._write(path, lambda out: self._write_function(out, module, files))
                    self._prune(keep=path)
        with contextlib.suppress(OSError):
            os.utime(path)
        return Image(module, key, path)

    def _write(self, path: Path, write: object) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".build-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as out:
                write(out)  # type: ignore[operator]
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        log.info("built %s (%d KiB)", path.name, path.stat().st_size >> 10)

    def _write_base(self, out: IO[bytes]) -> None:
        """busybox, the modules, Python and its trimmed standard library, /init, the runtime."""
        _archive(self._base_entries, out)

    def _base_entries(self, cpio: Cpio) -> None:
        runtime, kernel = self.runtime, self.kernel
        for d in ("proc", "sys", "dev", "tmp", "run", "root", "etc", "corral"):
            cpio.directory(d, 0o1777 if d == "tmp" else 0o755)
        cpio.file("bin/busybox", runtime.busybox.read_bytes(), 0o755)
        cpio.symlink("bin/sh", "busybox")
        cpio.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        cpio.file("etc/group", b"root:x:0:\n")
        cpio.file("etc/hosts", b"127.0.0.1 localhost\n")
        for name in kernel.modules:
            cpio.file(f"lib/modules/corral/{name}.ko", kernel.module_path(name).read_bytes())
        cpio.file("corral/modules", "\n".join(kernel.modules).encode() + b"\n")
        binaries = [runtime.python, *runtime.extensions()]
        libs: dict[str, Path] = {}
        for binary in binaries:
            for lib in _shared_libraries(binary):
                libs.setdefault(str(lib), lib)
        cpio.file(str(runtime.python), runtime.python.read_bytes(), 0o755)
        for name, lib in sorted(libs.items()):
            cpio.file(name, lib.read_bytes(), 0o755)
        for ext in runtime.extensions():
            cpio.file(str(ext), ext.read_bytes(), 0o755)
        for source, name in runtime.stdlib_files():
            data = _cached_pyc(source) or _pyc(source)
            cpio.file(name.removesuffix(".py") + ".pyc", data)
        cpio.file("corral/guest.py", GUEST_RUNTIME.read_bytes())
        cpio.file("init", self._init_script().encode(), 0o755)

    def _init_script(self) -> str:
        python = self.runtime.python
        return f"""#!/bin/busybox sh
# corral guest init: mounts, modules, network, then the guest runtime as PID 1.
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
$B mount -t devtmpfs devtmpfs /dev
$B mkdir -p /dev/shm /dev/pts
$B mount -t tmpfs -o mode=1777 tmpfs /dev/shm
for m in $($B cat /corral/modules); do
    $B insmod /lib/modules/corral/$m.ko || echo "corral: insmod $m failed"
done
$B ip link set lo up
$B ip addr add {GUEST_IP}/24 dev eth0
$B ip link set eth0 up
$B ip route add default via {GUEST_GATEWAY}
cd /corral
exec {python} -I -S -B -u /corral/guest.py
"""

    def _write_function(self, out: IO[bytes], module: str, files: list[tuple[Path, str]]) -> None:
        """The base, then the function's archive: its files and ``image.json``."""
        with open(self.base, "rb") as base:
            while chunk := base.read(1 << 20):
                out.write(chunk)

        def entries(cpio: Cpio) -> None:
            for path, rel in files:
                mode = path.stat().st_mode
                cpio.file(f"corral/fn/{rel}", path.read_bytes(), mode & 0o755 | 0o444)
                if rel.endswith(".py"):  # compiled here: the guest would compile at each start
                    cached = f"{os.path.dirname(rel)}/__pycache__/{Path(rel).stem}.{TAG}.pyc"
                    cpio.file(f"corral/fn/{cached.lstrip('/')}", _unchecked_pyc(path))
            config = {"module": module, "path": ["/corral/fn"]}
            cpio.file("corral/image.json", json.dumps(config).encode())

        _archive(entries, out)

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``max_images`` function images and the current base; remove what
        a build killed mid-way left (an hour old)."""
        stale = time.time() - 3600
        for leftover in self.directory.glob(".build-*"):
            with contextlib.suppress(OSError):
                if leftover.stat().st_mtime < stale:
                    leftover.unlink()
        images = sorted(
            (p for p in self.directory.glob("fn-*.cpio.gz") if p != keep),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for old in images[self.max_images - 1 :]:
            with contextlib.suppress(OSError):
                old.unlink()
        for old in self.directory.glob("base-*.cpio.gz"):
            if old != self.base:
                with contextlib.suppress(OSError):
                    old.unlink()
