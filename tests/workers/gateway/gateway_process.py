"""``corral gateway`` as a process of its own, for the hostile-answer tests.

:func:`gateway_process` starts one (with a token, a small read-ahead budget and a 1 s
answer-head deadline; its data plane the stack's) in front of ``evil`` - one replica
whose answers attack it (:mod:`tests.workers.gateway.hostile`) - and ``examples.hello``,
both deployed on the given :class:`Stack` and warm. :class:`Gateway` reads its memory
from ``/proc`` (HAProxy's, a child of the gateway, counted in) and its refusals from
``/metrics``; :meth:`Gateway.evil` deploys a hostile function of the test's own, warm.

On the HAProxy data plane a warm function's calls go straight from HAProxy to its
replica: the first attacks of a function meet HAProxy's bounds (502 for a head over
its buffer or its lines, 504 for a head not complete within the call timeout, which is
6 s here), after which the function is demoted to the Python path and meets the
gateway's, exactly. Refusals count either way (:meth:`Gateway.refused` adds HAProxy's).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil

from testkit import httpcalls
from tests.workers.gateway.conftest import HOSTILE, Stack, gateway_process_on_port_0, wait_healthy

MiB = 1024 * 1024
TOKEN = "t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}
BUDGET = 16 * MiB  # CORRAL_GATEWAY_READ_AHEAD_BUDGET of these gateways
CALL_TIMEOUT_S = 6  # CORRAL_GATEWAY_TIMEOUT_S on the HAProxy data plane (a head's bound there)


class Gateway:
    """``corral gateway`` in a process of its own, its memory read from ``/proc``."""

    def __init__(
        self, proc: subprocess.Popen[bytes], url: str, log: Path, stack: Stack | None = None
    ) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.stack = stack
        self.dataplane = stack.dataplane if stack is not None else "python"
        self.function = "evil"

    def pids(self) -> list[int]:
        """The gateway's process and its children (its HAProxy)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return [self.proc.pid]
        return [self.proc.pid, *(c.pid for c in children)]

    def kib(self, field: str, pids: list[int] | None = None) -> int:
        """A ``/proc/PID/status`` figure in KiB (``VmRSS``, ``VmHWM``), its HAProxy's added.

        ``pids``: :meth:`pids` listed before (listing them reads every process's ``stat``).
        """
        total = 0
        for pid in self.pids() if pids is None else pids:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(field + ":"):
                        total += int(line.split()[1])
        if not total:
            raise AssertionError(f"no {field} for the gateway")
        return total

    def reset_peak(self) -> None:
        """Start ``VmHWM`` again from the resident memory now."""
        for pid in self.pids():
            with contextlib.suppress(OSError):
                Path(f"/proc/{pid}/clear_refs").write_text("5")

    def metric(self, line_start: str) -> float:
        """The value of the first ``/metrics`` sample whose line starts so (0 if none)."""
        text = httpcalls.get(f"{self.url}/metrics", headers=AUTH, timeout=10).text
        for line in text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def refused(self, *reasons: str) -> float:
        """Answers of the hostile function refused for any of ``reasons`` (or by HAProxy)."""
        fn = self.function
        return self.metric(f'corral_warm_answers_refused_total{{function="{fn}"}}') + sum(
            self.metric(f'corral_gateway_answers_refused_total{{function="{fn}",reason="{r}"}}')
            for r in reasons
        )

    def demoted(self) -> bool:
        """True once the hostile function takes the Python path for good."""
        return self.metric(f'corral_warm_demoted{{function="{self.function}"}}') == 1

    def evil(self, name: str) -> str:
        """Deploy hostile function ``name`` (one replica), warm: the attacks' target now."""
        assert self.stack is not None
        self.stack.deploy(name, image=HOSTILE, max=1, exec_envs=32)
        answer = httpcalls.get(f"{self.url}/function/{name}/", headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text
        self.function = name
        return name


@contextlib.contextmanager
def gateway_process(stack: Stack, tmp: Path) -> Iterator[Gateway]:
    """A gateway process; ``evil`` (one hostile replica) and ``hello`` deployed and warm."""
    stack.deploy("evil", image=HOSTILE, max=1, exec_envs=32)
    stack.deploy("hello", image="examples.hello", max=1, exec_envs=4)
    log = tmp / "gateway.log"
    env = {
        **os.environ,
        "CORRAL_GATEWAY_TOKEN": TOKEN,
        "CORRAL_GATEWAY_READ_AHEAD_BUDGET": str(BUDGET),
        "CORRAL_GATEWAY_SEND_TIMEOUT_S": "120",
        "CORRAL_GATEWAY_ANSWER_HEAD_TIMEOUT_S": "1",
        "CORRAL_GATEWAY_DATAPLANE": stack.dataplane,
    }
    if stack.haproxy:
        env["CORRAL_GATEWAY_TIMEOUT_S"] = str(CALL_TIMEOUT_S)
    proc, url = gateway_process_on_port_0(log, env)
    running = Gateway(proc, url, log, stack)
    try:
        wait_healthy(running.url)
        for path in ("/function/hello", "/function/evil/"):  # both warm
            answer = httpcalls.get(running.url + path, headers=AUTH, timeout=60)
            assert answer.status_code == 200, answer.text
        yield running
    finally:
        for pid in running.pids()[1:]:  # its HAProxy (which would go with it, under setpriv)
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        proc.kill()
        proc.wait(15)
