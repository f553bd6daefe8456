"""What corral's tests and benchmarks stand on: real services, corral's processes, fault rigs.

Both ``tests/`` and ``bench/`` import this package and never each other (import-linter
checks it; nothing in corral itself imports it). It holds:

* :mod:`testkit.services`: private Redis and PostgreSQL servers on loopback, and the one
  ``free_port``;
* :mod:`testkit.processes`: ``corral worker`` and ``celery beat`` as child processes;
* :mod:`testkit.eventually`: the one way to wait for a condition;
* the namespace rig of the partition run: hosts in network namespaces
  (:mod:`testkit.netns`), corral's processes on them (:mod:`testkit.nsprocs`,
  :mod:`testkit.nsfleet`; ``testkit/skewclock``: a worker's wall clock set off), the faults
  (:mod:`testkit.nemesis`), the load and its history
  (:mod:`testkit.history`) and the checks (:mod:`testkit.checker`);
* the soak's settings and fault schedule (:mod:`testkit.soak_plan`), a keep-alive trace
  replayed through the fleet's policy (:mod:`testkit.keepalive_replay`), a populated fleet
  for placement (:mod:`testkit.fleets`) and an OTLP receiver (:mod:`testkit.otlp_sink`).

It is not shipped in corral's wheel: it runs from a checkout, with the ``dev`` extra.
"""
