"""One round of creates as the batch runner calls them: the call, its admission, what lands.

:mod:`workers.replicas.creates` hands a round's rows (each a
:class:`~workers.replicas.owners.Pending`) to :mod:`workers.replicas.calls`, which runs
them on the event loop (:mod:`workers.backends.inflight`) and calls back, per row, into
a :class:`Sends` made for that round - never into ``creates`` itself:

* :meth:`Sends.lane_of` - a node's lane: its in-flight bound, how many failures stop its
  creates in this round, its probation;
* :meth:`Sends.admit` - as a call holds its node's slot, its row is marked sent
  (:func:`~workers.replicas.owners.mark_sent_soon`, grouped with the process's other
  calls admitted at that moment); a row the mark did not return is not sent;
* :meth:`Sends.call` - the create itself (:func:`workers.backends.send_create`, its stages
  timed), a client bug made a permanent error so it cannot take the batch down;
* :meth:`Sends.on_landed` - the VMs that came back meanwhile, recorded
  (:mod:`workers.replicas.arrivals`);
* :meth:`Sends.on_dropped` - those that came back after recording gave up (the store
  refused until near the hard limit), kept in Redis for the next handler of their rows
  (:mod:`workers.replicas.landed`).

:func:`blames_node` says which errors count against a node: all but an answer that blames
the request itself (:func:`request_error`: INVALID_ARGUMENT, HTTP 400 - every node would
refuse it).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Hashable

from config.settings import Settings
from workers import backends
from workers.backends import inflight, networks
from workers.base.errors import BackendError, PermanentBackendError
from workers.fleet.nodes import probation
from workers.observability import stages
from workers.replicas import landed as kept
from workers.replicas.arrivals import record
from workers.replicas.outcomes import Next
from workers.replicas.owners import Budget, Pending, mark_sent_soon
from workers.store.db import Database

REQUEST_ERRORS = ("INVALID_ARGUMENT", "400")  # the request's fault, not the node's


def request_error(exc: BaseException) -> bool:
    """Whether an agent refused the request itself (the function's fault, not the node's)."""
    return isinstance(exc, PermanentBackendError) and exc.code in REQUEST_ERRORS


def blames_node(exc: BaseException) -> bool:
    """Whether a create's error counts against its node."""
    return not request_error(exc)


class Sends:
    """A round's creates: made on the task's thread, called on the event loop's."""

    def __init__(  # noqa: PLR0913 - one handler's round
        self,
        db: Database,
        settings: Settings,
        budget: Budget,
        token: str,
        nxt: Next,
        pendings: list[Pending],
    ) -> None:
        self.db, self.settings, self.budget, self.token, self.nxt = db, settings, budget, token, nxt
        self.nodes = {p.node.id: p.node for p in pendings}
        for node in self.nodes.values():  # what a reply's address is checked against
            networks.remember(backends.target(node), node.replica_networks, settings)
        self.by_node: dict[Hashable, list[Pending]] = defaultdict(list)
        for p in pendings:
            self.by_node[p.node.id].append(p)
        self.calls = {
            p.request_id: backends.create_call(p.node, p.function, p.request_id, settings)
            for p in pendings
        }
        self.timer = stages.current()  # the task's: the calls run on the event loop's thread

    def lane_of(self, node_id: Hashable) -> inflight.Lane:
        """A node's lane: its bound, the failures that stop it, its probation."""
        node = self.nodes[str(node_id)]
        return inflight.Lane(
            node_id,
            bound=self.settings.node_max_inflight,
            stop_after=max(1, self.settings.node_failures - node.create_failures),
            probation=probation(node, self.settings),
        )

    async def admit(self, p: Pending) -> bool:
        """Mark ``p`` sent (on the loop, holding its node's slot); whether it is still ours."""
        return await asyncio.wrap_future(mark_sent_soon(self.db, self.token, p.replica_id))

    async def call(self, p: Pending) -> backends.Vm:
        """Send ``p``'s create; its VM, or a :class:`BackendError`."""
        if self.timer is not None:
            self.timer.sent(p.request_id, p.node.name)
        try:
            return await backends.send_create(self.calls[p.request_id], self.settings)
        except BackendError:
            raise
        except Exception as exc:  # a client bug must not take the batch down
            raise PermanentBackendError(
                f"CreateReplica failed: {type(exc).__name__}: {exc}", node=p.node.name
            ) from None
        finally:
            if self.timer is not None:
                self.timer.answered(p.request_id)

    def on_landed(self, landed: list[tuple[Pending, backends.Vm]]) -> None:
        """Record the VMs that came back meanwhile."""
        record(self.db, self.settings, landed, self.nxt, self.budget)

    def on_dropped(self, landed: list[tuple[Pending, backends.Vm]]) -> None:
        """Keep for the next handler the VMs that came back after recording gave up."""
        kept.keep(self.settings, [kept.Landed(p.replica_id, p.node.id, vm) for p, vm in landed])
