"""What executes tasks: the logic the Celery tasks call, in one sub-package per domain.

``celery -A workers worker|beat|flower`` finds the app in :mod:`workers.celery` by Celery's
convention (``python -m workers.command worker|beat``, :mod:`workers.command`, runs the
same commands without loading Celery's others); importing :mod:`workers` itself builds
nothing.

* :mod:`workers.celery`, :mod:`workers.broker`: the Celery glue; :mod:`workers.dispatch`: the
  ``TaskQueue`` port the logic asks for work through (implemented in :mod:`tasks.queues`).
* :mod:`workers.backends`: clients of node agents (gRPC) and Lambdo hosts (HTTP).
* :mod:`workers.fleet`: nodes, health, placement, GPUs.
* :mod:`workers.replicas`: spawn, delete, scale, claims, the replica state machine.
* :mod:`workers.operations`: operation records, their statuses, settling and finishing them.
* :mod:`workers.maintenance`: reaper, reconcile, audit, redrive (beat's passes).
* :mod:`workers.autoscale`, :mod:`workers.gateway`, :mod:`workers.registry`,
  :mod:`workers.observability.exporter`: the data path and what agents, guests and
  Prometheus talk to.
* :mod:`workers.observability`: metrics, traces, logs and clock offsets, in one place.
* :mod:`workers.store`: the SQL store.
* :mod:`workers.base`: the basics all of these stand on (errors, the clock, kinds and
  names, checks on what the network sends, time limits); they import nothing above them.
"""
