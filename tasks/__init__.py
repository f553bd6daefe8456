"""corral's queue interface: the tasks producers send, the Python API, and the CLI.

Producers normally use :mod:`corral.api` (``spawn``, ``delete``, ``scale``, ``wait``...),
which writes an operation record and queues the task that carries it out; the
task objects themselves (``tasks.replicas.spawn`` and friends) take only ids.
"""
