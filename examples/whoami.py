"""A function that says which replica answered: its ``$VMID``, fresh randomness, its clock.

Replicas restored from one snapshot (the ``qemu`` driver's warm starts) share everything
the snapshot held; this answer shows what each gets of its own afterwards: a ``vmid``,
numbers from Python's ``random`` (reseeded) and from the kernel (``os.urandom``), a new
``uuid4`` and the guest's wall clock (``time``, Unix seconds)::

    PORT=8080 python -m examples.whoami
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid

from examples._http import QuietHandler, run

__all__ = ["WhoamiHandler", "main"]


class WhoamiHandler(QuietHandler):
    """Answers every GET with a JSON description of the replica."""

    def do_GET(self) -> None:
        """Answer who this replica is."""
        answer = {
            "vmid": os.environ.get("VMID", ""),
            "random": random.getrandbits(64),
            "urandom": os.urandom(8).hex(),
            "uuid": str(uuid.uuid4()),
            "time": time.time(),
        }
        self.send_body(200, json.dumps(answer).encode(), "application/json")


def main() -> int:
    """Serve until SIGTERM."""
    return run(WhoamiHandler)


if __name__ == "__main__":
    raise SystemExit(main())
