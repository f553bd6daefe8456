"""corral's faces: the producer API and the command line over it.

Producers use :mod:`corral.api` (``spawn``, ``delete``, ``scale``, ``wait``...), which
writes an operation record and queues the task that carries it out (:mod:`tasks`); the
``corral`` command (:mod:`corral.cli`) is a thin shell over the API and starts the
services. Nothing below imports this package: the CLI > the API > the tasks.
"""
