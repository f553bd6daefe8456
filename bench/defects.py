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


def _replace(original: Any, defect: Any) -> None:
    """Put ``defect`` wherever a corral module holds ``original`` by name."""
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("workers", "tasks"):
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, defect)


DEFECTS: dict[str, Callable[[], None]] = {
    "no-ownership": _no_ownership,
    "no-release": _no_release,
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
