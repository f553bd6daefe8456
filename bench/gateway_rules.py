"""What each part of corral's HAProxy configuration costs a warm request, in HAProxy's CPU.

Run: ``python -m bench.gateway_rules [--rounds 8] [--seconds 2] [--connections 16]
[--replicas 4] [--envs 4]``

Every variant is an ``haproxy -db`` of its own (:class:`workers.gateway.haproxy.process.Process`)
on the configuration the gateway writes (:func:`workers.gateway.haproxy.config.write`,
this machine's settings), with ``hello`` in its function map and the same replicas
(``examples.hello`` processes) added to its backend by the router's own command
(:func:`workers.gateway.haproxy.router.add_server`), or that configuration with one
part taken out or changed; **bare** is the outside baseline, a frontend straight to the
same backend (``balance first``, keep-alive, connection reuse) and nothing else. No
gateway runs: HAProxy alone is measured.

Each round runs ``wrk`` (``--connections``, ``--seconds``) against each variant in
turn, the order reversed every other round, and reads each HAProxy's CPU time (user and
system, from ``/proc``) over its run: CPU microseconds a request. On a shared machine a
single figure moves with everyone else's load, so each variant is also compared with
**corral** in the same round: it prints each variant's median, and the median (and
quartiles) of its per-round difference from corral's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.gateway import _listening
from bench.options import add_counts
from config.settings import get_settings
from testkit.services import free_port
from workers.gateway.haproxy import config
from workers.gateway.haproxy.layout import Layout
from workers.gateway.haproxy.process import Process, Unavailable, find
from workers.gateway.haproxy.router import add_server
from workers.gateway.haproxy.runtime import DONE, Commands

FUNCTION = "hello"
Edit = Callable[[str], str]


def _drop(*patterns: str) -> Edit:
    """The configuration without the lines any of ``patterns`` matches."""

    def edit(text: str) -> str:
        keep = [line for line in text.splitlines() if not any(re.search(p, line) for p in patterns)]
        return "\n".join(keep) + "\n"

    return edit


def _sub(pattern: str, replacement: str) -> Edit:
    """The configuration with ``pattern`` (a line's regex) replaced."""
    return lambda text: re.sub(pattern, replacement, text, flags=re.M)


def _bare(text: str) -> str:
    """The outside baseline: the runtime socket, a frontend, the backend; nothing else."""
    admin = re.search(r"^  stats socket (\S+)", text, re.M)
    bind = re.search(r"^  bind (fd@\d+)", text, re.M)
    if admin is None or bind is None:
        raise RuntimeError("the configuration has no runtime socket or listener")
    return (
        "global\n"
        f"  stats socket {admin[1]} mode 600 level admin\n"
        "  nbthread 1\n"
        "defaults\n"
        "  mode http\n  option http-keep-alive\n  http-reuse always\n"
        "  timeout connect 5s\n  timeout client 30s\n  timeout server 60s\n"
        f"frontend gateway\n  bind {bind[1]}\n  default_backend {config.backend(0)}\n"
        f"backend {config.backend(0)}\n  balance first\n"
    )


def _no_frontend_rules(text: str) -> str:
    """No warm test (header names, Connection, bodies) and no activator headers."""
    text = _drop(
        r"^  http-request (set-var\(txn\.(cold|size|got)\)|wait-for-body|set-header x-corral)",
        r"^  acl (body|cold) ",
    )(text)
    return _sub(r" if !cold$", " if warm")(text)


# name -> what the variant changes (corral's configuration as it is: the identity)
VARIANTS: dict[str, Edit] = {
    "corral": lambda text: text,
    "bare": _bare,
    "no per-peer table": _drop(r"^  tcp-request connection "),
    "no warm test": _no_frontend_rules,
    "no forwarding rules": _drop(
        r"^  http-request (set-var\(txn\.over\)|set-header x-|del-header|set-timeout|set-path)",
        r"^  http-response ",
        r"^  use-server ",
    ),
    "no Lua": _drop(r"^  lua-load ", r" lua\.corral_"),
    "bufsize 16 KiB": _sub(r"^  tune\.bufsize \d+$", "  tune.bufsize 16384"),
    "L7 retries": _sub(
        r"^  option redispatch 1$",
        "  option redispatch 1\n  retry-on conn-failure empty-response\n"
        "  http-request disable-l7-retry if !{ method GET HEAD OPTIONS PUT DELETE TRACE }",
    ),
    "nbthread 2": _sub(r"^  nbthread \d+$", "  nbthread 2"),
}


@dataclass
class Variant:
    """One HAProxy on one variant of the configuration, and what its runs cost."""

    name: str
    process: Process
    port: int
    us: list[float] = field(default_factory=list)  # CPU microseconds a request, by round
    rps: list[float] = field(default_factory=list)


def _start(name: str, edit: Edit, tmp: Path, replicas: list[int], envs: int) -> Variant:
    """HAProxy on the edited configuration, its backend given the replicas."""
    layout = Layout(tmp / re.sub(r"\W+", "-", name))
    layout.dir.mkdir(mode=0o700)
    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    listen.listen(1024)
    config.write(get_settings(), layout)
    layout.config.write_text(edit(layout.config.read_text()))
    layout.functions.write_text(f"{FUNCTION} {config.backend(0)}\n")
    process = Process(find(get_settings().gateway_haproxy), layout, listen)
    process.start()
    commands = Commands(layout.admin)
    try:
        for port in replicas:
            server = f"127.0.0.1:{port}"
            for answer in commands.ask(
                add_server(config.backend(0), server, envs),
                f"set server {config.backend(0)}/{server} state ready",
            ):
                if answer.strip() not in DONE:
                    raise RuntimeError(f"{name}: HAProxy refused a server: {answer}")
    finally:
        commands.close()
    return Variant(name, process, listen.getsockname()[1])


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _wrk(port: int, connections: int, seconds: int) -> tuple[int, float, int]:
    """One wrk run: requests, requests/s, errors."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed (apt-get install wrk)")
    out = subprocess.run(
        [
            wrk,
            f"-t{min(connections, 4)}",
            f"-c{connections}",
            f"-d{seconds}s",
            f"http://127.0.0.1:{port}/function/{FUNCTION}",
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        check=True,
    ).stdout
    sent = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if sent is None or rps is None:
        raise RuntimeError(f"cannot read wrk's output:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad[1]) if bad else 0) + (sum(map(int, errs.groups())) if errs else 0)
    return int(sent[1]), float(rps[1]), errors


@contextlib.contextmanager
def _replicas(count: int, tmp: Path) -> Iterator[list[int]]:
    """``count`` hello replicas, each a process on a port of its own."""
    procs, ports = [], []
    try:
        for i in range(count):
            ports.append(free_port())
            with (tmp / f"replica-{i}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "examples.hello"],
                        env={**os.environ, "PORT": str(ports[-1])},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        for port in ports:
            _listening("127.0.0.1", port)
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    low, mid, high = statistics.quantiles(values, n=4)
    return low, mid, high


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway_rules",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_counts(
        parser,
        {
            "--rounds": (8, "rounds: each variant once a round"),
            "--seconds": (2, "seconds of each wrk run"),
            "--connections": (16, "wrk's connections"),
            "--replicas": (4, "hello replicas"),
            "--envs": (4, "environments lent on each replica (its server's maxconn)"),
        },
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the variants and print what each costs."""
    args = _parse(argv)
    if shutil.which("wrk") is None:
        print("bench.gateway_rules needs wrk (apt-get install wrk)")
        return 1
    try:
        find(get_settings().gateway_haproxy)
    except Unavailable as exc:
        print(f"bench.gateway_rules needs HAProxy: {exc}")
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-rules-"))
    variants: list[Variant] = []
    try:
        with _replicas(args.replicas, tmp) as ports:
            for name, edit in VARIANTS.items():
                variants.append(_start(name, edit, tmp, ports, args.envs))
            for variant in variants:  # connections to the replicas made, caches warm
                _wrk(variant.port, args.connections, 1)
            for round_ in range(args.rounds):
                for variant in variants if round_ % 2 == 0 else variants[::-1]:
                    assert variant.process.pid is not None
                    before = _cpu(variant.process.pid)
                    sent, rps, errors = _wrk(variant.port, args.connections, args.seconds)
                    if errors:
                        raise RuntimeError(f"{variant.name}: {errors} of {sent} calls failed")
                    variant.us.append((_cpu(variant.process.pid) - before) * 1e6 / sent)
                    variant.rps.append(rps)
        _report(args, variants)
        return 0
    finally:
        for variant in variants:
            variant.process.kill()
            variant.process.listen.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _report(args: argparse.Namespace, variants: list[Variant]) -> None:
    print(
        f"HAProxy's CPU a warm request, by variant of corral's configuration: {args.rounds} "
        f"rounds of wrk -c{args.connections} for {args.seconds} s each, {args.replicas} "
        f"hello replicas x {args.envs}; load average {os.getloadavg()[0]:.2f}"
    )
    corral = variants[0]
    for variant in variants:
        line = (
            f"  {variant.name:<20} {statistics.median(variant.us):6.1f} us a request   "
            f"{statistics.median(variant.rps):7.0f} req/s"
        )
        if variant is not corral:
            diffs = [a - b for a, b in zip(variant.us, corral.us, strict=True)]
            low, mid, high = _quartiles(diffs)
            line += f"   vs corral {mid:+6.1f} us (quartiles {low:+.1f} .. {high:+.1f})"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
