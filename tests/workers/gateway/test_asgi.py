"""The gateway's own answers: a failed store call is the store's, unless descriptors ran out."""

from __future__ import annotations

from testkit.processes import run_without_descriptors

# The answers to failed store calls with every descriptor taken, then with one free again,
# transient or not; the gateway's warnings go to stderr.
_IMPORTS = """
import logging
from workers.gateway.asgi import store_unavailable
logging.basicConfig(level=logging.WARNING, format="%(message)s")
"""
_ANSWERS = """
full = store_unavailable("unable to open database file", transient=False)
os.close(held.pop())
free = store_unavailable("connection failed", transient=True)
print(store_unavailable("no such table: x", transient=False))
for a in (full, free):
    print(a.status, a.headers["retry-after"], a.message, sep="|")
"""


def test_a_failed_store_call_without_a_free_descriptor_is_the_gateways_own_503() -> None:
    run = run_without_descriptors(_IMPORTS, _ANSWERS)
    assert run.returncode == 0, run.stderr
    other, full, free = run.stdout.splitlines()
    assert other == "None"  # an error of the request's own: raised by the caller
    assert full == "503|5|the gateway has no file descriptor free: try again"
    assert free == "503|5|the store is unavailable"
    assert run.stderr.splitlines() == [
        "gateway: no file descriptor free to reach the store: unable to open database file",
        "gateway: the store is unavailable: connection failed",
    ]
