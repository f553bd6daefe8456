"""The asynchronous calls' soak (``bench/async_soak.py``), cut for CI: 500 calls under faults.

It runs as its own process (``python -m bench.async_soak``), with its own PostgreSQL,
Redis, gateway, workers, beat and agent, so nothing it sets leaks into the other tests;
the figures come back as JSON. A worker is SIGKILLed every 4 s and Redis crashed once;
every call answered 202 must end in exactly one terminal record, none lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.slow
@pytest.mark.long(30)
def test_a_short_async_soak_loses_no_call(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.async_soak",
            "--calls",
            "500",
            "--clients",
            "16",
            "--kill-every",
            "4",
            "--redis-down",
            "2",
            "--settle",
            "120",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["checks"] == {
        "lost": 0,
        "terminal_records": 0,
        "open_calls": 0,
        "key_mismatches": 0,
    }, run.stdout[-3000:]
    assert figures["accepted"] == 500
    assert figures["faults"]["worker_kill"] >= 1 and figures["faults"]["redis_crash"] == 1
    assert figures["outcomes"] == {"succeeded": 500}  # 20 attempts each: none dies here
    assert run.returncode == 0, run.stdout[-3000:]
