"""Hosts made of network namespaces: one machine, many addresses, and cables to pull.

The model
---------
A *run* owns a set of Linux network namespaces, all named ``corral-pt-<run>-<host>``
(``<run>`` is the harness's process id, so a run finds its own leftovers and never
another run's):

* a **switch** namespace (``...-sw``) holding one bridge, ``br0``, with no address;
* one namespace per **host**, joined to the bridge by a veth pair (``eth0`` inside the
  host, ``v-<host>`` on the switch), with its address in :data:`SUBNET` and no route
  anywhere else. A host may hold more addresses on its link (an agent's replica
  network) and routes to other hosts' replica networks.

Nothing is made in the namespace the harness started in: no link, no address, no route.
No packet can leave the namespaces, and one ``ip netns del`` per namespace removes
every link (the veths go with their namespaces).

**Faults on the wire** (every one undone by :meth:`Network.heal`):

* :meth:`Network.link` takes a host's cable out (its switch port down) and back;
* :meth:`Network.block` drops, on a host's way out, what goes to one peer: everything
  (with a block each way, a symmetric partition), only new connections (``syn_only``:
  the peer still reaches it, it cannot reach the peer), or the answers of its own
  listeners (``sports``: it reaches everyone, no one reaches it). The machine has no
  netfilter, so a block is a ``tc`` u32 filter on ``eth0``'s egress (``clsact``) that
  redirects the packet to ``blk0``, a veth left down: the kernel drops it, silently,
  as a cut cable would.

**Processes in hosts.** A socket belongs to the network namespace of the thread that
made it, so the harness enters a host's namespace for one thread (``setns``), starts a
process there (the child inherits it), and comes back. Every process is started by one
long-lived thread (:class:`Launcher`) with ``PR_SET_PDEATHSIG``: it dies with that
thread, so nothing outlives the harness even if the harness is SIGKILLed. The harness's
own thread (producers, checker) lives in the ``ctl`` host (:meth:`Network.move_here`).

:func:`cleanup` removes a run's namespaces, first killing every process still inside
them; :func:`cleanup_stale` does it for every run whose harness is gone (no process
with its pid, or one that started after its namespaces were made: the pid was reused).
A run calls it as it starts, and ``python -m bench.partition --cleanup`` does only
that: Ctrl-C, SIGTERM and failures are torn down by the run itself, a SIGKILL or the
OOM killer cannot be, and the next run (or ``--cleanup``) removes what it left.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.services import setpriv

PREFIX = "corral-pt"
NETNS_DIR = Path("/var/run/netns")
SUBNET = "10.231.0.0/24"
CLONE_NEWNET = 0x40000000
_NAME = re.compile(rf"^{PREFIX}-(\d+)-([a-z0-9]+)$")
_libc = ctypes.CDLL(None, use_errno=True)


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if not any(Path(d, tool).exists() for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin")):
            return f"no `{tool}` (iproute2) on this machine"
    return None


def _run(*argv: str, check: bool = True) -> str:
    """Run one ``ip`` / ``tc`` command; raise with its error when ``check``."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Host:
    """One host: its name (``[a-z0-9]``, at most 10), address, and what else it holds."""

    name: str
    ip: str
    addresses: tuple[str, ...] = ()  # more addresses on its link, as CIDR
    routes: tuple[tuple[str, str], ...] = ()  # (network, via)
    ns: str = ""


@dataclass(frozen=True)
class Block:
    """Filters in place on ``host``'s egress (their preference numbers), and what they drop."""

    host: str
    prefs: tuple[int, ...]
    what: str


@dataclass
class Network:
    """The switch and the hosts of one run, and the faults done to their links."""

    run: str
    hosts: dict[str, Host] = field(default_factory=dict)
    _blocks: dict[int, Block] = field(default_factory=dict)
    _down: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next_pref: int = 10
    _home: str = ""

    def ns(self, host: str) -> str:
        """The namespace name of ``host`` (``sw`` for the switch)."""
        return f"{PREFIX}-{self.run}-{host}"

    def create(self, hosts: list[Host]) -> None:
        """Make the switch and every host (call :func:`cleanup` on failure)."""
        sw = self.ns("sw")
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for host in hosts:
            if not re.fullmatch(r"[a-z0-9]{1,10}", host.name) or host.name == "sw":
                raise ValueError(f"bad host name {host.name!r}")
            host.ns = self.ns(host.name)
            self.hosts[host.name] = host
            self._add_host(host, sw)

    def _add_host(self, host: Host, sw: str) -> None:
        ns, port = host.ns, f"v-{host.name}"
        _run("ip", "netns", "add", ns)
        _run(
            "ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns
        )
        _run("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        for cidr in host.addresses:
            _run("ip", "-n", ns, "addr", "add", cidr, "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        for net, via in host.routes:
            _run("ip", "-n", ns, "route", "add", net, "via", via)
        # where blocked packets go: a veth pair left down drops whatever is sent to it
        _run("ip", "-n", ns, "link", "add", "blk0", "type", "veth", "peer", "name", "blk1")
        _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "clsact")

    # -- threads and processes in hosts --------------------------------------------------

    def move_here(self, host: str) -> None:
        """Move the calling thread (and the threads it starts from now on) into ``host``."""
        _setns(str(NETNS_DIR / self.ns(host)))
        self._home = host

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """Run the calling thread inside ``host`` for the block, then bring it back."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(str(NETNS_DIR / self.ns(host)))
            try:
                yield
            finally:
                if _libc.setns(back, CLONE_NEWNET) != 0:  # pragma: no cover - cannot fail
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(back)

    def pids(self, host: str) -> list[int]:
        """Processes whose network namespace is ``host``'s."""
        out = _run("ip", "netns", "pids", self.ns(host), check=False)
        return [int(p) for p in out.split()]

    def inode(self, host: str) -> int:
        """The namespace's inode (compare with ``/proc/PID/ns/net``)."""
        return os.stat(NETNS_DIR / self.ns(host)).st_ino

    # -- faults --------------------------------------------------------------------------

    def link(self, host: str, up: bool) -> None:
        """Put ``host``'s cable back (``up``) or take it out."""
        _run("ip", "-n", self.ns("sw"), "link", "set", f"v-{host}", "up" if up else "down")
        with self._lock:
            (self._down.discard if up else self._down.add)(host)

    def block(
        self,
        host: str,
        to: str | None = None,
        *,
        syn_only: bool = False,
        sports: tuple[tuple[int, int], ...] = (),
    ) -> Block:
        """Drop packets ``host`` sends (to ``to``'s address only, if given): all of them, new
        connections only (``syn_only``), or those from these (port, mask) source ports."""
        matches: list[str] = []
        if to is not None:
            matches += ["match", "ip", "dst", f"{self.hosts[to].ip}/32"]
        if syn_only or sports:
            matches += ["match", "ip", "protocol", "6", "0xff"]
        if syn_only:  # TCP flags SYN set, ACK clear (an IP header without options)
            matches += ["match", "u8", "0x02", "0x12", "at", "33"]
        what = f"{host}->{to or '*'}" + (" new connections" if syn_only else "")
        what += f" from ports {sports}" if sports else ""
        with self._lock:
            prefs = []
            for sport, mask in sports or ((0, 0),):
                prefs.append(self._next_pref)
                self._next_pref += 1
                extra = ["match", "ip", "sport", str(sport), hex(mask)] if sports else []
                self._filter(host, prefs[-1], [*matches, *extra])
            block = Block(host, tuple(prefs), what)
            self._blocks[prefs[0]] = block
        return block

    def _filter(self, host: str, pref: int, matches: list[str]) -> None:
        _run(
            "tc", "-n", self.ns(host), "filter", "add", "dev", "eth0", "egress", "protocol",
            "ip", "pref", str(pref), "u32", *(matches or ["match", "u32", "0", "0"]),
            "action", "mirred", "egress", "redirect", "dev", "blk0",
        )  # fmt: skip

    def unblock(self, block: Block) -> None:
        """Remove a block (every filter it added); nothing if it is gone already."""
        with self._lock:
            if self._blocks.pop(block.prefs[0], None) is None:
                return
        for pref in block.prefs:
            _run(
                "tc", "-n", self.ns(block.host), "filter", "del", "dev", "eth0", "egress",
                "pref", str(pref),
            )  # fmt: skip

    def heal(self) -> None:
        """Every cable in, every block removed."""
        with self._lock:
            down, blocks = set(self._down), list(self._blocks.values())
        for host in down:
            self.link(host, True)
        for block in blocks:
            self.unblock(block)

    @property
    def faulty(self) -> list[str]:
        """What is cut now: hosts whose cable is out, blocks in place."""
        with self._lock:
            return [f"{h} down" for h in sorted(self._down)] + [
                b.what for b in self._blocks.values()
            ]


def run_namespaces() -> dict[str, list[str]]:
    """Every namespace of this harness's naming, by run."""
    out = _run("ip", "netns", "list", check=False)
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m:
            found.setdefault(m.group(1), []).append(name)
    return found


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch); None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        up = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: since boot, in ticks
    return time.time() - up + ticks / os.sysconf("SC_CLK_TCK")


def _harness_alive(run: str, names: list[str]) -> bool:
    """Whether the process that made run ``run``'s namespaces (its harness, or a test)
    still runs: a process with that pid that started before they were made (a namespace's
    file has the time it was made), not a later one that got the pid again."""
    started = _started_at(int(run))
    if started is None:
        return False
    try:
        made = min(os.stat(NETNS_DIR / name).st_mtime for name in names)
    except OSError:  # being removed meanwhile (by its own run): not ours to touch
        return True
    return started <= made + 0.2  # ticks are 10 ms; the clock is read twice


def cleanup(run: str, keep: int | None = None) -> list[str]:
    """Kill every process inside run ``run``'s namespaces (but ``keep``) and delete them."""
    names = run_namespaces().get(run, [])
    for _ in range(2):  # SIGKILL, then again for anything forked meanwhile
        for name in names:
            out = _run("ip", "netns", "pids", name, check=False)
            for pid in (int(p) for p in out.split()):
                if pid != keep:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    for name in names:
        _run("ip", "netns", "del", name, check=False)
    return names


def cleanup_stale() -> list[str]:
    """Remove the namespaces of every run whose harness is gone; the names removed."""
    removed: list[str] = []
    for run, names in run_namespaces().items():
        if not _harness_alive(run, names):
            removed += cleanup(run)
    return removed


class Launcher:
    """Starts every process of a run, inside its host, from one long-lived thread."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self._jobs: queue.Queue[tuple[str, list[str], dict[str, Any], Future[Any]] | None]
        self._jobs = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="launcher", daemon=True)
        self._thread.start()

    def popen(
        self, host: str, argv: list[str], *, user: int | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """``subprocess.Popen(argv, **kwargs)`` inside ``host``, in its own session, as
        ``user`` if given, killed when the launcher ends."""
        done: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((host, [*setpriv(user, die_with_parent=True), *argv], kwargs, done))
        return done.result(timeout=60)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            host, argv, kwargs, done = job
            try:
                with self.net.entered(host):
                    # no preexec_fn, no user=: subprocess vforks (services.setpriv)
                    proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
                done.set_result(proc)
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)

    def close(self) -> None:
        """Stop the thread: whatever it started and still runs is killed by the kernel."""
        self._jobs.put(None)
        self._thread.join(10)
