"""The kinds of node corral drives and of operation it records, as enums.

A node is an fcdaemon agent (gRPC) or a Lambdo host (HTTP): :class:`NodeKind` names
it, and :func:`workers.backends.backend` picks the code that speaks to it from one
table, so no caller branches on a node's kind. A function runs on one kind of node
(``functions.backend``), placed by one of the :data:`POLICIES`
(:mod:`workers.fleet.placement` carries them out; :mod:`workers.functions` checks a
function names one). An operation (:class:`OpKind`) is one producer request or one
housekeeping pass that changed something.

Both are string enums: the store keeps the members' plain values (``nodes.kind``,
``functions.backend``, ``operations.kind``; unchanged since the seed), and a member
compares equal to its value. Standard library only, so the command line can offer
the choices without loading the store.
"""

from __future__ import annotations

import enum

__all__ = ["NODE_KINDS", "POLICIES", "NodeKind", "OpKind"]


class NodeKind(enum.StrEnum):
    """What a node is, and so which protocol corral speaks to it."""

    FCDAEMON = "fcdaemon"  # a node agent: gRPC fcdaemon.FcService
    LAMBDO = "lambdo"  # a Lambdo host: HTTP /spawn, /destroy/{id}


#: Every node kind's stored value, for command-line choices and messages.
NODE_KINDS: tuple[str, ...] = tuple(k.value for k in NodeKind)

#: The placement policies a function may name (``functions.policy``).
POLICIES = ("loadbalance", "roundrobin", "spread", "random", "pack")


class OpKind(enum.StrEnum):
    """What an operation does (:mod:`workers.operations`)."""

    SPAWN = "spawn"  # add replicas of a function
    SCALE = "scale"  # set a function's replica target
    DELETE = "delete"  # delete one replica
    HOGS = "hogs"  # start or stop CPU-hog processes on fcdaemon nodes
    REAP = "reap"  # delete idle, stale and stuck replicas
    RECONCILE = "reconcile"  # make rows and the nodes' VMs agree
    HEALTH = "health"  # a health pass that changed a node's health (beat only)
