"""The smallest function: answers ``hello from corral`` to every GET and POST.

Run it as a replica image ``hello`` / ``examples.hello``, or by hand::

    PORT=8080 python -m examples.hello
"""

from __future__ import annotations

from examples._http import QuietHandler, run

__all__ = ["GREETING", "HelloHandler", "main"]

GREETING = b"hello from corral\n"


class HelloHandler(QuietHandler):
    """Answers the greeting, ignoring path and body."""

    def do_GET(self) -> None:
        """Answer the greeting."""
        self.send_body(200, GREETING)

    def do_HEAD(self) -> None:
        """Answer headers only."""
        self.send_body(200, GREETING)

    def do_POST(self) -> None:
        """Drain the body, then answer the greeting."""
        self.read_body()
        self.send_body(200, GREETING)


def main() -> int:
    """Serve until SIGTERM."""
    return run(HelloHandler)


if __name__ == "__main__":
    raise SystemExit(main())
