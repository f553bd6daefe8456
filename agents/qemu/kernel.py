"""The guest kernel: Debian's cloud kernel, fetched with apt, unpacked into a cache directory.

The model
---------
A guest boots Debian's ``linux-image-cloud-amd64`` (the kernel Debian builds for cloud
VMs: virtio, ACPI, no hardware drivers), never the host's ``/boot``. Preparing it is
three steps, each skipped when its result is already in the cache:

1. **fetch**: ``apt-get download linux-image-cloud-amd64`` (a metapackage) and the
   versioned package it depends on, into ``CACHE/debs`` (``.ci/run`` does this ahead,
   with the same command, so tests never wait on the network);
2. **unpack**: ``dpkg -x`` into a scratch directory, from which two things are kept;
3. **extract**: the ``vmlinux`` (the bzImage's LZ4 payload, decompressed: an ELF with a
   PVH entry that QEMU boots directly, skipping the real-mode decompressor) and the
   virtio modules the guest needs, in the order they must be loaded (read from each
   module's ``.modinfo`` ``depends=``; Debian builds virtio as modules).

The result is a :class:`Kernel`: a directory ``CACHE/kernel/<package>_<version>`` holding
``vmlinux``, ``modules/*.ko`` and ``kernel.json``. Its :attr:`Kernel.key` (package and
version) is part of every image and snapshot key, so a new kernel never restores a
snapshot made under the old one. Only the kernel in use is kept: preparing one removes
the others (disk is bounded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agents.qemu.cache import default_cache, lock_file

__all__ = [
    "KERNEL_PACKAGE",
    "MODULES",
    "Kernel",
    "KernelError",
    "extract_vmlinux",
    "fetch_debs",
    "load_order",
    "modinfo",
    "prepare_kernel",
]

log = logging.getLogger(__name__)

KERNEL_PACKAGE = "linux-image-cloud-amd64"
#: The modules a guest loads (their dependencies come along, ordered before them).
MODULES = ("virtio_mmio", "virtio_net", "virtio_console")
_LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
_LZ4_LEGACY_BLOCK = 8 << 20  # every block of the legacy format decompresses to at most 8 MiB
_DEPENDS_RE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9.+-]*)(?: \(= (?P<version>[^)]+)\))?")


class KernelError(RuntimeError):
    """The guest kernel could not be fetched, unpacked or read."""


@dataclass(frozen=True)
class Kernel:
    """A prepared guest kernel: where its ``vmlinux`` and modules are, and what it is."""

    directory: Path
    package: str
    version: str
    release: str  # ``uname -r`` of the guest
    modules: tuple[str, ...]  # module names, in load order

    @property
    def vmlinux(self) -> Path:
        """The uncompressed kernel QEMU boots (``-kernel``)."""
        return self.directory / "vmlinux"

    def module_path(self, name: str) -> Path:
        """The ``.ko`` file of one module."""
        return self.directory / "modules" / f"{name}.ko"

    @property
    def key(self) -> str:
        """What identifies this kernel in image and snapshot keys."""
        return f"{self.package}={self.version}"


def _run(argv: list[str], cwd: Path | None = None, timeout: float = 600.0) -> str:
    """Run a command; its stdout, or KernelError with its stderr's tail."""
    try:
        done = subprocess.run(  # noqa: S603 - fixed argv of apt/dpkg tools, no shell
            argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelError(f"{argv[0]} failed: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise KernelError(f"{' '.join(argv)} exited {done.returncode}: {' / '.join(tail)}")
    return done.stdout


def _deb_field(deb: Path, name: str) -> str:
    return _run(["dpkg-deb", "-f", str(deb), name]).strip()


def _newest(debs: Iterable[Path]) -> Path | None:
    found = sorted(debs, key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def fetch_debs(debs: Path, package: str = KERNEL_PACKAGE, *, download: bool = True) -> Path:
    """The versioned kernel package's ``.deb`` in ``debs``, downloaded with apt if missing.

    ``package`` is the metapackage (its ``Depends`` names the versioned one). Without
    ``download`` only what is already in ``debs`` is used (KernelError if nothing is).
    """
    debs.mkdir(parents=True, exist_ok=True)
    meta = _newest(debs.glob(f"{package}_*.deb"))
    if meta is None and download:
        log.info("downloading %s with apt-get into %s", package, debs)
        _run(["apt-get", "download", package], cwd=debs)
        meta = _newest(debs.glob(f"{package}_*.deb"))
    if meta is None:
        raise KernelError(f"no {package} package in {debs} (run: apt-get download {package})")
    depends = _deb_field(meta, "Depends")
    match = _DEPENDS_RE.match(depends.split(",")[0].strip())
    if match is None:
        raise KernelError(f"{meta.name}: unexpected Depends {depends!r}")
    name, version = match["name"], match["version"]
    pattern = f"{name}_{version.replace(':', '%3a')}_*.deb" if version else f"{name}_*.deb"
    real = _newest(debs.glob(pattern))
    if real is None and download:
        log.info("downloading %s %s with apt-get into %s", name, version or "", debs)
        _run(["apt-get", "download", f"{name}={version}" if version else name], cwd=debs)
        real = _newest(debs.glob(pattern))
    if real is None:
        raise KernelError(f"no {name} {version or ''} package in {debs}")
    return real


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed kernel inside a bzImage whose payload is LZ4 (legacy frames)."""
    import lz4.block

    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        raise KernelError("not a bzImage (no HdrS header)")
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    payload = bzimage[start : start + length]
    if payload[:4] != _LZ4_LEGACY_MAGIC:
        raise KernelError(f"the kernel's payload is not LZ4 (magic {payload[:4].hex()})")
    out, pos = bytearray(), 4
    # Blocks follow one another, each behind its 32-bit size; the payload ends with the
    # uncompressed size, which is not a block (a "block" that does not fit is the end).
    while pos + 4 <= len(payload):
        (size,) = struct.unpack_from("<I", payload, pos)
        if size == _LZ4_LEGACY_MAGIC_INT or pos + 4 + size > len(payload):
            break
        block = payload[pos + 4 : pos + 4 + size]
        try:
            out += lz4.block.decompress(block, uncompressed_size=_LZ4_LEGACY_BLOCK)
        except lz4.block.LZ4BlockError as exc:
            raise KernelError(f"corrupt LZ4 block at {pos}: {exc}") from None
        pos += 4 + size
    if out[:4] != b"\x7fELF":
        raise KernelError("the decompressed kernel is not an ELF file")
    return bytes(out)


_LZ4_LEGACY_MAGIC_INT = struct.unpack("<I", _LZ4_LEGACY_MAGIC)[0]


def modinfo(ko: bytes) -> dict[str, str]:
    """A kernel module's ``.modinfo`` section (``key=value`` strings) as a dict."""
    if ko[:4] != b"\x7fELF" or ko[4] != 2:
        raise KernelError("not a 64-bit ELF module")
    (shoff,) = struct.unpack_from("<Q", ko, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ko, 0x3A)

    def section(index: int) -> tuple[int, int, int]:
        base = shoff + index * shentsize
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", ko, base)
        return name, offset, size

    _, str_off, _ = section(shstrndx)
    for i in range(shnum):
        name_off, offset, size = section(i)
        end = ko.index(b"\0", str_off + name_off)
        if ko[str_off + name_off : end] == b".modinfo":
            info: dict[str, str] = {}
            for item in ko[offset : offset + size].split(b"\0"):
                key, sep, value = item.decode("utf-8", "replace").partition("=")
                if sep:
                    info.setdefault(key, value)
            return info
    return {}


def load_order(wanted: Iterable[str], find: dict[str, Path]) -> list[str]:
    """Module names to load, dependencies first, for the ``wanted`` modules.

    ``find`` maps a module name (``-`` and ``_`` alike) to its ``.ko`` file.
    """
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in order:
            return
        if name in visiting:
            raise KernelError(f"module dependency cycle at {name}")
        path = find.get(name)
        if path is None:
            raise KernelError(f"kernel module {name} not found")
        visiting.add(name)
        for dep in filter(None, modinfo(path.read_bytes()).get("depends", "").split(",")):
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


def _read(directory: Path) -> Kernel | None:
    try:
        meta = json.loads((directory / "kernel.json").read_text())
        kernel = Kernel(
            directory,
            str(meta["package"]),
            str(meta["version"]),
            str(meta["release"]),
            tuple(str(m) for m in meta["modules"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not kernel.vmlinux.is_file() or not all(
        kernel.module_path(m).is_file() for m in kernel.modules
    ):
        return None
    return kernel


def _unpack(deb: Path, into: Path, package: str, version: str) -> Kernel:
    """Unpack ``deb`` and keep its vmlinux and the guest's modules in ``into``."""
    with tempfile.TemporaryDirectory(prefix="unpack-", dir=into.parent) as scratch:
        root = Path(scratch)
        _run(["dpkg", "-x", str(deb), str(root)])
        images = sorted((root / "boot").glob("vmlinuz-*"))
        if not images:
            raise KernelError(f"{deb.name} holds no boot/vmlinuz-*")
        release = images[0].name.removeprefix("vmlinuz-")
        found = {
            p.name.removesuffix(".ko").replace("-", "_"): p
            for p in (root / "lib" / "modules" / release).rglob("*.ko")
        }
        order = load_order(MODULES, found)
        staging = Path(tempfile.mkdtemp(prefix="kernel-", dir=into.parent))
        try:
            (staging / "modules").mkdir()
            (staging / "vmlinux").write_bytes(extract_vmlinux(images[0].read_bytes()))
            for name in order:
                shutil.copyfile(found[name], staging / "modules" / f"{name}.ko")
            meta = {"package": package, "version": version, "release": release, "modules": order}
            (staging / "kernel.json").write_text(json.dumps(meta, indent=1))
            staging.rename(into)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    kernel = _read(into)
    if kernel is None:
        raise KernelError(f"unpacked kernel in {into} is incomplete")
    return kernel


def prepare_kernel(cache: Path, *, download: bool = True) -> Kernel:
    """The guest kernel, prepared in ``cache`` (fetched and unpacked only when missing)."""
    cache.mkdir(parents=True, exist_ok=True)
    with lock_file(cache / ".kernel.lock"):
        return _prepare(cache, download)


def _prepare(cache: Path, download: bool) -> Kernel:
    deb = fetch_debs(cache / "debs", download=download)
    package, version = _deb_field(deb, "Package"), _deb_field(deb, "Version")
    kernels = cache / "kernel"
    kernels.mkdir(exist_ok=True)
    into = kernels / f"{package}_{version.replace(':', '%3a')}"
    kernel = _read(into)
    if kernel is None:
        shutil.rmtree(into, ignore_errors=True)
        log.info("unpacking %s %s into %s", package, version, into)
        kernel = _unpack(deb, into, package, version)
    for other in kernels.iterdir():  # one kernel at a time: the one in use
        if other != into:
            with contextlib.suppress(OSError):
                shutil.rmtree(other) if other.is_dir() else other.unlink()
    keep = {deb, _newest((cache / "debs").glob(f"{KERNEL_PACKAGE}_*.deb"))}
    for old in (cache / "debs").glob("*.deb"):  # and only its packages
        if old not in keep:
            with contextlib.suppress(OSError):
                old.unlink()
    os.utime(into)
    return kernel


def main(argv: list[str] | None = None) -> int:
    """``python -m agents.qemu.kernel [--cache DIR]``: fetch and unpack the guest kernel now."""
    parser = argparse.ArgumentParser(
        prog="python -m agents.qemu.kernel",
        description=f"Fetch {KERNEL_PACKAGE} with apt-get and unpack it into the qemu "
        "driver's cache (what an agent would do on its first start).",
    )
    parser.add_argument("--cache", type=Path, default=None, help="default: the driver's")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        kernel = prepare_kernel(args.cache or default_cache())
    except KernelError as exc:
        print(f"error: {exc}", flush=True)
        return 1
    print(f"guest kernel {kernel.key} ({kernel.release}) in {kernel.directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
