"""The warm data plane: a private HAProxy carries warm calls, the gateway activates the rest.

The model is Knative's activator: the Python gateway (the *activator*) is in a call's
path only when it must be. A function whose environments the gateway holds has a
backend in HAProxy whose servers are those environments' replicas (``maxconn`` = the
environments held on each); HAProxy sends its calls straight there. A call HAProxy
cannot carry - the function has no environment free (none held, or all busy), the
request is not plain (a chunked body, an ``Upgrade``...), the caller has no token - goes
to the gateway behind it, which queues, cold-starts and answers as it always has, and
whose environments, once its requests are done with them, are lent to HAProxy: warm
traffic goes back to HAProxy as soon as there is room. Where HAProxy is not installed
(or ``CORRAL_GATEWAY_DATAPLANE=python``) the gateway carries every call, as before.

* :mod:`.layout` - the private directory of each gateway's HAProxy, locked while the
  gateway lives, and those of dead gateways removed;
* :mod:`.config` - HAProxy's configuration: the frontend's rules (what is warm), a fixed
  pool of backends, timeouts and bounds from the gateway's settings;
* :mod:`.runtime` - its runtime API (the unix socket): commands (sent from a thread of
  their own), ``show stat``, ``show sess``;
* :mod:`.process` - finding, starting, watching and stopping HAProxy;
* :mod:`.routes` - what is kept of each function HAProxy carries and each replica lent;
* :mod:`.router` - what HAProxy routes, kept in step with what the ledger lends
  (:mod:`workers.gateway.lending`): servers added and closed, environments taken back,
  functions demoted to the Python path;
* :mod:`.readings` - HAProxy's counters every 50 ms (demand, idle times, use, failures,
  refusals), the watchdog of answers past the call timeout, restarts;
* :mod:`.warm` - the pieces put together for one gateway (:class:`.warm.WarmPath`), and
  the activator's side of the socket between them (:func:`.warm.behind`).
"""
