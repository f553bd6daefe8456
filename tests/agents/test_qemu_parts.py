"""The qemu driver's parts, without booting a guest: the snapshot store's keys and bounds,
the kernel's extraction, the image's contents, the control port's bounds, the KVM probe."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.qemu.control import Control, StartFailed
from agents.qemu.image import ImageCache, Runtime
from agents.qemu.kernel import (
    Kernel,
    KernelError,
    extract_vmlinux,
    load_order,
    modinfo,
    prepare_kernel,
)
from agents.qemu.machine import Qemu, probe_accel
from agents.qemu.snapshots import SnapshotKey, Snapshots

KEY = SnapshotKey(
    build="b1",
    env="e1",
    kernel="linux-image=1",
    qemu="QEMU 7.2",
    accel="tcg",
    cpu_model="max",
    mem_mb=256,
    cpus=1,
    append="console=ttyS0",
)


def _publish(store: Snapshots, slot: str, key: SnapshotKey, data: bytes = b"state") -> Path:
    with store.taking(slot, key) as staging:
        assert staging is not None
        staging.write_bytes(data)
        return store.publish(slot, key, staging)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"build": "b2"}, "another build of the function"),
        ({"kernel": "linux-image=2"}, "another kernel"),
        ({"qemu": "QEMU 8.2"}, "another QEMU"),
        ({"mem_mb": 512}, "another machine (mem_mb)"),
        ({"devices": "virtio-net-device"}, "another machine (devices)"),
    ],
)
def test_a_snapshot_under_another_key_is_refused_counted_and_deleted(
    tmp_path: Path, change: dict[str, object], reason: str
) -> None:
    store = Snapshots(tmp_path)
    state = _publish(store, "fn@256m1c", KEY)
    assert store.find("fn@256m1c", KEY) == state  # the same key: restored
    other = dataclasses.replace(KEY, **change)  # type: ignore[arg-type]
    assert store.find("fn@256m1c", other) is None
    assert store.stats()["refused"] == {reason: 1}
    assert not state.exists()  # never restored later either
    assert store.find("fn@256m1c", KEY) is None


def test_one_snapshot_per_key_is_taken_at_a_time_and_none_once_it_exists(tmp_path: Path) -> None:
    store = Snapshots(tmp_path)
    with store.taking("fn@256m1c", KEY) as first:
        assert first is not None
        with Snapshots(tmp_path).taking("fn@256m1c", KEY) as second:  # another process's
            assert second is None
        first.write_bytes(b"state")
        store.publish("fn@256m1c", KEY, first)
    with store.taking("fn@256m1c", KEY) as again:
        assert again is None  # taken already
    assert [p.name for p in (tmp_path / "snapshots" / "fn@256m1c").iterdir() if p.is_dir()] == [
        KEY.digest()
    ]


def test_the_store_keeps_the_most_recently_used_snapshots_within_its_bounds(
    tmp_path: Path,
) -> None:
    store = Snapshots(tmp_path, max_snapshots=2, max_bytes=10_000)
    old = _publish(store, "a@256m1c", KEY, b"x" * 100)
    other = _publish(store, "b@256m1c", KEY, b"x" * 100)
    os.utime(old.with_name("meta.json"), (1000, 1000))  # a used long ago, b since
    os.utime(other.with_name("meta.json"), (2000, 2000))
    assert store.find("a@256m1c", KEY) == old  # a restore makes it recent
    _publish(store, "c@256m1c", KEY, b"x" * 100)
    assert store.find("b@256m1c", KEY) is None  # the least recently used went
    assert store.find("a@256m1c", KEY) is not None and store.find("c@256m1c", KEY) is not None
    _publish(store, "d@256m1c", KEY, b"x" * 20_000)  # alone over the byte bound: not kept
    assert store.find("d@256m1c", KEY) is None


def test_what_a_killed_taker_left_is_overwritten_or_removed(tmp_path: Path) -> None:
    store = Snapshots(tmp_path)
    slot = tmp_path / "snapshots" / "fn@256m1c"
    slot.mkdir(parents=True)
    left = slot / f".{KEY.digest()}.staging"  # a taker of KEY killed mid-write
    left.write_bytes(b"x" * 1000)
    half = slot / ".new-abc"  # one killed while publishing another key
    half.mkdir()
    other = dataclasses.replace(KEY, build="b0")
    stale = slot / f".{other.digest()}.staging"
    stale.write_bytes(b"x" * 1000)
    for path in (half, stale):
        os.utime(path, (1000, 1000))
    with store.taking("fn@256m1c", KEY) as staging:
        assert staging == left and staging.read_bytes() == b""  # overwritten, not kept beside
        staging.write_bytes(b"state")
        store.publish("fn@256m1c", KEY, staging)
    assert not left.exists() and not half.exists() and not stale.exists()
    assert store.find("fn@256m1c", KEY) is not None


def test_a_file_that_is_not_a_bzimage_is_refused() -> None:
    with pytest.raises(KernelError, match="not a bzImage"):
        extract_vmlinux(b"\x7fELF" + b"\0" * 4096)


@pytest.fixture(scope="module")
def kernel(qemu_cache: Path) -> Kernel:
    """The guest kernel, prepared in the shared cache."""
    return prepare_kernel(qemu_cache)


def test_the_kernel_is_an_elf_and_its_modules_load_after_what_they_need(kernel: Kernel) -> None:
    with open(kernel.vmlinux, "rb") as fh:
        assert fh.read(4) == b"\x7fELF"
    order = list(kernel.modules)
    assert {"virtio_mmio", "virtio_net", "virtio_console"} <= set(order)
    for module, needs in (
        ("virtio_net", ("virtio", "virtio_ring", "net_failover")),
        ("net_failover", ("failover",)),
        ("virtio_mmio", ("virtio", "virtio_ring")),
    ):
        assert all(order.index(n) < order.index(module) for n in needs), order
    found = {m: kernel.module_path(m) for m in order}
    loaded = load_order(["virtio_net"], found)
    # any order that puts each module after what it needs: virtio and virtio_ring need
    # nothing, and a kernel's virtio_net may name them in either order (6.1.176: ring first)
    assert sorted(loaded) == sorted(
        ["virtio", "virtio_ring", "failover", "net_failover", "virtio_net"]
    )
    for module in loaded:
        depends = modinfo(found[module].read_bytes()).get("depends", "")
        assert all(
            loaded.index(n.replace("-", "_")) < loaded.index(module)
            for n in filter(None, depends.split(","))
        ), (module, loaded)


def _cpio_names(data: bytes) -> list[str]:
    """The names in a sequence of gzip-compressed newc cpio archives."""
    raw = b""
    while data:
        z = zlib.decompressobj(31)
        raw += z.decompress(data)
        data = z.unused_data
    names, pos = [], 0
    while pos < len(raw):
        header = raw[pos : pos + 110]
        assert header[:6] == b"070701"
        size, namesize = int(header[54:62], 16), int(header[94:102], 16)
        name = raw[pos + 110 : pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        pos += size + (-size % 4)
        if name != "TRAILER!!!":
            names.append(name)
    return names


def test_an_image_holds_the_runtime_and_the_function_and_is_keyed_by_its_files(
    kernel: Kernel, qemu_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = ImageCache(qemu_cache, kernel, Runtime.find())
    image = images.image("examples.hello")
    names = _cpio_names(image.initrd.read_bytes())
    for needed in ("init", "bin/busybox", "corral/guest.py", "corral/image.json"):
        assert needed in names
    assert "corral/fn/examples/hello.py" in names and "corral/fn/examples/_http.py" in names
    python = str(images.runtime.python).lstrip("/")
    assert python in names
    stdlib = [n for n in names if n.startswith(str(images.runtime.stdlib).lstrip("/") + "/")]
    assert any(n.endswith("/json/__init__.pyc") for n in stdlib)
    assert not [n for n in stdlib if n.endswith(".py")]  # compiled only
    assert not [n for n in stdlib if "/test/" in n or "site-packages" in n or "idlelib" in n]

    # a function of its own: one byte changed is another build
    (tmp_path / "corral_keyed.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = images.image("corral_keyed")
    (tmp_path / "corral_keyed.py").write_text("X = 2\n")
    second = images.image("corral_keyed")
    assert first.key != second.key and first.initrd.exists() and second.initrd.exists()
    assert images.image("corral_keyed").key == second.key  # built once per key


@pytest.fixture
def control_path(tmp_path: Path) -> Iterator[tuple[Path, list[socket.socket]]]:
    """A unix socket standing in for a guest's control port; the connections it accepted."""
    path = Path(f"/tmp/corral-ctl-{id(tmp_path)}.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
    thread.start()
    yield path, accepted
    for conn in accepted:
        conn.close()
    server.close()
    path.unlink(missing_ok=True)


def test_a_guest_that_floods_its_control_port_fails_its_start(
    control_path: tuple[Path, list[socket.socket]],
) -> None:
    path, accepted = control_path
    control = Control(path, time.monotonic() + 5)
    try:
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        guest = accepted[0]
        guest.sendall(b'{"noise": 1}\nnot json\n{"event": "other"}\n{"event": "listening"}\n')
        got = control.event("listening", time.monotonic() + 5, lambda: True)
        assert got == {"event": "listening"}
        guest.sendall(b'{"event": "failed", "error": "Traceback \\u001b[31m..."}\n')
        with pytest.raises(StartFailed, match="the function failed: Traceback \\?"):
            control.event("identity", time.monotonic() + 5, lambda: True)
        guest.sendall(b"x" * (200 * 1024))  # no line end: never an event
        with pytest.raises(StartFailed, match="overlong"):
            control.event("identity", time.monotonic() + 5, lambda: True)
    finally:
        control.close()


def test_kvm_is_chosen_only_where_a_guest_boots_with_it_and_the_answer_is_kept(
    kernel: Kernel, tmp_path: Path
) -> None:
    qemu = Qemu.find()
    busybox = Runtime.find().busybox
    accel, why = probe_accel(tmp_path, qemu, kernel, busybox, timeout=8.0)
    assert accel in ("kvm", "tcg")
    assert ("booted" in why) == (accel == "kvm"), why
    saved = json.loads((tmp_path / "accel.json").read_text())
    assert saved["accel"] == accel
    again, why_again = probe_accel(tmp_path, qemu, kernel, busybox, timeout=8.0)
    assert again == accel and "probed earlier this boot" in why_again
