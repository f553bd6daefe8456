"""What corral tells its operators: metrics, traces, logs and clocks, in one place.

Three floors, each importing only those below it (an import-linter contract):

* the basics, which import nothing of ``workers`` but :mod:`workers.base`, so any floor
  may use them: every metric's name, labels and buckets
  (:mod:`~workers.observability.metric_catalog`), traces
  (:mod:`~workers.observability.tracing`), a worker's log records through a bounded queue
  (:mod:`~workers.observability.logs`), each host's clock offset from the store's
  (:mod:`~workers.observability.clock_offsets`);
* a cold start's stages, timed where they happen and stored on its operation
  (:mod:`~workers.observability.stages`: above the store);
* the Prometheus exporter, ``corral metrics`` (:mod:`~workers.observability.exporter`),
  which reads every domain's rows and Redis keys at scrape time: the top of ``workers``.
"""
