"""A server's main thread stops on SIGTERM whichever of its threads the kernel hands it to."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from testkit.processes import ROOT

# The signal goes to another thread (as the kernel may do: gRPC's threads take signals
# too) once the main thread waits; Python runs the handler in the main thread only.
SERVER = textwrap.dedent(
    """
    import signal, threading
    from netplumb.signals import until_signalled, wait_for

    waiting = threading.Event()

    def other_thread():
        waiting.wait()
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=other_thread, daemon=True).start()
    with until_signalled() as stop:
        waiting.set()
        wait_for(stop)
    print("stopped", flush=True)
    """
)


def test_a_sigterm_another_thread_takes_still_stops_the_wait() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SERVER], cwd=ROOT, capture_output=True, text=True, timeout=20
    )
    assert (done.returncode, done.stdout) == (0, "stopped\n"), done.stderr
