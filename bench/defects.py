"""Known defects, put into a worker or gateway process to show the checker catches them.

Run: ``python -m bench.defects DEFECT -m MODULE ARGS...`` - applies the defect to the
modules already imported by name, then runs ``python -m MODULE ARGS...`` in this
process. The partition run starts its workers and gateway this way with ``--inject``;
``corral worker`` runs its Celery worker as a child, which is started through this
module too (the supervisor's :func:`stack.worker.celery_argv` is replaced), so the
defect is in the process that runs the tasks.
Nothing in corral reads these: the defects live here, in the harness, only.

* ``no-ownership`` - the ownership checks of :mod:`workers.replicas.owners` off: a
  handler takes a Creating row whoever owns it, every node counts as one that
  deduplicates creates (so a create whose outcome is unknown is sent again, blindly, to
  seed-protocol agents too), and every fenced write passes.
* ``no-release`` - a delete forgets to release the VM (:mod:`workers.replicas.delete`
  calls no node and takes the VM for released). Reconcile still destroys what it finds,
  so only agents that cannot list their VMs keep them.
* ``no-inflight-bound`` - the workers read ``CORRAL_NODE_MAX_INFLIGHT`` as 64: every
  create of a round goes out to its node at once, so a freeze or a kill leaves as many
  maybes as the round had rows (``maybes_beyond_inflight``).
* ``half-full`` - placement says "no capacity" once half the slots of a backend's
  placeable nodes are taken (``no_capacity_while_free``).
* ``hang-health`` - the first health pass a worker process runs never returns: ``corral
  worker`` kills the worker at its hard time limit (``hard_limit_restarts``).
* ``short-request-ids`` - a create carries only the first character of its row's
  request id: an agent that deduplicates creates answers one row with another's VM, or
  makes a second VM for an id it saw (``request_ids_twice``).
* ``late-ops`` - a spawn's first delivery puts itself off for longer than an operation
  may take (a retry with that countdown) before doing its work (``ops_slow``; seen in
  runs longer than that bound, ``--minutes 4``).
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import update


def _no_ownership() -> None:
    import workers.replicas.creates
    from workers.replicas import owners
    from workers.store.models import Replica

    def take_all(db: Any, settings: Any, request_ids: list[str], token: str, until: Any) -> Any:
        out = owners.Taken()
        if not request_ids:
            return out
        with db.transaction() as s:
            rows = s.execute(owners._CANDIDATES, {"request_ids": request_ids}).all()
            for rid, request_id, node, fn, op_id, placements, *_owner_and_sent in rows:
                s.execute(
                    update(Replica).where(Replica.id == rid).values(owner=token, owner_until=until)
                )
                out.pending.append(owners.Pending(rid, request_id, node, fn, op_id, placements))
        return out

    import workers.replicas.spawn  # noqa: F401 - imports take by name

    _replace(owners.dedups, lambda node: True)
    _replace(owners.owns, lambda replica, token, node_id: True)
    _replace(owners.take, take_all)


def _no_release() -> None:
    from types import SimpleNamespace

    from workers import backends
    from workers.replicas import delete

    async def send_release(t: Any, vmid: str, settings: Any) -> bool:
        return True

    names = {**vars(backends), "release_vm": lambda node, vmid, settings: True}
    defective = SimpleNamespace(**{**names, "send_release": send_release})
    setattr(delete, "backends", defective)  # noqa: B010 - the module's own name for it


def _no_inflight_bound() -> None:
    import os

    from config.settings import reset_settings

    os.environ["CORRAL_NODE_MAX_INFLIGHT"] = "64"  # the Celery child inherits it
    reset_settings()


def _half_full() -> None:
    from sqlalchemy import func, select

    from workers.base.clock import now
    from workers.base.errors import CapacityError
    from workers.fleet import placement
    from workers.store.models import Node

    def refuse_past_half(session: Any, fn: Any) -> None:
        live, capacity = session.execute(
            select(
                func.coalesce(func.sum(Node.live), 0), func.coalesce(func.sum(Node.capacity), 0)
            ).where(*placement._placeable(fn.backend)),
            {"now": now()},
        ).one()
        if 2 * live >= capacity:
            raise CapacityError(f"no capacity for {fn.name} on any healthy {fn.backend} node")

    one, many = placement.reserve_node, placement.reserve_nodes

    def reserve_node(session: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_past_half(session, fn)
        return one(session, fn, *args, **kwargs)

    def reserve_nodes(session: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_past_half(session, fn)
        return many(session, fn, *args, **kwargs)

    import workers.replicas.maybes
    import workers.replicas.moves
    import workers.replicas.spawn  # noqa: F401 - imports reserve_node by name

    _replace(one, reserve_node)
    _replace(many, reserve_nodes)


def _hang_health() -> None:
    import threading

    import tasks.maintenance

    task = tasks.maintenance.check_health
    original = task.run
    first = threading.Event()

    def run(*args: Any, **kwargs: Any) -> Any:
        if not first.is_set():
            first.set()
            threading.Event().wait()  # never returns: only the hard limit ends it
        return original(*args, **kwargs)

    task.run = run


def _short_request_ids() -> None:
    from workers.backends import fcdaemon

    original = fcdaemon.create_request

    def create_request(fn: Any, request_id: str, settings: Any) -> Any:
        return original(fn, request_id[:1], settings)

    import workers.backends
    import workers.replicas.creates  # noqa: F401 - imports by name

    _replace(original, create_request)


def _late_ops() -> None:
    import tasks.replicas
    from config.settings import get_settings
    from testkit.checker import op_bound

    task = tasks.replicas.spawn
    original = task.run

    def run(op_id: str) -> Any:
        if not task.request.retries:
            raise task.retry(countdown=op_bound(get_settings()) + 15, max_retries=5)
        return original(op_id)

    task.run = run


def _replace(original: Any, defect: Any) -> None:
    """Put ``defect`` wherever a corral module holds ``original`` by name."""
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("workers", "tasks") and module is not None:
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, defect)


DEFECTS: dict[str, Callable[[], None]] = {
    "no-ownership": _no_ownership,
    "no-release": _no_release,
    "no-inflight-bound": _no_inflight_bound,
    "half-full": _half_full,
    "hang-health": _hang_health,
    "short-request-ids": _short_request_ids,
    "late-ops": _late_ops,
}


def main(argv: list[str]) -> None:
    """Apply ``argv[0]``'s defect, then run ``-m MODULE ARGS...``."""
    if len(argv) < 3 or argv[0] not in DEFECTS or argv[1] != "-m":
        sys.exit(f"usage: python -m bench.defects {{{','.join(DEFECTS)}}} -m MODULE [ARGS...]")
    DEFECTS[argv[0]]()
    import stack.worker

    def celery_argv(options: Sequence[str]) -> list[str]:
        tail = ["-m", "celery", "-A", "workers", "worker", *options]
        return [sys.executable, "-m", "bench.defects", argv[0], *tail]

    setattr(stack.worker, "celery_argv", celery_argv)  # noqa: B010 - its callers look it up
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
