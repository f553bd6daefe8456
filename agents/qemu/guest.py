"""The guest's runtime: runs inside every QEMU guest, after ``/init``, as the guest's PID 1.

The model
---------
One Python process per guest does three things, in order:

1. **load**: imports the function's module (``image.json``'s ``module``; the function's
   own top-level package is on ``sys.path``), so its imports are paid before a snapshot;
2. **wait for an identity** on the control port (a virtio serial port named ``corral``,
   whose other end is a unix socket only the agent holds), after saying ``loaded``. An
   agent may snapshot the guest here: it holds nothing of any replica yet, so every
   restored clone starts from the same blank state;
3. **take the identity and serve**: the agent sends one JSON line - the replica's
   environment (``VMID``, the report token, the function's variables), fresh random
   bytes and the host's time. The runtime replaces ``os.environ`` with it, credits the
   bytes to the kernel's pool and forces the kernel's CRNG to reseed (``RNDADDENTROPY``,
   ``RNDRESEEDCRNG``), reseeds Python's ``random``, sets the clock, answers
   ``identity``, and runs the module as ``__main__`` (``python -m MODULE``, as the
   process driver runs it): the function binds its port now, with its own identity.

Restored clones share everything from before step 3 (their uptime, Python's hash seed);
from step 3 on each has its own variables, kernel randomness and clock.

Standard library only, and nothing from ``agents``: this file is copied into the guest
image on its own. A failure before serving exits, and the guest's kernel then powers the
VM off (``panic=-1`` with ``-no-reboot``): a guest that cannot serve is a VM gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import random
import runpy
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

CONFIG = "/corral/image.json"
PORT_NAME = "corral"
#: Longest line the agent may send (the environment is bounded by the agent as well).
MAX_LINE = 1 << 20
# linux/random.h: _IOW('R', 0x03, int[2]) and _IO('R', 0x07)
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207


def control_port(name: str = PORT_NAME, wait: float = 30.0) -> str:
    """The device of the virtio serial port called ``name`` (it may appear a moment late)."""
    deadline = time.monotonic() + wait
    while True:
        for entry in sorted(Path("/sys/class/virtio-ports").glob("*")):
            with contextlib.suppress(OSError):
                if (entry / "name").read_text().strip() == name:
                    return f"/dev/{entry.name}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"no virtio serial port named {name!r}")
        time.sleep(0.01)


def send(fd: int, message: dict[str, object]) -> None:
    """Write one JSON line to the agent."""
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def read_line(fd: int) -> bytes:
    """One line from the agent; waits while the agent is not connected (reads give EOF)."""
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(fd, 65536)
        if not chunk:  # the agent's end is closed (as after a restore): wait for it
            time.sleep(0.005)
            continue
        buf += chunk
        if len(buf) > MAX_LINE:
            raise RuntimeError("control line too long")
    return buf.split(b"\n", 1)[0]


def reseed(seed: bytes) -> None:
    """Credit ``seed`` to the kernel's entropy pool, reseed its CRNG and Python's ``random``."""
    with open("/dev/urandom", "wb") as urandom:
        info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
        fcntl.ioctl(urandom, RNDADDENTROPY, info)
        with contextlib.suppress(OSError):  # kernels before 4.17
            fcntl.ioctl(urandom, RNDRESEEDCRNG)
    random.seed()


def announce(interface: str = "eth0") -> None:
    """Broadcast a gratuitous ARP for this guest's address on ``interface``.

    QEMU's user-mode network learns the guest's MAC address from it: a restored guest is
    unknown to the new QEMU's network, which would otherwise hold the first forwarded
    connection until its own ARP and TCP retries (a second or more).
    """
    ip = bytes(int(part) for part in os.environ.get("GUEST_IP", "10.0.2.15").split("."))
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as raw:
        raw.bind((interface, 0))
        mac = raw.getsockname()[4][:6]
        frame = b"\xff" * 6 + mac + b"\x08\x06"  # broadcast, ARP
        frame += b"\x00\x01\x08\x00\x06\x04\x00\x01" + mac + ip + b"\x00" * 6 + ip
        raw.send(frame)


def take_identity(message: dict[str, object]) -> None:
    """Become the replica ``message`` describes: environment, randomness, clock."""
    env = message.get("env")
    seed = message.get("seed")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise RuntimeError("identity without an environment")
    if not isinstance(seed, str):
        raise RuntimeError("identity without a seed")
    os.environ.clear()
    os.environ.update(env)
    reseed(bytes.fromhex(seed))
    at = message.get("time")
    if isinstance(at, int | float):
        with contextlib.suppress(OSError):
            time.clock_settime(time.CLOCK_REALTIME, float(at))


def _uptime() -> float:
    with contextlib.suppress(OSError, ValueError):
        return float(Path("/proc/uptime").read_text().split()[0])
    return 0.0


def main() -> int:
    """Load the function, wait for an identity, then run the function as ``__main__``."""
    config = json.loads(Path(CONFIG).read_text())
    module = str(config["module"])
    sys.path[:0] = [str(p) for p in config["path"]]
    fd = os.open(control_port(), os.O_RDWR)
    try:
        importlib.import_module(module)
    except BaseException:
        send(fd, {"event": "failed", "error": traceback.format_exc(limit=8)[-4000:]})
        raise
    send(fd, {"event": "loaded", "uptime": _uptime()})
    message = json.loads(read_line(fd))
    take_identity(message)
    with contextlib.suppress(OSError):
        announce()
    send(fd, {"event": "identity", "vmid": os.environ.get("VMID", "")})
    os.close(fd)
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)
