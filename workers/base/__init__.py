"""The basics every floor of ``workers`` stands on: they import nothing of it but each other.

The store, the backend clients and the logic above them all use these; none of these
uses any of them (an import-linter contract):

* :mod:`~workers.base.errors`: corral's exceptions, from bad input to a transient backend
  error;
* :mod:`~workers.base.clock`: the store's clock, read on the monotonic clock in between
  (and moved by tests);
* :mod:`~workers.base.kinds`: the kinds of node and of operation, the placement policies'
  names; :mod:`~workers.base.names`: the names of functions and nodes;
* :mod:`~workers.base.untrusted`: checks on what agents and guests send over the network;
* :mod:`~workers.base.timelimits`: a task's soft deadline and the reports of its hard
  limit; :mod:`~workers.base.poison`: tasks killed at their hard limit, counted;
* :mod:`~workers.base.redis_client`: one Redis client per process and URL;
  :mod:`~workers.base.waiting`: a line of asyncio waiters.
"""
