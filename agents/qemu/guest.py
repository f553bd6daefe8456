"""The guest's runtime: runs inside every QEMU guest, after ``/init``, as the guest's PID 1.

The model
---------
One Python process per guest runs the function, in two steps the agent drives over the
control port (a virtio serial port named ``corral``, whose other end is a unix socket
only the agent holds; one JSON object per line each way):

1. **start**: the agent sends the function's environment (its variables, ``PORT``,
   ``HOST``: what every replica of the build shares). The runtime sets it and runs the
   function's module as ``__main__`` (``python -m MODULE``, as the process driver runs
   it), and says ``listening`` when the function listens on ``PORT`` (Python's
   ``socket.socket.listen`` is wrapped to notice). The agent probes the port; once it
   answers, the agent may **snapshot** the guest: a serving function that has been
   given nothing of any replica yet;
2. **identity**: the agent sends what is the replica's own - ``VMID``, the report token
   and registry, fresh random bytes, the host's time. A thread of the runtime (it waits
   for this line while the function serves) adds the variables to ``os.environ``,
   credits the bytes to the kernel's pool and forces its CRNG to reseed
   (``RNDADDENTROPY``, ``RNDRESEEDCRNG``), reseeds Python's ``random``, sets the clock,
   announces the guest's address on the network (a gratuitous ARP, so that the QEMU a
   snapshot was restored into learns it at once) and answers ``identity``.

A replica restored from the snapshot resumes at step 2: its function is already
serving, only its identity is new. So a function reads its replica's identity
(``VMID``...) when it handles a request, not when it starts; whatever it made at start
(its own random keys, say) every replica restored from the snapshot shares, as with
Lambda SnapStart. Python's hash seed is the snapshot's too.

Standard library only, and nothing from ``agents``: this file is copied into the guest
image on its own. A failure before serving exits, and the guest's kernel then powers the
VM off (``panic=-1`` with ``-no-reboot``): a guest that cannot serve is a VM gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import runpy
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path

CONFIG = "/corral/image.json"
PORT_NAME = "corral"
#: Longest line the agent may send (an environment is bounded by the agent as well).
MAX_LINE = 4 << 20
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


class Control:
    """The guest's end of the control port: JSON lines."""

    def __init__(self, path: str) -> None:
        """Open the port."""
        self.fd = os.open(path, os.O_RDWR)
        self._buf = b""
        self._lock = threading.Lock()

    def send(self, message: dict[str, object]) -> None:
        """Write one JSON line to the agent."""
        data = (json.dumps(message) + "\n").encode()
        with self._lock:
            while data:
                data = data[os.write(self.fd, data) :]

    def receive(self) -> dict[str, object]:
        """The next JSON object from the agent; waits while the agent is not connected (its
        reads give EOF then, as just after a restore)."""
        while b"\n" not in self._buf:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                time.sleep(0.005)
                continue
            self._buf += chunk
            if len(self._buf) > MAX_LINE:
                raise RuntimeError("control line too long")
        line, self._buf = self._buf.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise RuntimeError("control message is not an object")
        return message


def _strings(value: object, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise RuntimeError(f"{what} without an environment")
    return value


def reseed(seed: bytes) -> None:
    """Credit ``seed`` to the kernel's entropy pool, reseed its CRNG and Python's ``random``
    (from the seed itself: no further read of the kernel's generator)."""
    with open("/dev/urandom", "wb") as urandom:
        info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
        fcntl.ioctl(urandom, RNDADDENTROPY, info)
        with contextlib.suppress(OSError):  # kernels before 4.17
            fcntl.ioctl(urandom, RNDRESEEDCRNG)
    random.seed(seed)


class Announcer:
    """Broadcasts gratuitous ARPs for this guest's address on ``interface``.

    QEMU's user-mode network learns the guest's MAC address from one: a restored guest is
    unknown to the new QEMU's network, which would otherwise hold the first forwarded
    connection until its own ARP and TCP retries (a second or more). The socket and the
    frame are made at start, before any snapshot: after a restore only ``send`` runs.
    """

    def __init__(self, interface: str = "eth0") -> None:
        """Open a raw socket on ``interface`` and build the frame."""
        ip = bytes(int(part) for part in os.environ.get("GUEST_IP", "10.0.2.15").split("."))
        self.raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        self.raw.bind((interface, 0))
        mac = self.raw.getsockname()[4][:6]
        self.frame = b"\xff" * 6 + mac + b"\x08\x06"  # broadcast, ARP
        self.frame += b"\x00\x01\x08\x00\x06\x04\x00\x01" + mac + ip + b"\x00" * 6 + ip

    def announce(self) -> None:
        """Send the gratuitous ARP."""
        self.raw.send(self.frame)


def take_identity(message: dict[str, object], announcer: Announcer | None) -> None:
    """Become the replica ``message`` describes: its variables, randomness, clock; then say
    where it is on the network."""
    env = _strings(message.get("env"), "identity")
    seed = message.get("seed")
    if not isinstance(seed, str):
        raise RuntimeError("identity without a seed")
    os.environ.update(env)
    reseed(bytes.fromhex(seed))
    at = message.get("time")
    if isinstance(at, int | float):
        with contextlib.suppress(OSError):
            time.clock_settime(time.CLOCK_REALTIME, float(at))
    if announcer is not None:
        with contextlib.suppress(OSError):
            announcer.announce()


def identities(control: Control) -> None:
    """Wait for the replica's identity (now, or after a restore), take it and say so."""
    announcer = None
    with contextlib.suppress(OSError):
        announcer = Announcer()
    try:
        message = control.receive()
        take_identity(message, announcer)
        control.send({"event": "identity", "vmid": os.environ.get("VMID", "")})
    except BaseException:
        with contextlib.suppress(OSError):
            control.send({"event": "failed", "error": traceback.format_exc(limit=4)[-2000:]})
        os._exit(1)  # a guest without its identity must not serve


def tell_when_listening(control: Control, port: int) -> None:
    """Say ``listening`` once this process listens on TCP ``port``.

    Python's ``socket.socket.listen`` is wrapped: the first socket that listens on
    ``port`` (``http.server``, ``asyncio``... all listen through it) sends the event.
    Polling ``/proc/net/tcp`` instead would cost the guest's one CPU more than the
    function's own start.
    """
    original = socket.socket.listen
    told = threading.Event()

    def listen(self: socket.socket, *args: int) -> None:
        original(self, *args)
        with contextlib.suppress(OSError, IndexError, TypeError):
            if not told.is_set() and self.getsockname()[1] == port:
                told.set()
                control.send({"event": "listening", "port": port})

    socket.socket.listen = listen  # type: ignore[assignment,method-assign]


def main() -> int:
    """Take the function's environment, run it as ``__main__``; the identity comes aside."""
    config = json.loads(Path(CONFIG).read_text())
    module = str(config["module"])
    sys.path[:0] = [str(p) for p in config["path"]]
    control = Control(control_port())
    try:
        start = control.receive()
        os.environ.clear()
        os.environ.update(_strings(start.get("env"), "start"))
        tell_when_listening(control, int(os.environ.get("PORT") or 8080))
        threading.Thread(target=identities, args=(control,), daemon=True).start()
        sys.argv = [module]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            control.send({"event": "failed", "error": traceback.format_exc(limit=8)[-4000:]})
        raise
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
