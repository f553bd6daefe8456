"""A function that keeps a ledger of the asynchronous calls it runs: the async-call tests' image.

Every request that carries ``X-Call-Id`` appends one line to the file ``$CALLEE_LEDGER``
as it arrives (``<call id> <attempt> <vmid>``, one ``write`` in append mode: lines never
interleave), then answers ``$CALLEE_STATUS`` (200 by default) with a JSON body: the call
id, the attempt, the body received and the replica's vmid. ``?delay=S`` waits S seconds
before answering (a call still running when its worker is killed); ``?fail=N`` answers
500 to attempts 1 to N (a call retried, then answered). A request without ``X-Call-Id``
(the agent's readiness probe, a synchronous call) is answered and not recorded::

    PORT=8080 CALLEE_LEDGER=/tmp/ledger python -m tests.workers.gateway.callee
"""

from __future__ import annotations

import json
import os
import time
from urllib.parse import parse_qs, urlsplit

from examples._http import QuietHandler, run


class CalleeHandler(QuietHandler):
    """Records and answers every request."""

    def _serve(self) -> None:
        body = self.read_body()
        asked = parse_qs(urlsplit(self.path).query)
        call_id = self.headers.get("X-Call-Id")
        attempt = int(self.headers.get("X-Call-Attempt") or 0)
        vmid = os.environ.get("VMID", "")
        ledger = os.environ.get("CALLEE_LEDGER")
        if call_id and ledger:
            fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{call_id} {attempt} {vmid}\n".encode())
            finally:
                os.close(fd)
        delay = float(asked.get("delay", ["0"])[-1])
        if delay:
            time.sleep(min(delay, 300.0))
        status = int(os.environ.get("CALLEE_STATUS") or 200)
        if attempt and attempt <= int(asked.get("fail", ["0"])[-1]):
            status = 500
        answer = {
            "call_id": call_id,
            "attempt": attempt,
            "body": body.decode("utf-8", "replace"),
            "vmid": vmid,
        }
        self.send_body(status, json.dumps(answer).encode(), "application/json")

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve


def main() -> int:
    """Serve until SIGTERM."""
    return run(CalleeHandler)


if __name__ == "__main__":
    raise SystemExit(main())
