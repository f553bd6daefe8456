"""The cheapest proxy, as a floor for the gateway: ``bench/relay.c`` built and started.

A proxy between callers and replicas pays, whatever it is written in, a read and a
write each way a request on the cores it shares with them. ``bench/relay.c`` pays
nothing else: a TCP relay on loopback (epoll, one thread) that gives every accepted
connection an upstream connection of its own, to the replicas in turn, and copies
bytes without looking at them. Measured beside direct calls, it shows what any proxy
keeps of direct throughput on this machine; the gateway measured beside it shows how
far the gateway is from that floor.

:func:`build` compiles it with the C compiler ``cc`` when there is one (nothing
requires one: without it, or when the build fails, it says why and the benchmark
runs without the relay); :func:`start` runs it on a free loopback port.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from netplumb.addresses import parse_url

SOURCE = Path(__file__).resolve().with_name("relay.c")
CFLAGS = ["-O2", "-Wall", "-Wextra"]


def build(into: Path) -> tuple[Path | None, str]:
    """The relay compiled into ``into`` and "" - or None and why it could not be."""
    cc = shutil.which("cc")
    if cc is None:
        return None, "no C compiler (cc) on PATH"
    binary = into / "relay"
    done = subprocess.run(
        [cc, *CFLAGS, "-o", str(binary), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        return None, f"cc failed ({done.returncode}): {done.stderr.strip()[:500]}"
    return binary, ""


@dataclass
class Relay:
    """A running relay: its process and the URL it takes requests on."""

    proc: subprocess.Popen[bytes]
    url: str


def start(binary: Path, replicas: list[str], log: Path) -> Relay:
    """Run the relay on a free 127.0.0.1 port in front of ``replicas`` (``http://HOST:PORT``)."""
    upstreams = []
    for address in replicas:
        upstreams.append(parse_url(address, {"http": 80}, "replica address").hostport)
    with log.open("wb") as errors:
        proc = subprocess.Popen(
            [str(binary), "127.0.0.1:0", *upstreams], stdout=subprocess.PIPE, stderr=errors
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode(errors="replace").strip()  # "listening on HOST:PORT"
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        why = log.read_text(errors="replace").strip() or repr(line)
        raise RuntimeError(f"the relay did not start: {why}")
    return Relay(proc, f"http://{line.removeprefix('listening on ')}/")
