"""``corral gateway`` as a process of its own, for the hostile-answer tests.

:func:`gateway_process` starts one (with a token, a small read-ahead budget and a 1 s
answer-head deadline) in front of ``evil`` - one replica whose answers attack it
(:mod:`tests.workers.gateway.hostile`) - and ``examples.hello``, both deployed on the
given :class:`Stack` and warm. :class:`Gateway` reads its memory from ``/proc`` and its
refusals from ``/metrics``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from testkit.services import free_port
from tests.workers.gateway.conftest import HOSTILE, Stack, wait_healthy

MiB = 1024 * 1024
TOKEN = "t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}
BUDGET = 16 * MiB  # CORRAL_GATEWAY_READ_AHEAD_BUDGET of these gateways


class Gateway:
    """``corral gateway`` in a process of its own, its memory read from ``/proc``."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def kib(self, field: str) -> int:
        """A ``/proc/PID/status`` figure in KiB (``VmRSS``, ``VmHWM``)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} for the gateway")

    def reset_peak(self) -> None:
        """Start ``VmHWM`` again from the resident memory now."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def metric(self, line_start: str) -> float:
        """The value of the first ``/metrics`` sample whose line starts so (0 if none)."""
        text = httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=10).text
        for line in text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def refused(self, *reasons: str) -> float:
        """Answers of ``evil`` the gateway refused for any of ``reasons``."""
        return sum(
            self.metric(f'corral_gateway_answers_refused_total{{function="evil",reason="{r}"}}')
            for r in reasons
        )


@contextlib.contextmanager
def gateway_process(stack: Stack, tmp: Path) -> Iterator[Gateway]:
    """A gateway process; ``evil`` (one hostile replica) and ``hello`` deployed and warm."""
    stack.deploy("evil", image=HOSTILE, max=1, exec_envs=32)
    stack.deploy("hello", image="examples.hello", max=1, exec_envs=4)
    port = free_port()
    log = tmp / "gateway.log"
    env = {
        **os.environ,
        "CORRAL_GATEWAY_TOKEN": TOKEN,
        "CORRAL_GATEWAY_READ_AHEAD_BUDGET": str(BUDGET),
        "CORRAL_GATEWAY_SEND_TIMEOUT_S": "120",
        "CORRAL_GATEWAY_ANSWER_HEAD_TIMEOUT_S": "1",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tasks.cli", "gateway", "--listen", f"127.0.0.1:{port}"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running = Gateway(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(running.url)
        for path in ("/function/hello", "/function/evil/"):  # both warm
            answer = httpx.get(running.url + path, headers=AUTH, timeout=60)
            assert answer.status_code == 200, answer.text
        yield running
    finally:
        proc.kill()
        proc.wait(15)
