"""``corral agent``: a reference agent, in a module of its own so it loads only the agents.

An agent process needs none of the control plane (Celery, the store, the registry), and
``compose.yaml`` starts its agents this way.
"""

from __future__ import annotations

import argparse

from agents.__main__ import main as agent_main


def cmd_agent(args: argparse.Namespace) -> int:
    """Run a reference agent (fcdaemon, lambdo or gpus)."""
    return agent_main([args.kind, *args.rest])
